"""Reading and checking a checkpoint, for any model family: safetensors only (nothing is ever
unpickled), one file or shards listed by their index (`*.safetensors.index.json`, as
released checkpoints of many gigabytes come), and every tensor checked against the family's
layout, the first mismatch one CheckpointError line naming the tensor. And the random
checkpoints of benchmarks and tests: each tensor drawn from a seed of its own name
(`seeded_randn`)."""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from .paths import not_a_file

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CheckpointError(ValueError):
    pass


def seeded_randn(name: str, shape: tuple[int, ...], seed: int, device="cpu") -> torch.Tensor:
    """Standard normal values for tensor `name` of a random checkpoint of `seed`, from a
    generator seeded by the name, so any one tensor can be made without the rest (CPU and
    CUDA generators give different streams)."""
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g, device=device)


INDEX_SUFFIX = ".safetensors.index.json"  # a sharded checkpoint's index


def index_of(path: Path) -> Path | None:
    """The shard index `path` names: the index file itself, or a directory's one index (None:
    `path` is one safetensors file, or a directory holding exactly one)."""
    path = Path(path)
    if path.name.endswith(INDEX_SUFFIX):
        return path
    if path.is_dir():
        found = sorted(path.glob("*" + INDEX_SUFFIX))
        if len(found) > 1:
            raise CheckpointError(f"{path}: holds {len(found)} shard indexes "
                                  f"({', '.join(p.name for p in found)}); name one")
        return found[0] if found else None
    return None


def shard_map(index: Path) -> dict[str, list[str]]:
    """A shard index's shards (file names, in the order they first appear) and the tensors
    each holds; an index that does not parse is one line."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise ValueError("weight_map is not a map of tensor names to shard files")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a shard index ({e})") from None
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        if Path(shard).name != shard:
            raise CheckpointError(f"{index}: tensor {name!r} is in {shard!r}, outside the "
                                  "index's directory")
        shards.setdefault(shard, []).append(name)
    return shards


def checkpoint_files(path: Path) -> list[Path]:
    """The files a checkpoint path reads: one safetensors file, or an index and its shards."""
    path = Path(path)
    index = index_of(path)
    if index is None:
        if path.is_dir():
            found = sorted(path.glob("*.safetensors"))
            if len(found) != 1:
                raise CheckpointError(f"{path}: no shard index (*{INDEX_SUFFIX}) and "
                                      f"{len(found)} safetensors files; name the file")
            return found
        return [path]
    return [index] + [index.parent / shard for shard in shard_map(index)]


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint: a safetensors file, or the shards its index lists (the
    index, or a directory holding it). A missing or unreadable file, a shard missing, or a
    tensor its index places in a shard that lacks it: one line."""
    path = Path(path)
    index = index_of(path)
    if index is None:
        return _read_file(checkpoint_files(path)[0])
    state: dict[str, torch.Tensor] = {}
    for shard, names in shard_map(index).items():
        file = index.parent / shard
        if not file.is_file():
            raise CheckpointError(f"{index}: shard {shard!r} is missing (it holds "
                                  f"{names[0]!r}{f' and {len(names) - 1} more' if len(names) > 1 else ''})")
        tensors = _read_file(file)
        absent = [n for n in names if n not in tensors]
        if absent:
            raise CheckpointError(f"{file}: no tensor {absent[0]!r}, which {index.name} "
                                  "places in it")
        state.update((n, tensors[n]) for n in names)
    return state


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file; a missing or unreadable file is one line."""
    if (why := not_a_file(path)) is not None:
        raise CheckpointError(f"{path}: {why}")
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
