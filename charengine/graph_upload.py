"""cudaGraphUpload for torch's captured graphs: a graph's first launch also uploads its work
to the device, which an upload ahead of time does alone, without running the graph (a
warm-up then need not replay every graph once so that a user's first chunks start fast).

Through ctypes on the CUDA runtime torch has loaded (`torch.cuda.CUDAGraph` exposes its
executable graph but not the upload). GPU only."""

from __future__ import annotations

import ctypes

import torch


def cudart() -> ctypes.CDLL:
    """The libcudart this process uses: by its soname, else found in this process's mappings
    (torch's wheels load it from their own directory)."""
    major = (torch.version.cuda or "").split(".")[0]
    try:
        return ctypes.CDLL(f"libcudart.so.{major}")
    except OSError:
        pass
    torch.cuda.init()
    with open("/proc/self/maps") as f:
        for line in f:
            if "libcudart" in line:
                return ctypes.CDLL(line.split()[-1])
    raise RuntimeError("libcudart is not loaded in this process (torch built without CUDA?)")


def upload(lib: ctypes.CDLL, graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> None:
    """Upload `graph`'s executable graph on `stream` (ordered with the stream's work)."""
    status = lib.cudaGraphUpload(ctypes.c_void_p(graph.raw_cuda_graph_exec()),
                                 ctypes.c_void_p(stream.cuda_stream))
    if status != 0:
        raise RuntimeError(f"cudaGraphUpload failed with status {status}")
