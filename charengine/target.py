"""Deployment targets: GPU kind, TP degree, decoder placement and switches, read from data
files (charengine/targets/*.toml). Shared by the builder (which bakes a target into an engine)
and the runtime (which reads it back from the manifest and checks it against the machine)."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import EngineConfig, Numerics, check_field_type, from_dict_checked, preset
from .mapping import Mapping

DECODER_PLACEMENTS = ("own-gpu", "shared")


@dataclass(frozen=True)
class Target:
    name: str
    preset: str
    device: str  # "cpu" or "cuda"
    tp: int
    decoder: str  # "own-gpu": rank 0 decodes on GPU 0, TP ranks on 1..tp; "shared": one device
    gpu: str | None = None  # e.g. "H100"; informative, the arch is what must match
    gpu_arch: str | None = None  # e.g. "sm_90"
    switches: Any = None  # the preset family's switches (None: its defaults)
    numerics: Numerics = field(default_factory=Numerics)
    description: str = ""
    # the diffusion ranks in processes of their own beside the host process (audio, decoder,
    # pacing) at any TP degree; a TP layout always has them
    rank_processes: bool = False

    def __post_init__(self):
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"target {self.name}: device must be 'cpu' or 'cuda', not {self.device!r}")
        if self.decoder not in DECODER_PLACEMENTS:
            raise ValueError(f"target {self.name}: decoder must be one of {DECODER_PLACEMENTS}")
        if self.device == "cuda" and not self.gpu_arch:
            raise ValueError(f"target {self.name}: a cuda target names its gpu_arch (e.g. sm_90)")
        if self.switches is None:
            object.__setattr__(self, "switches", self.family.config_types["switches"]())

    @property
    def family(self):
        """The model family of the target's preset."""
        from .family import family, preset_spec

        return family(preset_spec(self.preset).FAMILY)

    @property
    def gpus(self) -> int:
        if self.device == "cpu":
            return 0
        return self.tp + (1 if self.decoder == "own-gpu" else 0)

    def rank_devices(self) -> dict:
        """Which device runs the decoder (and audio encoder) and each TP rank."""
        if self.device == "cpu":
            return {"decoder": "cpu", "tp": ["cpu"] * self.tp}
        first = 1 if self.decoder == "own-gpu" else 0
        return {"decoder": "cuda:0", "tp": [f"cuda:{first + r}" for r in range(self.tp)]}

    def mapping(self, rank: int = 0) -> Mapping:
        """TP rank `rank`'s place in this layout: its device, the decoder's, and whether a
        host process runs beside the TP ranks (every TP layout; TP-1 runs in one process)."""
        devices = self.rank_devices()
        return Mapping(self.tp, rank, devices["tp"][rank], devices["decoder"],
                       host_process=self.tp > 1 or self.rank_processes)

    def config(self, preset_name: str | None = None) -> EngineConfig:
        """The engine config of this target with its preset or `preset_name` (a preset of
        the target's family: its switches are that family's; ValueError, one line, else)."""
        if preset_name is not None and preset_name != self.preset:
            from .family import preset_spec

            theirs, ours = preset_spec(preset_name).FAMILY, preset_spec(self.preset).FAMILY
            if theirs != ours:
                raise ValueError(f"--preset {preset_name} is a {theirs} model and target "
                                 f"{self.name} serves the {ours} family; choose a {theirs} "
                                 "target, or a preset of its family")
        return preset(preset_name or self.preset, switches=self.switches,
                      numerics=self.numerics, tp=self.tp)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Target":
        if not isinstance(d, dict):
            raise TypeError(f"target: expected an object, got {type(d).__name__}")
        d = dict(d)
        where = f"target {d.get('name', '?')}"
        from .family import family, preset_spec

        try:
            fam = family(preset_spec(str(d.get("preset"))).FAMILY)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        sw = from_dict_checked(fam.config_types["switches"], d.pop("switches", None) or {},
                               f"{where}: switches")
        nm = from_dict_checked(Numerics, d.pop("numerics", {}), f"{where}: numerics")
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ValueError(f"{where}: unknown field {unknown[0]!r}")
        missing = sorted(n for n, f in known.items() if n not in d and n not in
                         ("switches", "numerics") and f.default is dataclasses.MISSING)
        if missing:
            raise ValueError(f"{where}: missing field {missing[0]!r}")
        for name, v in d.items():
            check_field_type(f"{where}: {name}", str(known[name].type), v)
        return cls(switches=sw, numerics=nm, **d)

    @classmethod
    def from_toml(cls, path: Path) -> "Target":
        with open(path, "rb") as f:
            return cls.from_dict(tomllib.load(f))
