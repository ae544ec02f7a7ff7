"""Triton kernel of plugins/rms_norm.py (imported only where Triton and a GPU are)."""

import triton
import triton.language as tl

from .fp8_math import scale_of, to_e4m3


@triton.jit
def rms_round(x, r, w, dt):
    """The RMS norm's roundings, as the reference computes them: x (fp32) times its rsqrt r,
    rounded to the compute dtype dt, times the weight w, rounded again (a product in dt)."""
    return ((x * r).to(dt).to(tl.float32) * w).to(dt)


@triton.jit
def rms_norm_width_kernel(x_ptr, w_ptr, out_ptr, d, eps, stride_x, stride_out,
                          BLOCK: tl.constexpr):
    """One row: x * rsqrt(mean(x^2) + eps) in fp32, rounded to x's dtype, times the weight
    (rounded again, as a product in that dtype)."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < d
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, 0) / d + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, rms_round(x, r, w, dt), mask=m)


@triton.jit
def rms_norm_heads_quant_kernel(x_ptr, w_ptr, q_ptr, s_ptr, T, eps, stride_x,
                                H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr):
    """One token's row [H heads x D]: rms_norm_width_kernel's norm (the same roundings), then
    each head's D values quantized with their own scale (amax / FP8_MAX), stored head-major:
    q [H, T, D] e4m3, s [H, T] fp32."""
    row = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    m = offs_h[:, None] < H
    dt = x_ptr.dtype.element_ty
    cols = offs_h[:, None] * D + offs_d[None, :]
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(tl.sum(x * x, 1), 0) / (H * D) + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    y = rms_round(x, r, w, dt).to(tl.float32)
    s = scale_of(tl.max(tl.abs(y), 1))
    tl.store(s_ptr + offs_h * T + row, s, mask=offs_h < H)
    q = to_e4m3(y, s[:, None], tl.math.div_rn(1.0, s)[:, None])
    tl.store(q_ptr + offs_h[:, None] * (T * D) + row * D + offs_d[None, :], q, mask=m)
