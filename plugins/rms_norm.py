"""The RMS norm across a whole row (LiveTalk's cross-attention q norm over all heads) as one
kernel: the row read once, the mean of squares, the normalized row rounded to the compute
dtype before its weight, as the reference (charengine.ops.rms_norm_width) rounds; in place
of its six ops (the fp32 copy, the square, the mean, the rsqrt, the product, the rounding
and the weight)."""

from __future__ import annotations

import torch

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


def select():
    """The op (registered below): the kernel on CUDA tensors, the reference on CPU ones."""
    return torch.ops.charengine.rms_norm_width.default


registry.register("rms_norm_width", "(Tensor x, Tensor weight, float eps) -> Tensor", reference,
                  triton_rms_norm_width, lambda x, weight, eps: torch.empty_like(x))
