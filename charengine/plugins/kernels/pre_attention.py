"""Triton kernel of plugins/pre_attention.py (imported only where Triton and a GPU are)."""

import triton
import triton.language as tl

from .fp8_math import FP8_MAX, div_scale, scale_of, to_e4m3


@triton.jit
def _norm_rope(ptr, stride_h, stride_t, h, offs_t, offs_c, w_ptr, cos, sin, eps, T,
               D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows of BLOCK_T tokens, loaded whole (contiguous); RMS-norm, round to the compute
    dtype, rotate adjacent pairs in fp32. Returns the rotated rows [BLOCK_T, BLOCK_D]."""
    mask = (offs_t[:, None] < T) & (offs_c[None, :] < D)
    x = tl.load(ptr + h * stride_h + offs_t[:, None] * stride_t + offs_c[None, :], mask=mask,
                other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
    w = tl.load(w_ptr + offs_c, mask=offs_c < D, other=0.0).to(tl.float32)
    n = (x * r * w[None, :]).to(ptr.dtype.element_ty).to(tl.float32)
    n0, n1 = tl.split(tl.reshape(n, [BLOCK_T, BLOCK_D // 2, 2]))
    return tl.reshape(tl.join(n0 * cos - n1 * sin, n0 * sin + n1 * cos), [BLOCK_T, BLOCK_D])


@triton.jit
def pre_attention_kernel(q_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, idx_ptr,
                         ks_ptr, vs_ptr, ko_ptr, vo_ptr, qo_ptr, qs_ptr, T, eps,
                         stride_qh, stride_qt, stride_kh, stride_kt, stride_vh, stride_vt,
                         stride_oh, stride_os, stride_voh, stride_vos, stride_vod,
                         stride_qoh, stride_qot,
                         D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                         QUANT: tl.constexpr, QUANT_Q: tl.constexpr):
    """Program (token tile, head, part): part 0 the queries, 1 the keys, 2 the values. Three
    short programs instead of one that does all three, the parts' loads and stores no longer
    in one chain, are the faster (docs/PERFORMANCE_LOG.md, "Kernels alone")."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    part = tl.program_id(2)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.arange(0, BLOCK_D)
    mask = (offs_t[:, None] < T) & (offs_c[None, :] < D)
    out = q_ptr.dtype.element_ty  # the compute dtype
    store_ty = ko_ptr.dtype.element_ty
    if part < 2:
        offs_j = tl.arange(0, BLOCK_D // 2)
        half = D // 2
        cs_mask = (offs_t[:, None] < T) & (offs_j[None, :] < half)
        cs_off = offs_t[:, None] * half + offs_j[None, :]
        cos = tl.load(cos_ptr + cs_off, mask=cs_mask, other=0.0)
        sin = tl.load(sin_ptr + cs_off, mask=cs_mask, other=0.0)
        if part == 0:
            q = _norm_rope(q_ptr, stride_qh, stride_qt, h, offs_t, offs_c, qn_ptr, cos, sin,
                           eps, T, D, BLOCK_T, BLOCK_D)
            qo = qo_ptr + h * stride_qoh + offs_t[:, None] * stride_qot + offs_c[None, :]
            if QUANT_Q:  # per (head, token) scale, from the compute-dtype queries as the reference
                q = q.to(out).to(tl.float32)
                qs = scale_of(tl.max(tl.abs(q), 1))
                tl.store(qs_ptr + h * T + offs_t, qs, mask=offs_t < T)
                tl.store(qo, to_e4m3(q, qs[:, None], tl.math.div_rn(1.0, qs)[:, None]),
                         mask=mask)
            else:
                tl.store(qo, q.to(out), mask=mask)
        else:
            slot = tl.load(idx_ptr + offs_t, mask=offs_t < T, other=0)
            dst = h * stride_oh + slot[:, None] * stride_os + offs_c[None, :]
            # Round to the compute dtype as the reference does, then quantize.
            k = _norm_rope(k_ptr, stride_kh, stride_kt, h, offs_t, offs_c, kn_ptr, cos, sin,
                           eps, T, D, BLOCK_T, BLOCK_D).to(out).to(tl.float32)
            if QUANT:
                ks = tl.load(ks_ptr + h)
                k = tl.clamp(div_scale(k, ks, tl.math.div_rn(1.0, ks)), -FP8_MAX, FP8_MAX)
            tl.store(ko_ptr + dst, k.to(store_ty), mask=mask)
    else:
        slot = tl.load(idx_ptr + offs_t, mask=offs_t < T, other=0)
        v = tl.load(v_ptr + h * stride_vh + offs_t[:, None] * stride_vt + offs_c[None, :],
                    mask=mask, other=0.0).to(tl.float32)
        if QUANT:
            vs = tl.load(vs_ptr + h)
            v = tl.clamp(div_scale(v, vs, tl.math.div_rn(1.0, vs)), -FP8_MAX, FP8_MAX)
        # A [D, S] store is written through its strides: transposing the tile in registers
        # first (tl.trans) measured slower (docs/PERFORMANCE_LOG.md, "Kernels alone").
        v_dst = h * stride_voh + slot[:, None] * stride_vos + offs_c[None, :] * stride_vod
        tl.store(vo_ptr + v_dst, v.to(store_ty), mask=mask)
