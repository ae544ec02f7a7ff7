"""Triton kernel of plugins/pre_attention_width.py (imported only where Triton and a GPU
are)."""

import triton
import triton.language as tl

from .fp8_math import AMAX_FLOOR, FP8_MAX, div_scale, to_e4m3


@triton.jit
def _width_norm_rope(ptr, stride_h, stride_t, h, offs_t, offs_c, w_ptr, cos, sin, eps, T,
                     H: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr):
    """Head h of BLOCK_T tokens RMS-normed over all H heads (the sum of squares walks the
    row's heads), rounded to the compute dtype before the weight and after it, then its
    adjacent pairs rotated in fp32. Returns the rotated rows [BLOCK_T, D] (fp32 holding
    compute-dtype values before the rotation's rounding)."""
    dt = ptr.dtype.element_ty
    tmask = offs_t[:, None] < T
    ss = tl.zeros([BLOCK_T], dtype=tl.float32)
    for hh in tl.static_range(H):
        xh = tl.load(ptr + hh * stride_h + offs_t[:, None] * stride_t + offs_c[None, :],
                     mask=tmask, other=0.0).to(tl.float32)
        ss += tl.sum(xh * xh, 1)
    r = tl.math.rsqrt(ss / (H * D) + eps)[:, None]
    x = tl.load(ptr + h * stride_h + offs_t[:, None] * stride_t + offs_c[None, :], mask=tmask,
                other=0.0).to(tl.float32)
    w = tl.load(w_ptr + h * D + offs_c).to(tl.float32)
    n = ((x * r).to(dt).to(tl.float32) * w[None, :]).to(dt).to(tl.float32)
    n0, n1 = tl.split(tl.reshape(n, [BLOCK_T, D // 2, 2]))
    return tl.reshape(tl.join(n0 * cos - n1 * sin, n0 * sin + n1 * cos), [BLOCK_T, D])


@triton.jit
def pre_attention_width_kernel(q_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, idx_ptr,
                               ks_ptr, vs_ptr, ko_ptr, vo_ptr, qo_ptr, qs_ptr, T, eps,
                               stride_qh, stride_qt, stride_kh, stride_kt, stride_vh,
                               stride_vt, stride_oh, stride_os, stride_voh, stride_vos,
                               stride_vod, stride_qoh, stride_qot,
                               H: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
                               QUANT: tl.constexpr):
    """Program (token tile, head, part): part 0 the queries (normed, rotated, quantized per
    head and token), 1 the keys (normed, rotated, quantized with the head's scale, written at
    their slots), 2 the values (quantized, written through the store's strides). Without
    QUANT the stores are in the compute dtype: queries, keys and values are written as they
    are rounded, with no scales."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    part = tl.program_id(2)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.arange(0, D)
    mask = offs_t[:, None] < T
    dt = q_ptr.dtype.element_ty
    if part < 2:
        half: tl.constexpr = D // 2
        offs_j = tl.arange(0, half)
        cs_off = offs_t[:, None] * half + offs_j[None, :]
        cos = tl.load(cos_ptr + cs_off, mask=mask, other=0.0)
        sin = tl.load(sin_ptr + cs_off, mask=mask, other=0.0)
        if part == 0:
            q = _width_norm_rope(q_ptr, stride_qh, stride_qt, h, offs_t, offs_c, qn_ptr, cos,
                                 sin, eps, T, H, D, BLOCK_T).to(dt)
            qo = qo_ptr + h * stride_qoh + offs_t[:, None] * stride_qot + offs_c[None, :]
            if QUANT:
                q = q.to(tl.float32)
                qs = tl.maximum(tl.max(tl.abs(q), 1), AMAX_FLOOR) / FP8_MAX
                tl.store(qs_ptr + h * T + offs_t, qs, mask=offs_t < T)
                tl.store(qo, to_e4m3(q, qs[:, None], tl.math.div_rn(1.0, qs)[:, None]),
                         mask=mask)
            else:
                tl.store(qo, q, mask=mask)
        else:
            k = _width_norm_rope(k_ptr, stride_kh, stride_kt, h, offs_t, offs_c, kn_ptr, cos,
                                 sin, eps, T, H, D, BLOCK_T).to(dt)
            slot = tl.load(idx_ptr + offs_t, mask=offs_t < T, other=0)
            dst = h * stride_oh + slot[:, None] * stride_os + offs_c[None, :]
            if QUANT:
                ks = tl.load(ks_ptr + h)
                k = tl.clamp(div_scale(k.to(tl.float32), ks, tl.math.div_rn(1.0, ks)),
                             -FP8_MAX, FP8_MAX)
            tl.store(ko_ptr + dst, k.to(ko_ptr.dtype.element_ty), mask=mask)
    else:
        slot = tl.load(idx_ptr + offs_t, mask=offs_t < T, other=0)
        v = tl.load(v_ptr + h * stride_vh + offs_t[:, None] * stride_vt + offs_c[None, :],
                    mask=mask, other=0.0)
        if QUANT:
            vs = tl.load(vs_ptr + h)
            v = tl.clamp(div_scale(v.to(tl.float32), vs, tl.math.div_rn(1.0, vs)), -FP8_MAX,
                         FP8_MAX)
        v_dst = h * stride_voh + slot[:, None] * stride_vos + offs_c[None, :] * stride_vod
        tl.store(vo_ptr + v_dst, v.to(vo_ptr.dtype.element_ty), mask=mask)
