"""Deployment targets: GPU kind, TP degree, decoder placement and switches, read from data
files (engines/targets/*.toml). Shared by the builder (which bakes a target into an engine)
and the runtime (which reads it back from the manifest and checks it against the machine)."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .config import EngineConfig, Numerics, Switches, check_field_type, from_dict_checked, preset
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
    switches: Switches = field(default_factory=Switches)
    numerics: Numerics = field(default_factory=Numerics)
    description: str = ""

    def __post_init__(self):
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"target {self.name}: device must be 'cpu' or 'cuda', not {self.device!r}")
        if self.decoder not in DECODER_PLACEMENTS:
            raise ValueError(f"target {self.name}: decoder must be one of {DECODER_PLACEMENTS}")
        if self.device == "cuda" and not self.gpu_arch:
            raise ValueError(f"target {self.name}: a cuda target names its gpu_arch (e.g. sm_90)")

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
                       host_process=self.tp > 1)

    def config(self, preset_name: str | None = None) -> EngineConfig:
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
        sw = from_dict_checked(Switches, d.pop("switches", {}), f"{where}: switches")
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
