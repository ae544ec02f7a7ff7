"""Fused pre-attention: QK RMS-norm, RoPE at the new frame's position, K/V quantization with
the cache's per-head scales and the ring write at the device-side write position, in one op.

The paper ran this as three CuTe DSL kernels (Q, K, V) reading the write position from device
memory. `reference` is the definition; kernels are tested against it with absolute error
bounds in units of the head scale.
"""

from __future__ import annotations

import torch

from charengine import fp8
from charengine.ops import rms_norm_heads
from charengine.rope import rotate


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor,
              k_norm: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
              k_store: torch.Tensor, v_store: torch.Tensor, k_scale, v_scale,
              write_index: torch.Tensor) -> torch.Tensor:
    """q, k, v [H, T, D] from the input projection; k_store, v_store [H, S, D] one cache's
    tensors (FP8 when scales are given, else unquantized); write_index [T] slot indices.
    Writes K and V into the stores and returns the normed, roped queries."""
    q = rotate(rms_norm_heads(q, q_norm, eps), cos, sin)
    k = rotate(rms_norm_heads(k, k_norm, eps), cos, sin)
    if k_scale is not None:
        k, v = fp8.quantize(k, k_scale), fp8.quantize(v, v_scale)
    fp8.index_copy_(k_store, 1, write_index, k)
    fp8.index_copy_(v_store, 1, write_index, v)
    return q


def select(device: torch.device):
    """The op for `device`: the Triton kernel on CUDA once it exists, else the reference."""
    return reference
