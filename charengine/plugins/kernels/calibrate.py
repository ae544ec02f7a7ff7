"""Triton kernels of plugins/calibrate.py (imported only where Triton and a GPU are)."""

import triton
import triton.language as tl

from .fp8_math import to_e4m3


@triton.jit
def cache_amax_kernel(x_ptr, amax_ptr, S, stride_row, stride_s, D: tl.constexpr,
                      BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (row, tile): the max |x| of BLOCK_S slots of one (cache, head) row, folded
    into amax[row] with an atomic max (amax starts at 0; |x| >= 0, so float order holds)."""
    row = tl.program_id(0)
    offs_s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    m = (offs_s[:, None] < S) & (offs_d[None, :] < D)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_row + offs_s[:, None] * stride_s
                + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr + row, tl.max(tl.max(tl.abs(x), 1), 0))


@triton.jit
def cache_quantize_kernel(x_ptr, scale_ptr, q_ptr, S, H, stride_row, stride_s, q_stride_c,
                          q_stride_h, q_stride_s, q_stride_d, D: tl.constexpr,
                          BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (row, tile): BLOCK_S slots of one (cache, head) row divided by the row's scale,
    saturated to +-FP8_MAX and rounded to e4m3, stored through the destination's strides (a value
    store kept [head_dim, slots] is written transposed)."""
    row = tl.program_id(0)
    c = (row // H).to(tl.int64)
    h = row % H
    offs_s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    m = (offs_s[:, None] < S) & (offs_d[None, :] < D)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_row + offs_s[:, None] * stride_s
                + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + row)
    dst = q_ptr + c * q_stride_c + h * q_stride_h + offs_s[:, None] * q_stride_s \
        + offs_d[None, :] * q_stride_d
    tl.store(dst, to_e4m3(x, scale, tl.math.div_rn(1.0, scale)), mask=m)
