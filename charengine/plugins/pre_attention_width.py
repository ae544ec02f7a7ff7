"""Fused pre-attention for a q/k RMS norm across all heads (LiveTalk's, the whole width
normed at once) into an FP8 cache: the norm, RoPE at the chunk's positions, the queries'
per-(head, token) quantization for FP8 attention, K/V quantization with the cache's
per-head scales and the write at the device-side slots, in one launch. Without scales the
same launch writes a cache in the compute dtype and gives the queries unquantized (the
chunks before the FP8 cache is calibrated, or a cache that stays in the compute dtype).

plugins/pre_attention.py is the same op for a per-head norm. Here each query or key program
reads its tokens' whole rows once, every head, for the sum of squares and the norm (a
program per (tokens, head) that walked the other heads for the sum took twice as long at
LiveTalk's shape: docs/PERFORMANCE_LOG.md); the values, which need no norm, go a head at a time
in longer runs of slots. It rounds where the reference rounds (the normed vector to the
compute dtype before and after the weight, the rotated one again), so the two differ only in
fp32 summation order: parity tests bound it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from charengine import fp8
from charengine.ops import rms_norm_width
from charengine.rope import rotate

from . import registry
from .pre_attention import check_head_dims


@dataclass(frozen=True)
class RowTiles:
    """The kernel's tiles: tokens per query or key program (their whole rows), tokens per
    value program (one head: runs of that many slots in a value store [H, D, S]) and warps.
    The default is the fastest measured at LiveTalk-1.3B's chunk (scripts/bench_kernels.py
    --preset livetalk-1.3b --only pre_attention, docs/PERFORMANCE_LOG.md)."""

    tokens: int = 4
    value_tokens: int = 32
    warps: int = 4


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor,
              k_norm: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
              k_store: torch.Tensor, v_store: torch.Tensor, k_scale: torch.Tensor | None,
              v_scale: torch.Tensor | None, write_index: torch.Tensor):
    """q, k, v [T, H, D] from the input projections (q, k unnormed); q_norm, k_norm [H * D];
    cos, sin [T, D / 2]; k_store, v_store [H, S, D] FP8 (v_store may be a strided view of a
    [H, D, S] store) with k_scale, v_scale [H, 1, 1]; write_index [T] slots. Writes K and V
    and returns the queries quantized per (head, token): (q8 [H, T, D], scale [H, T, 1]).
    Scales None: the stores are in the compute dtype, the queries come back as they are
    rounded, q [H, T, D], with an empty scale."""
    def norm(x, w):
        return rms_norm_width(x.flatten(1), w, eps).unflatten(1, x.shape[1:]).transpose(0, 1)

    qr = rotate(norm(q, q_norm), cos, sin)
    kr = rotate(norm(k, k_norm), cos, sin)
    if k_scale is None:
        k_store.index_copy_(1, write_index, kr.to(k_store.dtype))
        v_store.index_copy_(1, write_index, v.transpose(0, 1).to(v_store.dtype))
        return qr, registry.no_scale(q)
    fp8.index_copy_(k_store, 1, write_index, fp8.quantize(kr, k_scale))
    fp8.index_copy_(v_store, 1, write_index, fp8.quantize(v.transpose(0, 1), v_scale))
    return fp8.quantize_rows(qr)


def triton_pre_attention_width(q, k, v, q_norm, k_norm, eps, cos, sin, k_store, v_store,
                               k_scale, v_scale, write_index, tiles: RowTiles = RowTiles()):
    """The kernel; arguments and result as `reference` (q, k, v may be strided views with a
    contiguous head dimension, as the input projection's output split)."""
    import triton

    from .kernels.pre_attention_width import pre_attention_rows_kernel

    T, H, D = q.shape
    check_head_dims(q=q, k=k, v=v, k_store=k_store)
    quant = k_scale is not None
    if quant != (k_store.dtype == fp8.FP8) or quant != (v_store.dtype == fp8.FP8):
        raise ValueError("scales go with FP8 stores, and only with them")
    if D % 2 or D & (D - 1):
        raise ValueError(f"head dim {D} must be a power of two (RoPE pairs, one tile)")
    if quant:
        q8 = torch.empty((H, T, D), dtype=fp8.FP8, device=q.device)
        q_scale = torch.empty((H, T, 1), dtype=torch.float32, device=q.device)
    else:
        q8, q_scale = torch.empty((H, T, D), dtype=q.dtype, device=q.device), registry.no_scale(q)
        k_scale = v_scale = q_norm  # unused pointers
    nq = triton.cdiv(T, tiles.tokens)
    # programs: the queries' token tiles, the keys', then (value tile, head) pairs
    grid = (2 * nq + triton.cdiv(T, tiles.value_tokens) * H,)
    pre_attention_rows_kernel[grid](
        q, k, v, q_norm, k_norm, cos.contiguous(), sin.contiguous(), write_index,
        k_scale.reshape(-1), v_scale.reshape(-1), k_store, v_store, q8, q_scale, T, eps,
        q.stride(1), q.stride(0), k.stride(1), k.stride(0), v.stride(1), v.stride(0),
        k_store.stride(0), k_store.stride(1), v_store.stride(0), v_store.stride(1),
        v_store.stride(2), q8.stride(0), q8.stride(1), nq, H=H, D=D, BLOCK_T=tiles.tokens,
        BLOCK_H=triton.next_power_of_2(H), BLOCK_V=tiles.value_tokens, QUANT=quant,
        num_warps=tiles.warps)
    return q8, q_scale


def select():
    """The op (registered below): the Triton kernel on CUDA tensors, the reference on CPU
    ones; `reference`'s signature and result."""
    return op


def op(q, k, v, q_norm, k_norm, eps, cos, sin, k_store, v_store, k_scale, v_scale,
       write_index):
    """The registered op (the kernel on CUDA tensors, the reference on CPU ones), with
    `reference`'s signature and result."""
    return torch.ops.charengine.pre_attention_width.default(
        q, k, v, q_norm, k_norm, eps, cos, sin, k_store, v_store, k_scale, v_scale, write_index)


def _fake(q, k, v, q_norm, k_norm, eps, cos, sin, k_store, v_store, k_scale, v_scale,
          write_index):
    T, H, D = q.shape
    if k_scale is None:
        return q.new_empty((H, T, D)), registry.no_scale(q)
    return (q.new_empty((H, T, D), dtype=fp8.FP8), q.new_empty((H, T, 1), dtype=torch.float32))


registry.register("pre_attention_width",
                  "(Tensor q, Tensor k, Tensor v, Tensor q_norm, Tensor k_norm, float eps, "
                  "Tensor cos, Tensor sin, Tensor(a!) k_store, Tensor(b!) v_store, "
                  "Tensor? k_scale, Tensor? v_scale, Tensor write_index) -> (Tensor, Tensor)",
                  reference, triton_pre_attention_width, _fake)
