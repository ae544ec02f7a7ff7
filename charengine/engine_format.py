"""The engine directory's layout, shared by charbuild (writes it) and charrun (reads it).

    manifest.json          format version, target, config, TP degree, rank-to-device map,
                           what it was built with, where the weights came from, and the
                           sha256 of every other file
    rank{r}.safetensors    rank r's weights: block linears FP8 + per-channel scales (cut to
                           its heads and MLP channels), the rest replicated
    adaln.safetensors      baked AdaLN tables: adaln_table [passes, blocks, 3, d],
                           final_table [passes, 2, d]
    side.safetensors       audio encoder, decoder, image encoder, text encoder
"""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path

import torch

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
ADALN = "adaln.safetensors"
SIDE = "side.safetensors"


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def gpu_arch(device_index: int = 0) -> str | None:
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


def this_machine() -> dict:
    """What an engine is built with and checked against."""
    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "gpu_arch": gpu_arch() if cuda else None,
        "gpu_name": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "python": platform.python_version(),
    }
