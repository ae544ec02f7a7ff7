"""Fused pre-attention: QK RMS-norm, RoPE at the new frame's position, K/V quantization with
the cache's per-head scales and the ring write at the device-side write position, in one op.

The paper ran this as three CuTe DSL kernels (Q, K, V) reading the write position from device
memory; here one Triton launch does all three, each (token tile, head) as three programs.
It rounds where the reference rounds (the normed vector to the compute dtype, the roped one
again), so the two differ only in fp32 summation order and fused multiply-adds: parity tests
bound the error in units of the head scale.
"""

from __future__ import annotations


import torch

from charengine import fp8
from charengine.ops import rms_norm_heads
from charengine.rope import rotate

from . import registry


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor,
              k_norm: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
              k_store: torch.Tensor, v_store: torch.Tensor, k_scale, v_scale,
              write_index: torch.Tensor, quantize_q: bool = False):
    """q, k, v [H, T, D] from the input projection; k_store, v_store [H, S, D] one cache's
    tensors (FP8 when scales are given, else unquantized; v_store may be a strided view of a
    [H, D, S] store); write_index [T] slot indices.
    Writes K and V into the stores and returns the normed, roped queries [H, T, D], or with
    quantize_q, those quantized per (head, token) for FP8 attention: (q8, scale [H, T, 1])."""
    q = rotate(rms_norm_heads(q, q_norm, eps), cos, sin)
    k = rotate(rms_norm_heads(k, k_norm, eps), cos, sin)
    if k_scale is not None:
        k, v = fp8.quantize(k, k_scale), fp8.quantize(v, v_scale)
    fp8.index_copy_(k_store, 1, write_index, k)
    fp8.index_copy_(v_store, 1, write_index, v)
    return fp8.quantize_rows(q) if quantize_q else q


def check_head_dims(**tensors: torch.Tensor) -> None:
    """One line naming the first of the kernels' inputs whose head dimension is strided."""
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous head dimension")


def triton_pre_attention(q, k, v, q_norm, k_norm, eps, cos, sin, k_store, v_store, k_scale,
                         v_scale, write_index, quantize_q: bool = False, block_t: int = 16,
                         warps: int = 4):
    """The kernel; arguments and result as `reference` (q, k, v may be strided views with a
    contiguous head dimension, as the input projection's output split into heads)."""
    import triton

    H, T, D = q.shape
    check_head_dims(q=q, k=k, v=v, k_store=k_store)
    quant = k_scale is not None
    if quant != (k_store.dtype == fp8.FP8):
        raise ValueError("scales go with FP8 stores, and only with them")
    if not quant:
        k_scale = v_scale = q_norm  # unused pointers
    q_out = torch.empty((H, T, D), dtype=fp8.FP8 if quantize_q else q.dtype, device=q.device)
    q_scale = torch.empty((H, T, 1), dtype=torch.float32, device=q.device) if quantize_q \
        else q_out
    if D % 2:
        raise ValueError(f"head dim {D} must be even (RoPE pairs)")
    grid = ((T + block_t - 1) // block_t, H, 3)  # parts: queries, keys, values
    from .kernels.pre_attention import pre_attention_kernel

    pre_attention_kernel[grid](
        q, k, v, q_norm, k_norm, cos.contiguous(), sin.contiguous(), write_index,
        k_scale.reshape(-1), v_scale.reshape(-1), k_store, v_store, q_out, q_scale, T, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_store.stride(0), k_store.stride(1), v_store.stride(0), v_store.stride(1),
        v_store.stride(2), q_out.stride(0), q_out.stride(1),
        D=D, BLOCK_T=block_t, BLOCK_D=triton.next_power_of_2(D), QUANT=quant,
        QUANT_Q=quantize_q, num_warps=warps)
    return (q_out, q_scale) if quantize_q else q_out


def op(q, k, v, q_norm, k_norm, eps, cos, sin, k_store, v_store, k_scale, v_scale,
       write_index, quantize_q: bool = False):
    """The registered op with `reference`'s signature and result."""
    out, q_scale = torch.ops.charengine.pre_attention.default(
        q, k, v, q_norm, k_norm, eps, cos, sin, k_store, v_store, k_scale, v_scale, write_index,
        quantize_q)
    return (out, q_scale) if quantize_q else out


def select():
    """The op (registered below): the Triton kernel on CUDA tensors, the reference on CPU
    ones; `reference`'s signature and result."""
    return op


def _as_op(kernel):
    """`kernel` with the op's fixed outputs (an empty scale without quantize_q)."""
    def run(q, k, v, q_norm, k_norm, eps, cos, sin, k_store, v_store, k_scale, v_scale,
            write_index, quantize_q):
        out = kernel(q, k, v, q_norm, k_norm, eps, cos, sin, k_store, v_store, k_scale, v_scale,
                     write_index, quantize_q)
        return out if quantize_q else (out, registry.no_scale(q))
    return run


def _fake(q, k, v, q_norm, k_norm, eps, cos, sin, k_store, v_store, k_scale, v_scale,
          write_index, quantize_q):
    H, T, D = q.shape
    if quantize_q:
        return (q.new_empty((H, T, D), dtype=fp8.FP8),
                q.new_empty((H, T, 1), dtype=torch.float32))
    return q.new_empty((H, T, D)), registry.no_scale(q)


registry.register("pre_attention",
                  "(Tensor q, Tensor k, Tensor v, Tensor q_norm, Tensor k_norm, float eps, "
                  "Tensor cos, Tensor sin, Tensor(a!) k_store, Tensor(b!) v_store, "
                  "Tensor? k_scale, Tensor? v_scale, Tensor write_index, bool quantize_q) "
                  "-> (Tensor, Tensor)", _as_op(reference), _as_op(triton_pre_attention), _fake)
