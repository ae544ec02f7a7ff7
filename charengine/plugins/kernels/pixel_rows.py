"""Triton kernel of plugins/pixel_rows.py (imported only where Triton and a GPU are)."""

import triton
import triton.language as tl


@triton.jit
def nearest2x_rows_kernel(x_ptr, y_ptr, N, H, W, C, BLOCK: tl.constexpr):
    """Program: BLOCK consecutive elements of x [T, H, W, C], each stored at its four pixels
    of y [T, 2 H, 2 W, C]."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + offs, mask=m)
    c = offs % C
    pixel = offs // C
    w = pixel % W
    th = pixel // W  # t * H + h: output rows 2 th and 2 th + 1 of the frames stacked
    at = (2 * th * (2 * W) + 2 * w) * C + c
    tl.store(y_ptr + at, x, mask=m)
    tl.store(y_ptr + at + C, x, mask=m)
    tl.store(y_ptr + at + 2 * W * C, x, mask=m)
    tl.store(y_ptr + at + 2 * W * C + C, x, mask=m)


@triton.jit
def bias_residual_rows_kernel(h_ptr, b_ptr, x_ptr, y_ptr, N, C, BLOCK: tl.constexpr):
    """Program: BLOCK consecutive elements of rows [..., C]: h + bias[c] + x, in fp32."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    h = tl.load(h_ptr + offs, mask=m).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=m).to(tl.float32)
    b = tl.load(b_ptr + offs % C, mask=m).to(tl.float32)
    tl.store(y_ptr + offs, (h + b + x).to(y_ptr.dtype.element_ty), mask=m)
