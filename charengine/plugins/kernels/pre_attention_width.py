"""Triton kernel of plugins/pre_attention_width.py (imported only where Triton and a GPU
are)."""

import triton
import triton.language as tl

from .fp8_math import FP8_MAX, div_scale, scale_of, to_e4m3
from .rms_norm import rms_round


@triton.jit
def _rows_norm_rope(ptr, stride_h, stride_t, offs_t, offs_h, offs_c, w_ptr, cos, sin, eps,
                    T, H: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    """BLOCK_T tokens' whole rows [BLOCK_T, BLOCK_H, D] (heads past H read as zero), read once:
    RMS-normed over the H heads, rounded to the compute dtype before the weight and after
    it, then each head's adjacent pairs rotated in fp32 (cos, sin [BLOCK_T, 1, D / 2])."""
    dt = ptr.dtype.element_ty
    m = (offs_t[:, None, None] < T) & (offs_h[None, :, None] < H)
    x = tl.load(ptr + offs_t[:, None, None] * stride_t + offs_h[None, :, None] * stride_h
                + offs_c[None, None, :], mask=m, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(tl.sum(x * x, 2), 1) / (H * D) + eps)[:, None, None]
    w = tl.load(w_ptr + offs_h[:, None] * D + offs_c[None, :], mask=offs_h[:, None] < H,
                other=0.0).to(tl.float32)
    n = rms_round(x, r, w[None], dt).to(tl.float32)
    n0, n1 = tl.split(tl.reshape(n, [BLOCK_T, BLOCK_H, D // 2, 2]))
    return tl.reshape(tl.join(n0 * cos - n1 * sin, n0 * sin + n1 * cos),
                      [BLOCK_T, BLOCK_H, D])


@triton.jit
def pre_attention_rows_kernel(q_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, idx_ptr,
                              ks_ptr, vs_ptr, ko_ptr, vo_ptr, qo_ptr, qs_ptr, T, eps,
                              stride_qh, stride_qt, stride_kh, stride_kt, stride_vh,
                              stride_vt, stride_oh, stride_os, stride_voh, stride_vos,
                              stride_vod, stride_qoh, stride_qot, NQ, H: tl.constexpr,
                              D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                              BLOCK_V: tl.constexpr, QUANT: tl.constexpr):
    """A 1-D grid: programs [0, NQ) the queries of BLOCK_T tokens, all heads at once (read
    once, normed, rotated, quantized per head and token); [NQ, 2 NQ) the keys alike
    (quantized with each head's scale, written at their slots); then one program per
    (BLOCK_V tokens, head) of values (quantized, written through the store's strides: a
    value store [H, D, S] takes BLOCK_V consecutive slots per row). Without QUANT the stores
    are in the compute dtype and the queries are written as they are rounded."""
    pid = tl.program_id(0)
    dt = q_ptr.dtype.element_ty
    offs_c = tl.arange(0, D)
    if pid < 2 * NQ:
        half: tl.constexpr = D // 2
        is_k = pid >= NQ
        offs_t = (pid - is_k * NQ) * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_h = tl.arange(0, BLOCK_H)
        offs_j = tl.arange(0, half)
        tm = offs_t[:, None] < T
        cos = tl.load(cos_ptr + offs_t[:, None] * half + offs_j[None, :], mask=tm,
                      other=0.0)[:, None, :]
        sin = tl.load(sin_ptr + offs_t[:, None] * half + offs_j[None, :], mask=tm,
                      other=0.0)[:, None, :]
        m = (offs_t[:, None, None] < T) & (offs_h[None, :, None] < H)
        if pid < NQ:
            q = _rows_norm_rope(q_ptr, stride_qh, stride_qt, offs_t, offs_h, offs_c, qn_ptr,
                                cos, sin, eps, T, H, D, BLOCK_T, BLOCK_H).to(dt)
            qo = qo_ptr + offs_h[None, :, None] * stride_qoh \
                + offs_t[:, None, None] * stride_qot + offs_c[None, None, :]
            if QUANT:
                q = q.to(tl.float32)
                qs = scale_of(tl.max(tl.abs(q), 2))
                tl.store(qs_ptr + offs_h[None, :] * T + offs_t[:, None], qs,
                         mask=(offs_t[:, None] < T) & (offs_h[None, :] < H))
                tl.store(qo, to_e4m3(q, qs[:, :, None], tl.math.div_rn(1.0, qs)[:, :, None]),
                         mask=m)
            else:
                tl.store(qo, q, mask=m)
        else:
            k = _rows_norm_rope(k_ptr, stride_kh, stride_kt, offs_t, offs_h, offs_c, kn_ptr,
                                cos, sin, eps, T, H, D, BLOCK_T, BLOCK_H).to(dt)
            slot = tl.load(idx_ptr + offs_t, mask=offs_t < T, other=0)
            dst = offs_h[None, :, None] * stride_oh + slot[:, None, None] * stride_os \
                + offs_c[None, None, :]
            if QUANT:
                ks = tl.load(ks_ptr + offs_h, mask=offs_h < H, other=1.0)[None, :, None]
                k = tl.clamp(div_scale(k.to(tl.float32), ks, tl.math.div_rn(1.0, ks)),
                             -FP8_MAX, FP8_MAX)
            tl.store(ko_ptr + dst, k.to(ko_ptr.dtype.element_ty), mask=m)
    else:
        # names apart from the other branch's: a name both branches bind must keep its type
        r = pid - 2 * NQ
        h = r % H
        offs_v = (r // H) * BLOCK_V + tl.arange(0, BLOCK_V)
        vmask = offs_v[:, None] < T
        vslot = tl.load(idx_ptr + offs_v, mask=offs_v < T, other=0)
        v = tl.load(v_ptr + h * stride_vh + offs_v[:, None] * stride_vt + offs_c[None, :],
                    mask=vmask, other=0.0)
        if QUANT:
            vs = tl.load(vs_ptr + h)
            v = tl.clamp(div_scale(v.to(tl.float32), vs, tl.math.div_rn(1.0, vs)), -FP8_MAX,
                         FP8_MAX)
        v_dst = h * stride_voh + vslot[:, None] * stride_vos + offs_c[None, :] * stride_vod
        tl.store(vo_ptr + v_dst, v.to(vo_ptr.dtype.element_ty), mask=vmask)
