"""Fused FP8 GEMM + tensor-parallel all-reduce for the output projection.

`reference` is the plain path: the FP8 GEMM, then the all-reduce. The fused kernel (symmetric
memory, peer-to-peer stores and signals; never NVLink multicast) reduces output tiles while
later tiles are still in the GEMM, and is used only at the steady-state shape.
"""

from __future__ import annotations

import torch

from charengine import fp8


def reference(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor,
              w_scale: torch.Tensor, out_dtype: torch.dtype, fast_accum: bool,
              all_reduce) -> torch.Tensor:
    """FP8 activations a_q [M, K] with per-token scales [M, 1], FP8 weight slice w_q [N, K]
    with per-channel scales [N]: the rank's partial product, summed over the TP group."""
    return all_reduce(fp8.scaled_mm(a_q, a_scale, w_q, w_scale, out_dtype, fast_accum))


def select(device: torch.device):
    """The op for `device`: the fused kernel on CUDA once it exists, else the reference."""
    return reference
