"""The RMS norm across a whole row (LiveTalk's cross-attention q norm over all heads) as one
kernel: the row read once, the mean of squares, the normalized row rounded to the compute
dtype before its weight, as the reference (charengine.ops.rms_norm_width) rounds; in place
of its six ops (the fp32 copy, the square, the mean, the rsqrt, the product, the rounding
and the weight). With the FP8 cross-attention, the same norm with each head's values then
quantized per (head, token), written head-major for the attention kernel
(`heads_quant_reference`)."""

from __future__ import annotations

import torch

from charengine import fp8
from charengine.ops import rms_norm_width as reference

from . import registry

WARPS_PER_LANES = 1024  # a warp per 1,024 lanes of the row, as the norm kernels take
MAX_WARPS = 8


def triton_rms_norm_width(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel; arguments and result as `reference` (x [T, d], rows contiguous)."""
    import triton

    from .kernels.rms_norm import rms_norm_width_kernel

    if x.stride(-1) != 1:
        raise ValueError("x needs contiguous rows")
    T, d = x.shape
    out = torch.empty_like(x)
    block = triton.next_power_of_2(d)
    rms_norm_width_kernel[(T,)](x, weight.contiguous(), out, d, eps, x.stride(0), out.stride(0),
                                BLOCK=block,
                                num_warps=max(1, min(MAX_WARPS, block // WARPS_PER_LANES)))
    return out


def heads_quant_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, heads: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference`'s norm of x [T, heads * D], then per (head, token) quantization: (q
    [heads, T, D] e4m3, scale [heads, T, 1] fp32)."""
    q, s = fp8.quantize_rows(reference(x, weight, eps).unflatten(-1, (heads, -1)).transpose(0, 1))
    return q.contiguous(), s.contiguous()


def triton_rms_norm_heads_quant(x: torch.Tensor, weight: torch.Tensor, eps: float,
                                heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel; arguments and result as `heads_quant_reference` (x's rows contiguous, a
    power-of-two head dim)."""
    import triton

    from .kernels.rms_norm import rms_norm_heads_quant_kernel

    T, d = x.shape
    D = d // heads
    if x.stride(-1) != 1 or d % heads or D & (D - 1):
        raise ValueError(f"x [{T}, {d}] needs contiguous rows of {heads} heads of a "
                         "power-of-two size")
    q = torch.empty((heads, T, D), dtype=fp8.FP8, device=x.device)
    s = torch.empty((heads, T, 1), dtype=torch.float32, device=x.device)
    block_h = triton.next_power_of_2(heads)
    rms_norm_heads_quant_kernel[(T,)](x, weight.contiguous(), q, s, T, eps, x.stride(0), H=heads,
                                      D=D, BLOCK_H=block_h,
                                      num_warps=max(1, min(MAX_WARPS,
                                                           block_h * D // WARPS_PER_LANES)))
    return q, s


def select(heads_quant: bool = False):
    """The op (registered below; with `heads_quant`, the norm with the per-head FP8
    quantization after it): the kernel on CUDA tensors, the reference on CPU ones."""
    ops = torch.ops.charengine
    return ops.rms_norm_heads_quant.default if heads_quant else ops.rms_norm_width.default


registry.register("rms_norm_width", "(Tensor x, Tensor weight, float eps) -> Tensor", reference,
                  triton_rms_norm_width, lambda x, weight, eps: torch.empty_like(x))
registry.register("rms_norm_heads_quant",
                  "(Tensor x, Tensor weight, float eps, int heads) -> (Tensor, Tensor)",
                  heads_quant_reference, triton_rms_norm_heads_quant,
                  lambda x, weight, eps, heads: (
                      x.new_empty((heads, x.shape[0], x.shape[1] // heads), dtype=fp8.FP8),
                      x.new_empty((heads, x.shape[0], 1), dtype=torch.float32)))
