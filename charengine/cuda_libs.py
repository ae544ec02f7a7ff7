"""The CUDA libraries torch has loaded, for calls torch does not expose (through ctypes)."""

from __future__ import annotations

import ctypes

import torch


def loaded(stem: str) -> ctypes.CDLL | None:
    """The library `stem` (e.g. "libcudart") of torch's CUDA: by its soname for torch's CUDA
    major version (a library already loaded is matched by its soname), else as mapped into
    this process (torch's wheels load them from their own directories); None if neither."""
    major = (torch.version.cuda or "").split(".")[0]
    try:
        return ctypes.CDLL(f"{stem}.so.{major}")
    except OSError:
        pass
    with open("/proc/self/maps") as f:
        for line in f:
            if stem in line:
                return ctypes.CDLL(line.split()[-1])
    return None
