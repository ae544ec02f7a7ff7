"""Triton kernel of plugins/attention.py (imported only where Triton and a GPU are)."""

import triton
import triton.language as tl


@triton.jit
def _softmax(acc, l_i, m_i, s):
    """One key tile's online-softmax update from scores s (log2 units): probabilities, the
    rescaled accumulator, row sums and row maxima."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    return p, acc * alpha[:, None], l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _softmax_fma(acc, l_i, m_i, dot, row_scale, mask, LOG2_P_SCALE: tl.constexpr,
                 MASKED: tl.constexpr):
    """_softmax from the raw Q K^T tile and its per-row scale, with fewer instructions per
    score: the maximum taken over the raw dots and then scaled (exact: the scale is positive
    and rounding is monotonic), the probabilities as exp2 of one fused multiply-add that also
    carries log2(P_SCALE), so p comes out already scaled for its e4m3 cast and the row sum
    carries P_SCALE (the epilogue divides it out). Masked scores are -inf in the maximum and
    0 in p (a padding row's zero scale would make -inf * 0 a NaN inside the exp2)."""
    if MASKED:
        dot = tl.where(mask, dot, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(dot, 1) * row_scale)
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(dot * row_scale[:, None] - (m_new - LOG2_P_SCALE)[:, None])
    if MASKED:
        p = tl.where(mask, p, 0.0)
    return p, acc * alpha[:, None], l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _pv(acc, p, v, P_FP8: tl.constexpr, P_SCALE: tl.constexpr, SCALED: tl.constexpr):
    """acc + P V, p times P_SCALE first (SCALED: it already is)."""
    if not SCALED:
        p = p * P_SCALE
    if P_FP8:
        return tl.dot(p.to(tl.float8e4nv), v, acc)
    return tl.dot(p.to(tl.bfloat16), v.to(tl.bfloat16), acc)


@triton.jit
def _scores(acc, l_i, m_i, dot, row_scale, offs_n, S, MASKED: tl.constexpr,
            LOG2_P_SCALE: tl.constexpr, FMA: tl.constexpr):
    """The online-softmax update for one key tile (offs_n its slots) from its raw Q K^T; with
    FMA, p comes out times P_SCALE."""
    if FMA:
        return _softmax_fma(acc, l_i, m_i, dot, row_scale, offs_n[None, :] < S, LOG2_P_SCALE,
                            MASKED)
    s = dot * row_scale[:, None]
    if MASKED:
        s = tl.where(offs_n[None, :] < S, s, float("-inf"))
    return _softmax(acc, l_i, m_i, s)


@triton.jit
def _tile(acc, l_i, m_i, q, row_scale, k_ptr, v_ptr, start, S, stride_ks, stride_vs,
          stride_vd, offs_d, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
          P_FP8: tl.constexpr, P_SCALE: tl.constexpr, LOG2_P_SCALE: tl.constexpr,
          FMA: tl.constexpr):
    offs_n = start + tl.arange(0, BLOCK_N)
    k_ptrs = k_ptr + offs_n[:, None] * stride_ks + offs_d[None, :]
    v_ptrs = v_ptr + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd
    if MASKED:
        k = tl.load(k_ptrs, mask=offs_n[:, None] < S, other=0.0)
        v = tl.load(v_ptrs, mask=offs_n[:, None] < S, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    p, acc, l_i, m_new = _scores(acc, l_i, m_i, tl.dot(q, tl.trans(k)), row_scale, offs_n, S,
                                 MASKED, LOG2_P_SCALE, FMA)
    return _pv(acc, p, v, P_FP8, P_SCALE, FMA), l_i, m_new

@triton.jit
def _store(o_ptr, amax_ptr, out, offs_m, offs_d, h, T, stride_ot, D: tl.constexpr,
           AMAX: tl.constexpr):
    """The output tile of head h, rounded to the output dtype; with AMAX, each row's |max| of
    the stored values to amax_ptr, [heads, T] so that the tile's stores are contiguous (the
    output projection's quantization scale then needs no reduction over the row:
    plugins/act_quant.concat_quant_reference)."""
    o = out.to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + offs_m[:, None] * stride_ot + h * D + offs_d[None, :], o,
             mask=offs_m[:, None] < T)
    if AMAX:
        tl.store(amax_ptr + h * T + offs_m,
                 tl.max(tl.abs(o.to(tl.float32)), 1), mask=offs_m < T)


@triton.jit
def attention_kernel(q_ptr, qs_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, o_ptr, amax_ptr, T, S,
                     sm_scale_log2, stride_qh, stride_qt, stride_kh, stride_ks, stride_vh,
                     stride_vs, stride_vd, stride_ot, D: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, P_FP8: tl.constexpr, P_SCALE: tl.constexpr,
                     LOG2_P_SCALE: tl.constexpr, FMA: tl.constexpr, AMAX: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :],
                mask=offs_m[:, None] < T, other=0.0)
    qs = tl.load(qs_ptr + h * T + offs_m, mask=offs_m < T, other=0.0)
    row_scale = qs * tl.load(ks_ptr + h) * sm_scale_log2
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    k_head = k_ptr + h * stride_kh
    v_head = v_ptr + h * stride_vh
    full = (S // BLOCK_N) * BLOCK_N
    for start in range(0, full, BLOCK_N):
        acc, l_i, m_i = _tile(acc, l_i, m_i, q, row_scale, k_head, v_head, start, S,
                              stride_ks, stride_vs, stride_vd, offs_d, BLOCK_N, False,
                              P_FP8, P_SCALE, LOG2_P_SCALE, FMA)
    if full < S:
        acc, l_i, m_i = _tile(acc, l_i, m_i, q, row_scale, k_head, v_head, full, S,
                              stride_ks, stride_vs, stride_vd, offs_d, BLOCK_N, True,
                              P_FP8, P_SCALE, LOG2_P_SCALE, FMA)
    if not FMA:  # with FMA the row sums carry P_SCALE already
        l_i = l_i * P_SCALE
    out = acc * (tl.load(vs_ptr + h) / l_i)[:, None]
    _store(o_ptr, amax_ptr, out, offs_m, offs_d, h, T, stride_ot, D, AMAX)


@triton.jit
def _tile_tma(acc, l_i, m_i, q, row_scale, k_desc, v_desc, h, start, S,
              D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
              P_FP8: tl.constexpr, V_T: tl.constexpr, P_SCALE: tl.constexpr,
              LOG2_P_SCALE: tl.constexpr, FMA: tl.constexpr):
    k = k_desc.load([h, start, 0]).reshape(BLOCK_N, D)
    p, acc, l_i, m_new = _scores(acc, l_i, m_i, tl.dot(q, tl.trans(k)), row_scale,
                                 start + tl.arange(0, BLOCK_N), S, MASKED, LOG2_P_SCALE, FMA)
    if V_T:
        v = tl.trans(v_desc.load([h, 0, start]).reshape(D, BLOCK_N))
    else:
        v = v_desc.load([h, start, 0]).reshape(BLOCK_N, D)
    return _pv(acc, p, v, P_FP8, P_SCALE, FMA), l_i, m_new


@triton.jit
def _attend_tma(q_desc, qs_ptr, k_desc, v_desc, ks_ptr, h, off_m, j0, j1, T, S,
                sm_scale_log2, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                P_FP8: tl.constexpr, V_T: tl.constexpr, P_SCALE: tl.constexpr,
                LOG2_P_SCALE: tl.constexpr, FMA: tl.constexpr):
    """Query tile off_m of head h over key tiles [j0, j1) (the last one ragged where S
    ends inside it): the unnormalized accumulator [BLOCK_M, D], the row sums (times
    P_SCALE) and row maxima, and the tile's query rows."""
    offs_m = off_m + tl.arange(0, BLOCK_M)
    q = q_desc.load([h, off_m, 0]).reshape(BLOCK_M, D)
    qs = tl.load(qs_ptr + h * T + offs_m, mask=offs_m < T, other=0.0)
    row_scale = qs * tl.load(ks_ptr + h) * sm_scale_log2
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    full = tl.minimum(j1, S // BLOCK_N) * BLOCK_N
    for start in range(j0 * BLOCK_N, full, BLOCK_N):
        acc, l_i, m_i = _tile_tma(acc, l_i, m_i, q, row_scale, k_desc, v_desc, h, start, S,
                                  D, BLOCK_N, False, P_FP8, V_T, P_SCALE, LOG2_P_SCALE, FMA)
    if full < tl.minimum(j1 * BLOCK_N, S):  # the ragged last key tile, in its range
        acc, l_i, m_i = _tile_tma(acc, l_i, m_i, q, row_scale, k_desc, v_desc, h, full, S,
                                  D, BLOCK_N, True, P_FP8, V_T, P_SCALE, LOG2_P_SCALE, FMA)
    if not FMA:  # with FMA the row sums carry P_SCALE already
        l_i = l_i * P_SCALE
    return acc, l_i, m_i, offs_m


@triton.jit
def attention_tma_kernel(q_desc, qs_ptr, k_desc, v_desc, ks_ptr, vs_ptr, o_ptr, amax_ptr, T,
                         S, sm_scale_log2, stride_ot, D: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, P_FP8: tl.constexpr, V_T: tl.constexpr,
                         P_SCALE: tl.constexpr, LOG2_P_SCALE: tl.constexpr,
                         FMA: tl.constexpr, AMAX: tl.constexpr):
    """As attention_kernel, with tiles brought in by the tensor memory accelerator through
    3-D descriptors (out-of-bounds rows read as zero, then masked); V_T: the value store is
    [H, D, S] in memory, so that P V is an FP8 dot with V K-major."""
    h = tl.program_id(1)
    acc, l_i, m_i, offs_m = _attend_tma(q_desc, qs_ptr, k_desc, v_desc, ks_ptr, h,
                                        tl.program_id(0) * BLOCK_M, 0, tl.cdiv(S, BLOCK_N), T,
                                        S, sm_scale_log2, D, BLOCK_M, BLOCK_N, P_FP8, V_T,
                                        P_SCALE, LOG2_P_SCALE, FMA)
    out = acc * (tl.load(vs_ptr + h) / l_i)[:, None]
    _store(o_ptr, amax_ptr, out, offs_m, tl.arange(0, D), h, T, stride_ot, D, AMAX)


@triton.jit
def attention_split_kernel(q_desc, qs_ptr, k_desc, v_desc, ks_ptr, vs_ptr, o_ptr, part_ptr,
                           stat_ptr, T, S, NT, whole, parts, sm_scale_log2, stride_ot,
                           D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           P_FP8: tl.constexpr, V_T: tl.constexpr, P_SCALE: tl.constexpr,
                           LOG2_P_SCALE: tl.constexpr, FMA: tl.constexpr):
    """attention_tma_kernel over a 1-D grid that fills the GPU's last round: programs
    [0, whole) each take a whole (query tile, head), tiles head-major; program whole + r
    takes key range r % parts (whole key tiles) of tile whole + r // parts and leaves its
    unnormalized accumulator [BLOCK_M, D] in slot r of part_ptr, its row maxima and row sums
    (both in the accumulator's units, times P_SCALE) in slot r of stat_ptr [., 2, BLOCK_M]
    for attention_merge_kernel."""
    pid = tl.program_id(0)
    r = pid - whole
    slot = tl.maximum(r, 0)
    tile = tl.where(r < 0, pid, whole + slot // parts)
    h = tile // NT
    key_tiles = tl.cdiv(S, BLOCK_N)
    part = slot % parts
    j0 = tl.where(r < 0, 0, part * key_tiles // parts)
    j1 = tl.where(r < 0, key_tiles, (part + 1) * key_tiles // parts)
    acc, l_i, m_i, offs_m = _attend_tma(q_desc, qs_ptr, k_desc, v_desc, ks_ptr, h,
                                        (tile - h * NT) * BLOCK_M, j0, j1, T, S, sm_scale_log2,
                                        D, BLOCK_M, BLOCK_N, P_FP8, V_T, P_SCALE,
                                        LOG2_P_SCALE, FMA)
    offs_d = tl.arange(0, D)
    if r < 0:
        out = acc * (tl.load(vs_ptr + h) / l_i)[:, None]
        _store(o_ptr, o_ptr, out, offs_m, offs_d, h, T, stride_ot, D, False)
    else:
        rows = tl.arange(0, BLOCK_M)
        tl.store(part_ptr + slot.to(tl.int64) * (BLOCK_M * D) + rows[:, None] * D
                 + offs_d[None, :], acc)
        tl.store(stat_ptr + slot * (2 * BLOCK_M) + rows, m_i)
        tl.store(stat_ptr + slot * (2 * BLOCK_M) + BLOCK_M + rows, l_i)


@triton.jit
def attention_merge_kernel(part_ptr, stat_ptr, vs_ptr, o_ptr, T, NT, whole, parts, stride_ot,
                           D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Tile whole + program_id(0) from its parts: the sum of 2^(m_p - m) acc_p over the sum
    of 2^(m_p - m) l_p (m the largest row maximum), times the head's value scale."""
    i = tl.program_id(0)
    tile = whole + i
    h = tile // NT
    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for p in range(parts):
        m = tl.maximum(m, tl.load(stat_ptr + (i * parts + p) * (2 * BLOCK_M) + rows))
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    den = tl.zeros([BLOCK_M], dtype=tl.float32)
    for p in range(parts):
        at = (i * parts + p) * (2 * BLOCK_M)
        w = tl.math.exp2(tl.load(stat_ptr + at + rows) - m)
        den += w * tl.load(stat_ptr + at + BLOCK_M + rows)
        acc += w[:, None] * tl.load(part_ptr + (i * parts + p).to(tl.int64) * (BLOCK_M * D)
                                    + rows[:, None] * D + offs_d[None, :])
    out = acc * (tl.load(vs_ptr + h) / den)[:, None]
    _store(o_ptr, o_ptr, out, (tile - h * NT) * BLOCK_M + rows, offs_d, h, T, stride_ot, D,
           False)
