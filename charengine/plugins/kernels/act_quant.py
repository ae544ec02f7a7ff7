"""Triton kernels of plugins/act_quant.py (imported only where Triton and a GPU are)."""

import triton
import triton.language as tl

from .fp8_math import FP8_MAX, scale_of, to_e4m3


@triton.jit
def _quant_store(ptr, x, s, r, mask):
    tl.store(ptr, to_e4m3(x.to(tl.float32), s, r), mask=mask)


@triton.jit
def _store_row(x_hi, x_lo, amax, q_row, s_at, K, HI: tl.constexpr, LO: tl.constexpr):
    """A row held as its HI lanes and the LO after them (masked at K; none where LO is 0),
    quantized with the scale its amax gives: the scale stored at s_at, the codes at q_row."""
    s = scale_of(amax)
    tl.store(s_at, s)
    r = tl.math.div_rn(1.0, s)
    _quant_store(q_row + tl.arange(0, HI), x_hi, s, r, None)
    if LO > 0:
        ol = HI + tl.arange(0, LO)
        _quant_store(q_row + ol, x_lo, s, r, ol < K)


@triton.jit
def act_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, K, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = scale_of(tl.max(amax, axis=0))
    tl.store(s_ptr + row, scale)
    r = tl.math.div_rn(1.0, scale)
    for k in range(0, K, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_q + offs, to_e4m3(x, scale, r), mask=offs < K)


@triton.jit
def act_quant_row_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, HI: tl.constexpr,
                         LO: tl.constexpr):
    """One token's row in one pass, held in registers in its own dtype: its largest power of
    two of lanes (HI <= K, no mask) and the power of two that covers the rest (LO, masked; 0
    when there is none), so a 1,536-wide row takes 1,024 + 512 lanes and is read once, where
    act_quant_kernel reads it twice in blocks that mask a third of their lanes."""
    row = tl.program_id(0)
    x_row, q_row = x_ptr + row * stride_x, q_ptr + row * stride_q
    oh = tl.arange(0, HI)
    x_hi = tl.load(x_row + oh)
    amax = tl.max(tl.abs(x_hi.to(tl.float32)), 0)
    x_lo = x_hi  # no lanes past HI where LO is 0
    if LO > 0:
        ol = HI + tl.arange(0, LO)
        x_lo = tl.load(x_row + ol, mask=ol < K, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x_lo.to(tl.float32)), 0))
    _store_row(x_hi, x_lo, amax, q_row, s_ptr + row, K, HI, LO)


@triton.jit
def _residual_part(h_row, o_row, gate_ptr, add_row, hout_row, offs, m, dt,
                   RESIDUAL: tl.constexpr, ADD: tl.constexpr):
    """Lanes `offs` of a row (mask m, or None where all are in the row): h, with RESIDUAL
    plus gate * o (rounded to the compute dtype), with ADD plus the frame's row of `add`
    (rounded), stored as the new h where either is added."""
    other = 0.0 if m is not None else None
    x = tl.load(h_row + offs, mask=m, other=other)
    if RESIDUAL:
        o = tl.load(o_row + offs, mask=m, other=other).to(tl.float32)
        g = tl.load(gate_ptr + offs, mask=m, other=other).to(tl.float32)
        x = (x.to(tl.float32) + g * o).to(dt)
    if ADD:
        a = tl.load(add_row + offs, mask=m, other=other)
        x = (a.to(tl.float32) + x.to(tl.float32)).to(dt)
    if RESIDUAL or ADD:
        tl.store(hout_row + offs, x, mask=m)
    return x


@triton.jit
def _centered_squares(x, mean, m):
    """The sum of (x - mean)^2 over the row's lanes (those in mask m, or all)."""
    xc = x.to(tl.float32) - mean
    if m is not None:
        xc = tl.where(m, xc, 0.0)
    return tl.sum(xc * xc, 0)


@triton.jit
def _modulate_part(x, mean, rstd, scale_ptr, shift_ptr, offs, m, dt, AFFINE: tl.constexpr):
    """LN'd lanes modulated: (1 + scale) and shift rounded where the reference rounds, or with
    AFFINE the norm's own weight (in scale) and bias (in shift) with one rounding; zero on
    lanes past the row."""
    other = 0.0 if m is not None else None
    sc = tl.load(scale_ptr + offs, mask=m, other=other).to(tl.float32)
    sh = tl.load(shift_ptr + offs, mask=m, other=other).to(tl.float32)
    if AFFINE:
        xm = ((x.to(tl.float32) - mean) * rstd * sc + sh).to(dt)
    else:
        xn = ((x.to(tl.float32) - mean) * rstd).to(dt).to(tl.float32)
        one_plus = (1.0 + sc).to(dt).to(tl.float32)
        xm = ((xn * one_plus).to(dt).to(tl.float32) + sh).to(dt)
    if m is not None:
        xm = tl.where(m, xm, 0.0).to(dt)
    return xm


@triton.jit
def norm_modulate_quant_kernel(h_ptr, shift_ptr, scale_ptr, q_ptr, s_ptr, o_ptr, gate_ptr,
                               hout_ptr, add_ptr, d, rows_per_add, eps, stride_h, stride_q,
                               stride_o, stride_hout, stride_add, HI: tl.constexpr,
                               LO: tl.constexpr, RESIDUAL: tl.constexpr,
                               ADD: tl.constexpr = False, AFFINE: tl.constexpr = False):
    """One token's row, held in registers in the compute dtype as its largest power of two of
    lanes (HI <= d, no mask) and the power of two that covers the rest (LO, masked; 0 when
    there is none): a 1,536-wide row takes 1,024 + 512 lanes, where one power-of-two block
    masks a quarter of its 2,048. With RESIDUAL, first h + gate * o (the previous block's
    gated residual, rounded to the compute dtype), with ADD then a row of `add` (one per
    rows_per_add tokens: a frame's audio) added and rounded, the new h stored; then LN,
    modulation (or, with AFFINE, the norm's own weight in `scale` and bias in `shift`, one
    rounding as F.layer_norm) and the per-token quantization. Several rows per program
    sharing the modulation vectors, a persistent grid prefetching the next row and chunked
    passes re-reading the row from L2 all measured slower (docs/PERFORMANCE_LOG.md, "Kernels
    alone")."""
    row = tl.program_id(0)
    dt = h_ptr.dtype.element_ty
    h_row, o_row = h_ptr + row * stride_h, o_ptr + row * stride_o
    add_row, hout_row = add_ptr + (row // rows_per_add) * stride_add, hout_ptr + row * stride_hout
    oh = tl.arange(0, HI)
    x_hi = _residual_part(h_row, o_row, gate_ptr, add_row, hout_row, oh, None, dt, RESIDUAL,
                          ADD)
    total = tl.sum(x_hi.to(tl.float32), 0)
    x_lo = x_hi  # no lanes past HI where LO is 0
    ol = HI + tl.arange(0, LO if LO > 0 else 1)
    ml = ol < d
    if LO > 0:
        x_lo = _residual_part(h_row, o_row, gate_ptr, add_row, hout_row, ol, ml, dt,
                              RESIDUAL, ADD)
        total += tl.sum(x_lo.to(tl.float32), 0)
    mean = total / d
    squares = _centered_squares(x_hi, mean, None)
    if LO > 0:
        squares += _centered_squares(x_lo, mean, ml)
    rstd = tl.math.rsqrt(squares / d + eps)
    xm_hi = _modulate_part(x_hi, mean, rstd, scale_ptr, shift_ptr, oh, None, dt, AFFINE)
    amax = tl.max(tl.abs(xm_hi.to(tl.float32)), 0)
    xm_lo = xm_hi
    if LO > 0:
        xm_lo = _modulate_part(x_lo, mean, rstd, scale_ptr, shift_ptr, ol, ml, dt, AFFINE)
        amax = tl.maximum(amax, tl.max(tl.abs(xm_lo.to(tl.float32)), 0))
    _store_row(xm_hi, xm_lo, amax, q_ptr + row * stride_q, s_ptr + row, d, HI, LO)


@triton.jit
def _swiglu_dt(g_ptr, u_ptr, offs, m, dt):
    """silu(gate) * up, rounded where the reference rounds, in the compute dtype (the one-pass
    kernel holds its row so: half the registers of fp32 while the row waits for its amax)."""
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    return (silu * u).to(dt)


@triton.jit
def _swiglu(g_ptr, u_ptr, offs, m, dt):
    return _swiglu_dt(g_ptr, u_ptr, offs, m, dt).to(tl.float32)


@triton.jit
def swiglu_quant_kernel(a_ptr, g_ptr, u_ptr, q_ptr, s_ptr, A, M, stride_a, stride_g,
                             stride_u, stride_q, BLOCK: tl.constexpr):
    """One token's row [attn, silu(gate) * up] in chunks of BLOCK: an amax pass, then a
    quantize pass (SwiGLU computed twice, its inputs read twice, the second time mostly from
    L2). It keeps div_rn, as the reference of swiglu_quant_row_kernel's bytes; that kernel,
    which holds the row in registers, is the faster at the rank slice (docs/PERFORMANCE_LOG.md,
    "Kernels alone")."""
    row = tl.program_id(0)
    dt = a_ptr.dtype.element_ty
    a_row, g_row, u_row = a_ptr + row * stride_a, g_ptr + row * stride_g, u_ptr + row * stride_u
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, A, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(tl.load(a_row + offs, mask=offs < A, other=0.0)
                                       .to(tl.float32)))
    for k in range(0, M, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(_swiglu(g_row, u_row, offs, offs < M, dt)))
    s = scale_of(tl.max(amax, axis=0))
    tl.store(s_ptr + row, s)
    q_row = q_ptr + row * stride_q
    for k in range(0, A, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        x = tl.load(a_row + offs, mask=offs < A, other=0.0).to(tl.float32)
        y = tl.clamp(tl.math.div_rn(x, s), -FP8_MAX, FP8_MAX)
        tl.store(q_row + offs, y.to(tl.float8e4nv), mask=offs < A)
    for k in range(0, M, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        y = tl.clamp(tl.math.div_rn(_swiglu(g_row, u_row, offs, offs < M, dt), s),
                     -FP8_MAX, FP8_MAX)
        tl.store(q_row + A + offs, y.to(tl.float8e4nv), mask=offs < M)


@triton.jit
def swiglu_quant_row_kernel(a_ptr, g_ptr, u_ptr, q_ptr, s_ptr, A, M, stride_a, stride_g,
                            stride_u, stride_q, A_HI: tl.constexpr, A_LO: tl.constexpr,
                            M_HI: tl.constexpr, M_LO: tl.constexpr):
    """One token's row [attn, silu(gate) * up] in one pass, held in registers in the compute
    dtype (fewer registers than fp32, and faster; docs/PERFORMANCE_LOG.md, "Kernels alone"):
    each part as its largest power of two (HI, no mask) and the power of two that covers the
    rest (LO, masked; 0 when there is none), so a 10,240-wide MLP row takes 8,192 + 2,048
    lanes instead of 16,384.
    Every input is read once; the per-element arithmetic is swiglu_quant_kernel's (which
    keeps div_rn: the test that the two kernels' bytes are equal checks div_scale)."""
    row = tl.program_id(0)
    dt = a_ptr.dtype.element_ty
    a_row, g_row, u_row = a_ptr + row * stride_a, g_ptr + row * stride_g, u_ptr + row * stride_u
    q_row = q_ptr + row * stride_q
    oa = tl.arange(0, A_HI)
    a_hi = tl.load(a_row + oa)
    om = tl.arange(0, M_HI)
    y_hi = _swiglu_dt(g_row, u_row, om, om < M, dt)
    amax = tl.maximum(tl.max(tl.abs(a_hi.to(tl.float32)), 0),
                      tl.max(tl.abs(y_hi.to(tl.float32)), 0))
    if A_LO > 0:
        oal = A_HI + tl.arange(0, A_LO)
        a_lo = tl.load(a_row + oal, mask=oal < A, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(a_lo.to(tl.float32)), 0))
    if M_LO > 0:
        oml = M_HI + tl.arange(0, M_LO)
        y_lo = _swiglu_dt(g_row, u_row, oml, oml < M, dt)
        amax = tl.maximum(amax, tl.max(tl.abs(y_lo.to(tl.float32)), 0))
    s = scale_of(amax)
    tl.store(s_ptr + row, s)
    r = tl.math.div_rn(1.0, s)
    _quant_store(q_row + oa, a_hi, s, r, None)
    _quant_store(q_row + A + om, y_hi, s, r, None)
    if A_LO > 0:
        _quant_store(q_row + oal, a_lo, s, r, oal < A)
    if M_LO > 0:
        _quant_store(q_row + A + oml, y_lo, s, r, oml < M)


@triton.jit
def concat_quant_kernel(a_ptr, am_ptr, y_ptr, ym_ptr, q_ptr, s_ptr, A, F, PA, PY, stride_a,
                        stride_am, stride_amp, stride_y, stride_ym, stride_q, BLOCK: tl.constexpr,
                        A_BLOCK: tl.constexpr, PA_BLOCK: tl.constexpr,
                        PY_BLOCK: tl.constexpr, ATTN_AMAX: tl.constexpr):
    """Chunk BLOCK of token row's [attn, y], quantized with the row's scale taken from given
    maxima: y's as partials before rounding (the SwiGLU epilogue's; rounding is monotonic, so
    the rounded partial max is the max of the rounded values) and attn's as partials of the
    stored values (the attention kernel's), or, without ATTN_AMAX, from attn's row itself.
    No reduction over the whole row: every chunk is independent."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    dt = y_ptr.dtype.element_ty
    py = tl.arange(0, PY_BLOCK)
    ym = tl.max(tl.load(ym_ptr + row * stride_ym + py, mask=py < PY, other=0.0), 0)
    amax = ym.to(dt).to(tl.float32)
    if ATTN_AMAX:
        pa = tl.arange(0, PA_BLOCK)
        amax = tl.maximum(amax, tl.max(tl.load(am_ptr + row * stride_am + pa * stride_amp,
                                               mask=pa < PA, other=0.0), 0))
    else:
        oa = tl.arange(0, A_BLOCK)
        amax = tl.maximum(amax, tl.max(tl.abs(tl.load(a_ptr + row * stride_a + oa, mask=oa < A,
                                                      other=0.0).to(tl.float32)), 0))
    s = scale_of(amax)
    tl.store(s_ptr + row, s, mask=chunk == 0)
    r = tl.math.div_rn(1.0, s)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    in_a = offs < A
    xa = tl.load(a_ptr + row * stride_a + offs, mask=in_a, other=0.0)
    xy = tl.load(y_ptr + row * stride_y + offs - A, mask=(offs >= A) & (offs < A + F),
                 other=0.0)
    x = tl.where(in_a, xa.to(tl.float32), xy.to(tl.float32))
    tl.store(q_ptr + row * stride_q + offs, to_e4m3(x, s, r), mask=offs < A + F)


SQRT_2_OVER_PI = 0.7978845608028654  # GELU's tanh form: u = sqrt(2 / pi) (x + kappa x^3)
GELU_KAPPA = 0.044715
LOG2_E = 1.4426950408889634
# -2 u log2(e) = x (A + B x^2): GELU's exponent, its constants folded into one multiply-add
GELU_EXP2_A = tl.constexpr(-2.0 * SQRT_2_OVER_PI * LOG2_E)
GELU_EXP2_B = tl.constexpr(-2.0 * SQRT_2_OVER_PI * LOG2_E * GELU_KAPPA)


@triton.jit
def _over_one_plus_exp2(x, e):
    """x / (1 + 2^e) in four instructions: the hardware's 2^e and reciprocal (each within two
    fp32 units; flushed to zero below fp32's normal range, where 1 + 2^e is 1), then one
    multiply. Triton's exp2 and division add range fix-ups this needs not."""
    return tl.inline_asm_elementwise(
        "{ .reg .f32 t; ex2.approx.ftz.f32 t, $2; add.ftz.f32 t, t, 0f3F800000; "
        "rcp.approx.ftz.f32 t, t; mul.f32 $0, $1, t; }",
        "=r,r,r", [x, e], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _gelu_dt(x_ptr, offs, m, dt):
    """GELU (tanh form) in fp32, rounded to dt: 0.5 x (1 + tanh(u)) written as the equal
    x / (1 + exp(-2 u)), which needs no tanh and keeps its accuracy near u = 0 and for
    large |u| (where torch's kernel and this one both reach x or 0). The kernel is
    instruction-bound: the exponent is one multiply-add and one multiply, the quotient
    `_over_one_plus_exp2`'s (docs/PERFORMANCE_LOG.md, "Kernels alone")."""
    x = tl.load(x_ptr + offs, mask=m, other=0.0 if m is not None else None).to(tl.float32)
    return _over_one_plus_exp2(x, x * tl.math.fma(x * x, GELU_EXP2_B, GELU_EXP2_A)).to(dt)


@triton.jit
def gelu_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, HI: tl.constexpr,
                      LO: tl.constexpr):
    """One token's row gelu(x) in one pass, held in registers in the compute dtype (the
    FFN's hidden row, 8,960 wide at livetalk-1.3b: 8,192 + 1,024 lanes), its per-token scale
    and e4m3 codes: x read once, the GELU never stored."""
    row = tl.program_id(0)
    dt = x_ptr.dtype.element_ty
    x_row, q_row = x_ptr + row * stride_x, q_ptr + row * stride_q
    oh = tl.arange(0, HI)
    y_hi = _gelu_dt(x_row, oh, None, dt)
    amax = tl.max(tl.abs(y_hi.to(tl.float32)), 0)
    y_lo = y_hi  # no lanes past HI where LO is 0
    if LO > 0:
        ol = HI + tl.arange(0, LO)
        y_lo = _gelu_dt(x_row, ol, ol < K, dt)
        amax = tl.maximum(amax, tl.max(tl.abs(y_lo.to(tl.float32)), 0))
    _store_row(y_hi, y_lo, amax, q_row, s_ptr + row, K, HI, LO)
