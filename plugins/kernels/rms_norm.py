"""Triton kernel of plugins/rms_norm.py (imported only where Triton and a GPU are)."""

import triton
import triton.language as tl


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
    y = (x * r).to(dt).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (y * w).to(dt), mask=m)
