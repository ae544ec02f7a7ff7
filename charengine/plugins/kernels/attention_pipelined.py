"""Gluon kernel of plugins/attention.py's pipelined variant (imported only where Triton and a
GPU are): FP8 attention for Hopper with the next key tile's scores computing on the tensor
cores while this tile's softmax runs (the intra-warpgroup overlap of FlashAttention-3).

One warpgroup per program, 64 queries a tile, the queries in registers; keys and values come
through a ring of `STAGES` TMA buffers. Each turn issues tile j + 1's Q K^T, computes tile j's
probabilities, waits for both that and tile j - 1's P V, refills the stage tile j - 1 held,
rescales the accumulator and issues tile j's P V, which stays in flight over the next turn.
The scores alternate between two tensors (two tiles a loop turn): with one loop-carried
tensor the assembler gives the scores in flight and the scores being read the same
registers, and waits for the multiply before the softmax. The grid is attention_split_kernel's
(whole tiles, then key ranges that plugins/kernels/attention.attention_merge_kernel merges);
the key count is a whole number of tiles.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_init,
                                                              warpgroup_mma_wait)


@gluon.jit
def _probabilities(s, m_i, l_i, row_scale, LOG2_P_SCALE: gl.constexpr):
    m_new = gl.maximum(m_i, gl.max(s, 1) * row_scale)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s * row_scale[:, None] - (m_new - LOG2_P_SCALE)[:, None])
    return p, alpha, l_i * alpha + gl.sum(p, 1), m_new


@gluon.jit
def _load_kv(k_desc, v_desc, k_s, v_s, k_bar, v_bar, k_row, v_row, v_col, j,
             STAGES: gl.constexpr, BLOCK_N: gl.constexpr, pred):
    """Key tile j (rows k_row + j * BLOCK_N on) and value tile j (columns v_col + j * BLOCK_N
    on, rows v_row on) into stage j % STAGES, where pred."""
    stage = j % STAGES
    mbarrier.expect(k_bar.index(stage), k_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(k_desc, [k_row + j * BLOCK_N, 0], k_bar.index(stage),
                                    k_s.index(stage), pred=pred)
    mbarrier.expect(v_bar.index(stage), v_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(v_desc, [v_row, v_col + j * BLOCK_N], v_bar.index(stage),
                                    v_s.index(stage), pred=pred)


@gluon.jit
def _scores(q, k_s, k_bar, zero_s, j, STAGES: gl.constexpr):
    """Tile j's Q K^T, issued (in flight)."""
    mbarrier.wait(k_bar.index(j % STAGES), (j // STAGES) & 1)
    return warpgroup_mma(q, k_s.index(j % STAGES).permute((1, 0)), zero_s, use_acc=False,
                         is_async=True)


@gluon.jit
def _step(q, s, acc, m_i, l_i, row_scale, j, n, k_desc, v_desc, k_s, v_s, k_bar, v_bar, k_row,
          v_row, v_col, zero_s, p_layout: gl.constexpr, rows_o: gl.constexpr, STAGES: gl.constexpr,
          BLOCK_N: gl.constexpr, LOG2_P_SCALE: gl.constexpr):
    """Tile j's softmax and P V (left in flight) with tile j + 1's scores computing meanwhile;
    returns them (complete)."""
    s_next = _scores(q, k_s, k_bar, zero_s, j + 1, STAGES)
    p, alpha, l_i, m_i = _probabilities(s, m_i, l_i, row_scale, LOG2_P_SCALE)
    p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
    acc, s_next = warpgroup_mma_wait(0, deps=(acc, s_next))
    # tile j - 1's stage is free (its P V done): fill it with tile j - 1 + STAGES
    _load_kv(k_desc, v_desc, k_s, v_s, k_bar, v_bar, k_row, v_row, v_col, j - 1 + STAGES,
             STAGES, BLOCK_N, (j >= 1) & (j - 1 + STAGES < n))
    acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
    mbarrier.wait(v_bar.index(j % STAGES), (j // STAGES) & 1)
    acc = warpgroup_mma(p8, v_s.index(j % STAGES).permute((1, 0)), acc, is_async=True)
    return s_next, acc, m_i, l_i


@gluon.jit
def _last(s, acc, m_i, l_i, row_scale, j, v_s, v_bar, p_layout: gl.constexpr,
          rows_o: gl.constexpr, STAGES: gl.constexpr, LOG2_P_SCALE: gl.constexpr):
    p, alpha, l_i, m_i = _probabilities(s, m_i, l_i, row_scale, LOG2_P_SCALE)
    p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
    mbarrier.wait(v_bar.index(j % STAGES), (j // STAGES) & 1)
    acc = warpgroup_mma(p8, v_s.index(j % STAGES).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    return acc, m_i, l_i


@gluon.jit
def attention_pipelined_kernel(q_desc, qs_ptr, k_desc, v_desc, ks_ptr, vs_ptr, o_ptr, part_ptr,
                               stat_ptr, T, S, k_cap, NT, whole, parts, sm_scale_log2,
                               stride_ot, D: gl.constexpr, BLOCK_M: gl.constexpr,
                               BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                               LOG2_P_SCALE: gl.constexpr):
    """q_desc over the queries as [H * T, D]; k_desc over the keys as [H * k_cap, D] (head h's
    slot s at row h * k_cap + s); v_desc over the values stored transposed, [H * D, S]. The
    rest as attention_split_kernel's, with the FMA softmax (p times P_SCALE) and P as e4m3."""
    pid = gl.program_id(0)
    r = pid - whole
    slot = gl.maximum(r, 0)
    tile = gl.where(r < 0, pid, whole + slot // parts)
    h = tile // NT
    key_tiles = S // BLOCK_N
    part = slot % parts
    j0 = gl.where(r < 0, 0, part * key_tiles // parts)
    j1 = gl.where(r < 0, key_tiles, (part + 1) * key_tiles // parts)
    n = j1 - j0
    off_m = (tile - h * NT) * BLOCK_M

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 32])
    q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=4)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_s = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    k_s = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape,
                                    k_desc.layout)
    v_s = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape,
                                    v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)
    fence_async_shared()

    k_row = h * k_cap + j0 * BLOCK_N
    v_row = h * D
    v_col = j0 * BLOCK_N
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [h * T + off_m, 0], q_bar, q_s)
    for i in gl.static_range(STAGES):
        _load_kv(k_desc, v_desc, k_s, v_s, k_bar, v_bar, k_row, v_row, v_col, i, STAGES,
                 BLOCK_N, i < n)

    offs_m = off_m + gl.arange(0, BLOCK_M, layout=rows_s)
    qs = gl.load(qs_ptr + h * T + offs_m, mask=offs_m < T, other=0.0)
    row_scale = qs * gl.load(ks_ptr + h) * sm_scale_log2
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, rows_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, rows_s)
    acc = warpgroup_mma_init(gl.zeros([BLOCK_M, D], gl.float32, o_layout))
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)

    mbarrier.wait(q_bar, 0)
    q = q_s.load(q_layout)
    s_a = warpgroup_mma_wait(0, deps=(_scores(q, k_s, k_bar, zero_s, 0, STAGES), ))
    # two tiles a turn, the scores in two buffers (s_a, s_b) so that the registers a
    # softmax reads are never those the next tile's scores are being written to
    for it in range((n - 1) // 2):
        s_b, acc, m_i, l_i = _step(q, s_a, acc, m_i, l_i, row_scale, 2 * it, n, k_desc, v_desc,
                                   k_s, v_s, k_bar, v_bar, k_row, v_row, v_col, zero_s,
                                   p_layout,
                                   rows_o, STAGES, BLOCK_N, LOG2_P_SCALE)
        s_a, acc, m_i, l_i = _step(q, s_b, acc, m_i, l_i, row_scale, 2 * it + 1, n, k_desc,
                                   v_desc, k_s, v_s, k_bar, v_bar, k_row, v_row, v_col, zero_s,
                                   p_layout, rows_o, STAGES, BLOCK_N, LOG2_P_SCALE)
    if n % 2 == 0:
        s_b, acc, m_i, l_i = _step(q, s_a, acc, m_i, l_i, row_scale, n - 2, n, k_desc, v_desc,
                                   k_s, v_s, k_bar, v_bar, k_row, v_row, v_col, zero_s,
                                   p_layout,
                                   rows_o, STAGES, BLOCK_N, LOG2_P_SCALE)
        out, m_i, l_i = _last(s_b, acc, m_i, l_i, row_scale, n - 1, v_s, v_bar, p_layout,
                              rows_o, STAGES, LOG2_P_SCALE)
    else:
        out, m_i, l_i = _last(s_a, acc, m_i, l_i, row_scale, n - 1, v_s, v_bar, p_layout,
                              rows_o, STAGES, LOG2_P_SCALE)
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bar.index(i))
        mbarrier.invalidate(v_bar.index(i))

    rows = gl.arange(0, BLOCK_M, layout=rows_o)
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    l_o = gl.convert_layout(l_i, rows_o)
    if r < 0:
        res = out * (gl.load(vs_ptr + h) / l_o)[:, None]
        offs = off_m + rows
        gl.store(o_ptr + offs[:, None] * stride_ot + h * D + cols[None, :],
                 res.to(o_ptr.dtype.element_ty), mask=offs[:, None] < T)
    else:
        gl.store(part_ptr + slot.to(gl.int64) * (BLOCK_M * D) + rows[:, None] * D
                 + cols[None, :], out)
        gl.store(stat_ptr + slot * (2 * BLOCK_M) + rows, gl.convert_layout(m_i, rows_o))
        gl.store(stat_ptr + slot * (2 * BLOCK_M) + BLOCK_M + rows, l_o)
