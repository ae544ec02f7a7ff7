"""Configuration every family shares: the numerics, and the engine config that holds a
family's spec with the family's own cache policy, schedule and switches (each family's
`config_types`: the characters family's are in characters/config.py, LiveTalk's in
livetalk/spec.py).

One frozen `EngineConfig` describes what a step computes and which optimizations are on. A
family's spec and presets are its own (charengine/family.py); `preset(name)` finds a preset
in any family. Invalid combinations fail at construction with a message that says what to
change (the family's `check_config`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any



@dataclass(frozen=True)
class Numerics:
    """What precision each part runs in. Not an optimization switch: these change the output.

    fp8_gemm: block linears take per-token FP8 activations (weights are always stored FP8 with
    per-output-channel scales). fp8_attention: attention reads FP8 K/V (the paper's production
    and baseline both do; off gives the paper's "bf16 cache" arm).
    """

    dtype: str = "bfloat16"  # activations and the unquantized cache: "bfloat16" or "float32"
    fp8_gemm: bool = True
    fp8_attention: bool = True
    # FP8 GEMMs without promoting partial sums to fp32 (GPU only), as vLLM's sm90 FP8 GEMMs
    # run: more error per GEMM than promoted sums, far less than FP8 quantization's own, and a
    # faster step (docs/PERFORMANCE_LOG.md, "Fast accumulation")
    fast_accum: bool = True
    # the block linears fast_accum applies to, by the family's names for them (the
    # characters family's: "w_in", "w_out"; its check_config names the unknown); None: all
    fast_accum_linears: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"numerics.dtype must be 'bfloat16' or 'float32', not {self.dtype!r}")
        if self.fast_accum_linears is not None:  # a list when read back from JSON
            object.__setattr__(self, "fast_accum_linears", tuple(self.fast_accum_linears))

    def fast_accum_for(self, linear: str) -> bool:
        """Whether block linear `linear` accumulates without promotion."""
        return self.fast_accum and (self.fast_accum_linears is None
                                    or linear in self.fast_accum_linears)


@dataclass(frozen=True)
class EngineConfig:
    """What a step computes: the family's spec (`model`), its cache geometry, schedule and
    switches (each of the family's own types, charengine/family.py `config_types`; None
    takes the family's defaults), the numerics and the TP degree."""

    model: Any  # a model family's spec (charengine/family.py)
    cache: Any = None  # the family's cache geometry
    schedule: Any = None  # the family's fixed schedule
    switches: Any = None  # the family's optimization switches
    numerics: Numerics = field(default_factory=Numerics)
    tp: int = 1

    NESTED = {"numerics": Numerics}  # fields read back as dataclasses (not a field)

    def __post_init__(self):
        from .family import family

        fam = family(self.family)
        for name, typ in fam.config_types.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, typ())
        fam.check_config(self)

    @property
    def family(self) -> str:
        """The model family's name (charengine/family.py)."""
        return self.model.FAMILY

    def replace(self, **kw) -> "EngineConfig":
        return dataclasses.replace(self, **kw)


def preset(name: str, **kw) -> EngineConfig:
    """The engine config of preset `name`, of whichever family holds it."""
    from .family import preset_spec

    return EngineConfig(model=preset_spec(name), **kw)


_SCALARS = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}


def check_field_type(where: str, annotation: str, v) -> None:
    """A field read from a manifest against its annotation: int, float, bool, str, None
    where allowed, and tuples of those (JSON lists)."""
    kinds = [a.strip() for a in annotation.split("|")]
    if v is None:
        if "None" in kinds:
            return
        raise TypeError(f"{where}: expected {annotation}, got null")
    for kind in kinds:
        if kind.startswith("tuple[") and isinstance(v, (list, tuple)):
            inner = kind[len("tuple["):-1].split(",")[0].strip()
            for i, x in enumerate(v):
                check_field_type(f"{where}[{i}]", inner, x)
            return
        allowed = _SCALARS.get(kind)
        if allowed and isinstance(v, allowed) and not (kind != "bool" and isinstance(v, bool)):
            return
        if kind not in _SCALARS and not kind.startswith("tuple["):
            return  # a type this reader does not check (nested specs are checked as dicts)
    raise TypeError(f"{where}: expected {annotation}, got {type(v).__name__} {v!r}"[:200])


def from_dict_checked(cls, d: dict, where: str = "config", nested: dict | None = None):
    """`cls` from a dict read back from JSON, each field checked against its annotation;
    fields holding dataclasses (`cls.NESTED`, or `nested`) read the same way."""
    if not isinstance(d, dict):
        raise TypeError(f"{where}: expected an object, got {type(d).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}")
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name not in d:
            continue
        v = d[f.name]
        types = nested if nested is not None else getattr(cls, "NESTED", {})
        if f.name in types:
            v = from_dict_checked(types[f.name], v, f"{where}.{f.name}")
        else:
            check_field_type(f"{where}.{f.name}", str(f.type), v)
            if isinstance(v, list):
                v = tuple(v)
        kw[f.name] = v
    return cls(**kw)


def config_to_dict(cfg: EngineConfig) -> dict:
    return {**dataclasses.asdict(cfg), "family": cfg.family}


def config_from_dict(d: dict) -> EngineConfig:
    """Inverse of config_to_dict; validates like any construction. The model's spec type is
    its family's ("characters" where the dict names none)."""
    from .family import family

    if not isinstance(d, dict):
        raise TypeError(f"config: expected an object, got {type(d).__name__}")
    d = dict(d)
    name = d.pop("family", "characters")
    check_field_type("config.family", "str", name)
    fam = family(name)
    return from_dict_checked(EngineConfig, d, nested={**EngineConfig.NESTED, **fam.config_types,
                                                      "model": fam.spec_type})
