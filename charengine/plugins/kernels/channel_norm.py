"""Triton kernels of plugins/channel_norm.py (imported only where Triton and a GPU are)."""

import triton
import triton.language as tl


@triton.jit
def channel_norm_cf_kernel(x_ptr, g_ptr, y_ptr, C, P, scale, floor, SILU: tl.constexpr,
                           BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    """Program (position tile, batch) of [B, C, P] contiguous: the tile's sum of squares over
    every channel, then each channel tile normalized, scaled, gained (and SiLU) and stored."""
    b = tl.program_id(1).to(tl.int64)
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    mp = offs_p < P
    base = b * C * P
    acc = tl.zeros([BLOCK_P], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        m = (offs_c[:, None] < C) & mp[None, :]
        x = tl.load(x_ptr + base + offs_c[:, None].to(tl.int64) * P + offs_p[None, :], mask=m,
                    other=0.0).to(tl.float32)
        acc += tl.sum(x * x, 0)
    inv = scale / tl.maximum(tl.sqrt(acc), floor)
    for c0 in range(0, C, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        m = (offs_c[:, None] < C) & mp[None, :]
        at = base + offs_c[:, None].to(tl.int64) * P + offs_p[None, :]
        x = tl.load(x_ptr + at, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs_c, mask=offs_c < C, other=0.0).to(tl.float32)
        y = x * inv[None, :] * g[:, None]
        if SILU:
            y = y * tl.sigmoid(y)
        tl.store(y_ptr + at, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def channel_norm_cl_kernel(x_ptr, g_ptr, y_ptr, C, R, scale, floor, SILU: tl.constexpr,
                           ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program: ROWS positions of a channels-last [R, C], each row normalized in registers."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_c = tl.arange(0, BLOCK_C)
    m = (rows[:, None] < R) & (offs_c[None, :] < C)
    at = rows[:, None].to(tl.int64) * C + offs_c[None, :]
    x = tl.load(x_ptr + at, mask=m, other=0.0).to(tl.float32)
    inv = scale / tl.maximum(tl.sqrt(tl.sum(x * x, 1)), floor)
    g = tl.load(g_ptr + offs_c, mask=offs_c < C, other=0.0).to(tl.float32)
    y = x * inv[:, None] * g[None, :]
    if SILU:
        y = y * tl.sigmoid(y)
    tl.store(y_ptr + at, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def channel_norm_taps_kernel(x_ptr, g_ptr, b_ptr, taps_ptr, past_ptr, F, P, C, scale, floor,
                             N: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr,
                             ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (position tile, frame j) of pixel rows x [F, P, C]: each row (plus the bias)
    normalized in registers, then stored as tap i of output frame N + j - i of the taps
    [F, P, (N + 1) C] for each i where that frame exists, and as past frame j - (F - N)
    where that is one of the newest N."""
    j = tl.program_id(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_c = tl.arange(0, BLOCK_C)
    m = (rows[:, None] < P) & (offs_c[None, :] < C)
    x = tl.load(x_ptr + (j * P + rows[:, None]).to(tl.int64) * C + offs_c[None, :], mask=m,
                other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(b_ptr + offs_c, mask=offs_c < C, other=0.0).to(tl.float32)[None, :]
    inv = scale / tl.maximum(tl.sqrt(tl.sum(x * x, 1)), floor)
    g = tl.load(g_ptr + offs_c, mask=offs_c < C, other=0.0).to(tl.float32)
    y = x * inv[:, None] * g[None, :]
    if SILU:
        y = y * tl.sigmoid(y)
    y = y.to(taps_ptr.dtype.element_ty)
    for i in tl.static_range(N + 1):
        f = N + j - i
        at = (f * P + rows[:, None]).to(tl.int64) * ((N + 1) * C) + i * C + offs_c[None, :]
        tl.store(taps_ptr + at, y, mask=m & (f >= 0) & (f < F))
    k = j - (F - N)
    tl.store(past_ptr + (k * P + rows[:, None]).to(tl.int64) * C + offs_c[None, :], y,
             mask=m & (k >= 0))
