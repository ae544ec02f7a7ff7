"""Reading and checking a checkpoint, for any model family: safetensors only (nothing is ever
unpickled), and every tensor checked against the family's layout, the first mismatch one
CheckpointError line naming the tensor. And the random checkpoints of benchmarks and tests:
each tensor drawn from a seed of its own name (`seeded_randn`)."""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CheckpointError(ValueError):
    pass


def seeded_randn(name: str, shape: tuple[int, ...], seed: int, device="cpu") -> torch.Tensor:
    """Standard normal values for tensor `name` of a random checkpoint of `seed`, from a
    generator seeded by the name, so any one tensor can be made without the rest (CPU and
    CUDA generators give different streams)."""
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g, device=device)


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file; a missing or unreadable file is one line."""
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for a damaged header
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def check_tensors(want: dict[str, tuple[int, ...]], state: Mapping, where: str, what: str,
                  dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> None:
    """Names, shapes, dtypes and finite values of `state` against `want`; the first mismatch
    is one CheckpointError line naming the tensor (`what` names the layout in messages)."""
    missing = [n for n in want if n not in state]
    if missing:
        raise CheckpointError(f"{where}: missing tensor {missing[0]!r} (shape {list(want[missing[0]])}"
                              f" for {what}){f' and {len(missing) - 1} more' if len(missing) > 1 else ''}")
    extra = sorted(set(state) - set(want))
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor {extra[0]!r}: not part of {what}'s layout")
    names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    for name, shape in want.items():
        t = state[name]
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{where}: tensor {name!r} has shape {list(t.shape)}, "
                                  f"{what} needs {list(shape)}")
        if t.dtype not in dtypes:
            raise CheckpointError(f"{where}: tensor {name!r} has dtype {t.dtype}, expected one of "
                                  f"{names}")
        bad = int(t.numel() - torch.isfinite(t).sum())
        if bad:
            raise CheckpointError(f"{where}: tensor {name!r} holds {bad} non-finite value"
                                  f"{'s' if bad > 1 else ''} (NaN or infinity); the checkpoint "
                                  "is damaged or was saved from a diverged run")
