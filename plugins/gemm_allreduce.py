"""Fused FP8 GEMM + tensor-parallel all-reduce for the output projection.

`reference` is the plain path: the FP8 GEMM, then the all-reduce. The fused kernel (symmetric
memory, peer-to-peer stores and signals; never NVLink multicast) reduces output tiles while
later tiles are still in the GEMM, and is used only at the steady-state shape.
"""

from __future__ import annotations

import torch

from charengine import fp8


def reference(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype,
              fp8_activations: bool, fast_accum: bool, all_reduce) -> torch.Tensor:
    return all_reduce(fp8.linear(x, w_q, w_scale, out_dtype, fp8_activations, fast_accum))


def select(device: torch.device):
    """The op for `device`: the fused kernel on CUDA once it exists, else the reference."""
    return reference
