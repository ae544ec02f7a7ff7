"""Triton kernel of plugins/delta_rotation.py (imported only where Triton and a GPU are)."""

import triton
import triton.language as tl

from .fp8_math import FP8_MAX, div_scale


@triton.jit
def delta_rotation_kernel(k_ptr, s_ptr, cos_ptr, sin_ptr, rows, H, W, G,
                          stride_c, stride_h, stride_s, stride_sc, stride_sh,
                          NT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr):
    """Rows are (cache, head, window slot); each row's first 2 * NT bytes (the temporal pairs)
    are loaded contiguously, split into pairs, rotated and stored back."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = (r // (H * W)).to(tl.int64)  # cache offsets pass 2^31 at full size
    h = (r // W) % H
    slot = G + r % W
    col = tl.arange(0, 2 * BLOCK_J)
    j = tl.arange(0, BLOCK_J)
    mask = (r[:, None] < rows) & (col[None, :] < 2 * NT)
    scale = tl.load(s_ptr + c * stride_sc + h * stride_sh, mask=r < rows, other=1.0)[:, None]
    cs = tl.load(cos_ptr + j, mask=j < NT, other=1.0)[None, :]
    sn = tl.load(sin_ptr + j, mask=j < NT, other=0.0)[None, :]
    ptrs = k_ptr + c[:, None] * stride_c + h[:, None] * stride_h + slot[:, None] * stride_s \
        + col[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * scale
    x0, x1 = tl.split(tl.reshape(x, [BLOCK_R, BLOCK_J, 2]))
    r_scale = tl.math.div_rn(1.0, scale)
    y0 = tl.clamp(div_scale(x0 * cs - x1 * sn, scale, r_scale), -FP8_MAX, FP8_MAX)
    y1 = tl.clamp(div_scale(x0 * sn + x1 * cs, scale, r_scale), -FP8_MAX, FP8_MAX)
    y = tl.reshape(tl.join(y0, y1), [BLOCK_R, 2 * BLOCK_J])
    tl.store(ptrs, y.to(tl.float8e4nv), mask=mask)
