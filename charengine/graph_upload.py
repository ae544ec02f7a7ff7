"""cudaGraphUpload for torch's captured graphs: a graph's first launch also uploads its work
to the device, which an upload ahead of time does alone, without running the graph (a
warm-up then need not replay every graph once so that a user's first chunks start fast).

Through ctypes on the CUDA runtime torch has loaded (`torch.cuda.CUDAGraph` exposes its
executable graph but not the upload). GPU only."""

from __future__ import annotations

import ctypes

import torch

from . import cuda_libs


def cudart() -> ctypes.CDLL:
    """The libcudart this process uses."""
    torch.cuda.init()
    lib = cuda_libs.loaded("libcudart")
    if lib is None:
        raise RuntimeError("libcudart is not loaded in this process (torch built without CUDA?)")
    return lib


def upload(lib: ctypes.CDLL, graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> None:
    """Upload `graph`'s executable graph on `stream` (ordered with the stream's work)."""
    status = lib.cudaGraphUpload(ctypes.c_void_p(graph.raw_cuda_graph_exec()),
                                 ctypes.c_void_p(stream.cuda_stream))
    if status != 0:
        raise RuntimeError(f"cudaGraphUpload failed with status {status}")
