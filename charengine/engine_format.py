"""The engine directory's layout, shared by charbuild (writes it) and charrun (reads it).

    manifest.json          format version, target, config, TP degree, the ranks built,
                           rank-to-device map, what it was built with, where the weights came
                           from, the kernels baked and the per-shape kernel plan, and the size
                           and chunked sha256 of every other file
    rank{r}.safetensors    rank r's weights: block linears FP8 + per-channel scales (cut to
                           its heads and MLP channels), the rest replicated
    adaln.safetensors      baked AdaLN tables: adaln_table [passes, blocks, 3, d],
                           final_table [passes, 2, d]
    side.safetensors       audio encoder, decoder, image encoder, text encoder
    onnx/                  charbuild --export-onnx: the decoder and the audio encoder as ONNX
                           (for other runtimes; charrun neither reads nor checks them)
    kernels/triton/        GPU targets: the compiled Triton kernels (cubins and launchers) of
                           every code path a session runs, from a warm-up on the target GPU
"""

from __future__ import annotations

import hashlib
import os
import platform
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

FORMAT_VERSION = 2
MANIFEST = "manifest.json"
ADALN = "adaln.safetensors"
SIDE = "side.safetensors"
KERNELS = "kernels"
TRITON_KERNELS = f"{KERNELS}/triton"
QUACK_KERNELS = f"{KERNELS}/quack"  # QuACK's compiled objects (CuTe DSL GEMMs), beside Triton's
ONNX = "onnx"  # charbuild --export-onnx's graphs of the side networks (docs/ENGINE_FORMAT.md)
CHUNK_BYTES = 1 << 28  # checksums per 256 MiB chunk, verified in parallel at load


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


def _chunk_sha256(path: Path, offset: int, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        left = size
        while left:
            block = f.read(min(left, 1 << 24))
            if not block:
                break
            h.update(block)  # hashlib releases the GIL on large buffers: threads run in parallel
            left -= len(block)
    return h.hexdigest()


def checksums(root: Path, names: list[str], workers: int | None = None) -> dict[str, dict]:
    """{name: {"bytes": size, "sha256": [digest of each CHUNK_BYTES chunk]}} for files under
    root, hashed chunk by chunk on a thread pool (a 19 GB rank file takes seconds, not a
    minute)."""
    jobs = []
    for name in names:
        size = (root / name).stat().st_size
        jobs += [(name, off, min(CHUNK_BYTES, size - off)) for off in range(0, size, CHUNK_BYTES)]
        if size == 0:
            jobs.append((name, 0, 0))
    with ThreadPoolExecutor(workers or min(16, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(lambda j: _chunk_sha256(root / j[0], j[1], j[2]), jobs))
    out = {name: {"bytes": (root / name).stat().st_size, "sha256": []} for name in names}
    for (name, _, _), d in zip(jobs, digests):
        out[name]["sha256"].append(d)
    return out


def sha256(path: Path) -> str:
    """One digest of a whole file (the checkpoint a build came from)."""
    return _chunk_sha256(path, 0, path.stat().st_size)


def engine_files(root: Path) -> list[str]:
    """Every file under an engine directory but the manifest, as relative POSIX paths."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def gpu_arch(device_index: int = 0) -> str | None:
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def this_machine() -> dict:
    """What an engine is built with and checked against."""
    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "triton": triton_version(),
        "gpu_arch": gpu_arch() if cuda else None,
        "gpu_name": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "python": platform.python_version(),
    }
