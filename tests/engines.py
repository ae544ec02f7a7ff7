"""Shared by the tests: real engines built into temporary directories."""

from pathlib import Path

from charengine.builder.build import build
from charengine.builder.build_config import BuildConfig
from charengine.target import Target

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ROOT / "charengine" / "targets"


def build_target(tmp: Path, target_file: str = "cpu-tiny", ranks=None, kernels=False,
                 **overrides) -> Path:
    """Build the target file's engine (with fields overridden) under tmp; a GPU target's
    kernels are compiled only when asked (that needs its GPU)."""
    target = Target.from_toml(TARGETS / f"{target_file}.toml")
    if overrides:
        target = Target.from_dict({**target.to_dict(), **overrides})
    out = tmp / target.name
    build(BuildConfig(target, out, seed=0, ranks=ranks, kernels=kernels), log=lambda s: None)
    return out
