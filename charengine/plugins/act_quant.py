"""Per-token FP8 activation quantization, alone and fused with what comes before each block
linear: layer norm and AdaLN modulation before the input projection (with the previous
block's gated residual add in front of it, and a frame's audio row), a layer norm with its own
weight and bias after a gated residual (LiveTalk's cross-attention input), SwiGLU (and the
concatenation with the attention output) or GELU before the output projection. Each program
owns one row (token), so the per-token scale (amax / 448) needs no second kernel. The kernels
round where the references round (to the compute dtype after each torch op), so they differ
only where fp32 evaluation order or fused multiply-adds move a compute-dtype rounding.

References: charengine.fp8.quantize_rows (scale = amax / 448, saturate, round to nearest
even), `norm_modulate_reference`, `residual_norm_modulate_reference`,
`residual_layer_norm_reference`, `residual_add_norm_modulate_reference`,
`gelu_quant_reference`, `swiglu_reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from charengine import fp8
from charengine.ops import gated_residual_once, gelu_tanh, modulate, swiglu

from . import registry

reference = fp8.quantize_rows
# act_quant's one-pass kernel: rows up to ROW_LANES lanes wide held in registers, a warp for
# each ROW_LANES_PER_WARP (one warp at LiveTalk's 1,536, faster there than four warps or the
# two-pass kernel: scripts/livetalk_kernels.py --only epilogues; docs/PERFORMANCE_LOG.md)
ROW_LANES, ROW_LANES_PER_WARP = 16384, 2048


def norm_modulate_reference(h: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """LN(h) * (1 + scale) + shift, quantized per token. h [T, d]; shift, scale [d]."""
    return fp8.quantize_rows(modulate(h, shift, scale, eps))


def residual_norm_modulate_reference(h: torch.Tensor, o: torch.Tensor, gate: torch.Tensor,
                                     shift: torch.Tensor, scale: torch.Tensor, eps: float):
    """h + gate * o (the previous block's gated residual, one rounding as torch.addcmul), then
    as `norm_modulate_reference`. h, o [T, d]; gate, shift, scale [d]. Returns (q, scale, the
    new h)."""
    h = gated_residual_once(h, gate, o)
    return (*norm_modulate_reference(h, shift, scale, eps), h)


def residual_layer_norm_reference(h: torch.Tensor, o: torch.Tensor, gate: torch.Tensor,
                                  weight: torch.Tensor, bias: torch.Tensor, eps: float):
    """h + gate * o (one rounding), then a layer norm with its own weight and bias (one
    rounding, F.layer_norm's), quantized per token. h, o [T, d]; gate, weight, bias [d].
    Returns (q, scale, the new h)."""
    h = gated_residual_once(h, gate, o)
    return (*fp8.quantize_rows(F.layer_norm(h, (h.shape[-1],), weight, bias, eps)), h)


def residual_add_norm_modulate_reference(h: torch.Tensor, o: torch.Tensor, gate: torch.Tensor,
                                         add: torch.Tensor, shift: torch.Tensor,
                                         scale: torch.Tensor, eps: float):
    """h + gate * o (one rounding), then plus add's row for each group of T / F tokens
    (add [F, d]: a frame's audio, rounded), then as `norm_modulate_reference`. Returns (q,
    scale, the new h)."""
    h = gated_residual_once(h, gate, o)
    h = add.repeat_interleave(h.shape[0] // add.shape[0], dim=0) + h
    return (*norm_modulate_reference(h, shift, scale, eps), h)


def gelu_quant_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gelu(x) (tanh form, rounded to x's dtype), quantized per token. x [T, K]."""
    return fp8.quantize_rows(gelu_tanh(x))


def swiglu_reference(attn: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """[attn, silu(gate) * up], quantized per token. attn [T, A]; gate, up [T, M]."""
    return fp8.quantize_rows(torch.cat([attn, swiglu(gate, up)], dim=-1))


def concat_quant_reference(attn: torch.Tensor, attn_amax: torch.Tensor | None, y: torch.Tensor,
                           y_amax: torch.Tensor):
    """[attn, y] quantized per token with the scale the given maxima make: y_amax [T, P]
    partial maxima of |y| before its rounding (plugins/quack_gemm.quack_swiglu_mm), rounded
    to y's dtype; attn_amax [T, P'] partial maxima of |attn| (plugins/attention's amax op),
    or None to take attn's own. With true maxima, the bytes of `swiglu_reference`'s
    quantization of [attn, y]. attn [T, A], y [T, F]."""
    a = attn.float().abs().amax(dim=1, keepdim=True) if attn_amax is None \
        else attn_amax.float().amax(dim=1, keepdim=True)
    amax = torch.maximum(a, y_amax.amax(dim=1, keepdim=True).to(y.dtype).float())
    scale = fp8.scale_of(amax)
    return fp8.quantize(torch.cat([attn, y], dim=-1), scale), scale


def triton_act_quant(x: torch.Tensor, block: int = 1024, warps: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (row-major) -> (q [M, K] e4m3, scale [M, 1] fp32). Rows up to ROW_LANES
    wide take the one-pass kernel (the row in registers; `warps` default: one per
    ROW_LANES_PER_WARP lanes), wider ones the two-pass kernel in blocks of `block`."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    q = torch.empty((M, K), dtype=fp8.FP8, device=x.device)
    s = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    from .kernels.act_quant import act_quant_kernel, act_quant_row_kernel

    hi, lo = pow2_split(K)
    if hi + lo <= ROW_LANES:
        act_quant_row_kernel[(M,)](x, q, s, K, x.stride(0), q.stride(0), HI=hi, LO=lo,
                                   num_warps=warps or max(1, (hi + lo) // ROW_LANES_PER_WARP))
    else:
        act_quant_kernel[(M,)](x, q, s, K, x.stride(0), q.stride(0), BLOCK=block)
    return q, s


def triton_norm_modulate_quant(h, shift, scale, eps, warps: int | None = None):
    """The kernel; arguments and result as `norm_modulate_reference`. One program per token
    holds its whole row in registers; `warps` default: one per 1,024 lanes, at most 8 (the
    faster at d = 7,680, with and without the residual: scripts/bench_kernels.py --only act,
    docs/PERFORMANCE_LOG.md, "Kernels alone")."""
    return _norm_modulate(h, None, None, shift, scale, eps, warps)[:2]


def triton_residual_norm_modulate_quant(h, o, gate, shift, scale, eps, warps: int | None = None):
    """The kernel with the residual add in front; arguments and result as
    `residual_norm_modulate_reference`."""
    return _norm_modulate(h, o, gate, shift, scale, eps, warps)


def triton_residual_layer_norm_quant(h, o, gate, weight, bias, eps, warps: int | None = None):
    """The kernel with the residual add in front and the norm's own weight and bias;
    arguments and result as `residual_layer_norm_reference`."""
    return _norm_modulate(h, o, gate, bias, weight, eps, warps, affine=True)


def triton_residual_add_norm_modulate_quant(h, o, gate, add, shift, scale, eps,
                                            warps: int | None = None):
    """The kernel with the residual add and a frame's row of `add` in front; arguments and
    result as `residual_add_norm_modulate_reference`."""
    if h.shape[0] % add.shape[0]:
        raise ValueError(f"add's {add.shape[0]} rows do not divide h's {h.shape[0]} tokens")
    return _norm_modulate(h, o, gate, shift, scale, eps, warps, add=add)


def _norm_modulate(h, o, gate, shift, scale, eps, warps, add=None, affine=False):
    if h.stride(-1) != 1:
        h = h.contiguous()
    T, d = h.shape
    q = torch.empty((T, d), dtype=fp8.FP8, device=h.device)
    s = torch.empty((T, 1), dtype=torch.float32, device=h.device)
    residual = o is not None
    if residual:
        o, gate = o.contiguous(), gate.contiguous()
    else:
        o = gate = h  # unused pointers
    h_out = torch.empty_like(h) if residual or add is not None else h
    if add is not None:
        add = add.contiguous()
    hi, lo = pow2_split(d)
    from .kernels.act_quant import norm_modulate_quant_kernel

    norm_modulate_quant_kernel[(T,)](h, shift.contiguous(), scale.contiguous(), q, s, o, gate,
                                     h_out, h if add is None else add, d,
                                     1 if add is None else T // add.shape[0], eps, h.stride(0),
                                     q.stride(0), o.stride(0), h_out.stride(0),
                                     0 if add is None else add.stride(0), HI=hi, LO=lo,
                                     RESIDUAL=residual, ADD=add is not None, AFFINE=affine,
                                     num_warps=warps or max(1, min(8, (hi + lo) // 1024)))
    return q, s, h_out


def triton_gelu_quant(x, warps: int = 16):
    """The one-pass kernel; arguments and result as `gelu_quant_reference` (x's rows
    contiguous)."""
    if x.stride(-1) != 1:
        raise ValueError("x needs contiguous rows")
    T, K = x.shape
    q = torch.empty((T, K), dtype=fp8.FP8, device=x.device)
    s = torch.empty((T, 1), dtype=torch.float32, device=x.device)
    from .kernels.act_quant import gelu_quant_kernel

    hi, lo = pow2_split(K)
    gelu_quant_kernel[(T,)](x, q, s, K, x.stride(0), q.stride(0), HI=hi, LO=lo,
                            num_warps=warps)
    return q, s


def _swiglu_outputs(attn, gate, up):
    """Checks the rows are contiguous; returns T, A, M and the empty (q, scale) outputs."""
    T, A = attn.shape
    M = gate.shape[1]
    for name, t in (("attn", attn), ("gate", gate), ("up", up)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs contiguous rows")
    return (T, A, M, torch.empty((T, A + M), dtype=fp8.FP8, device=attn.device),
            torch.empty((T, 1), dtype=torch.float32, device=attn.device))


def triton_swiglu_quant(attn, gate, up, warps: int = 8, chunk: int = 2048):
    """The kernel; arguments and result as `swiglu_reference` (gate and up may be strided
    views, as the input projection's output split). One program per token walks its row in
    chunks (tile sizes: scripts/bench_kernels.py)."""
    T, A, M, q, s = _swiglu_outputs(attn, gate, up)
    from .kernels.act_quant import swiglu_quant_kernel

    swiglu_quant_kernel[(T,)](attn, gate, up, q, s, A, M, attn.stride(0), gate.stride(0),
                              up.stride(0), q.stride(0), BLOCK=chunk, num_warps=warps)
    return q, s


def pow2_split(n: int) -> tuple[int, int]:
    """n as its largest power of two and the power of two covering the rest (0 if none):
    10,240 -> (8192, 2048), 2,560 -> (2048, 512), 100 -> (64, 64)."""
    hi = 1 << (n.bit_length() - 1)
    rest = n - hi
    return hi, (1 << (rest - 1).bit_length()) if rest else 0


def triton_swiglu_quant_row(attn, gate, up, warps: int = 16):
    """The one-pass kernel (the row in registers, every input read once); arguments and
    result as `swiglu_reference`. 16 warps: the faster at the rank slice
    (scripts/bench_kernels.py --only act, docs/PERFORMANCE_LOG.md)."""
    T, A, M, q, s = _swiglu_outputs(attn, gate, up)
    from .kernels.act_quant import swiglu_quant_row_kernel

    (a_hi, a_lo), (m_hi, m_lo) = pow2_split(A), pow2_split(M)
    swiglu_quant_row_kernel[(T,)](attn, gate, up, q, s, A, M, attn.stride(0), gate.stride(0),
                                  up.stride(0), q.stride(0), A_HI=a_hi, A_LO=a_lo, M_HI=m_hi,
                                  M_LO=m_lo, num_warps=warps)
    return q, s


def triton_concat_quant(attn, attn_amax, y, y_amax, chunk: int = 2048, warps: int = 2):
    """The kernel; arguments and result as `concat_quant_reference` (attn_amax may be any
    strided [T, P] view: the attention kernel's is [heads, T] transposed). A program per
    (token, chunk of `chunk` columns): the maxima come in, so no program waits on a row
    reduction (2,048 columns, 2 warps; faster at the TP-3 rank slice than SwiGLU +
    quantization from the input projection's gate and up, and than without attn_amax:
    scripts/bench_kernels.py --only epilogues, docs/PERFORMANCE_LOG.md)."""
    import triton

    T, A = attn.shape
    F = y.shape[1]
    for name, t in (("attn", attn), ("y", y), ("y_amax", y_amax)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs contiguous rows")
    q = torch.empty((T, A + F), dtype=fp8.FP8, device=y.device)
    s = torch.empty((T, 1), dtype=torch.float32, device=y.device)
    has_am = attn_amax is not None
    am = attn_amax if has_am else y_amax  # unused pointer without it
    from .kernels.act_quant import concat_quant_kernel

    concat_quant_kernel[(T, triton.cdiv(A + F, chunk))](
        attn, am, y, y_amax, q, s, A, F, am.shape[1], y_amax.shape[1], attn.stride(0),
        am.stride(0), am.stride(1), y.stride(0), y_amax.stride(0), q.stride(0), BLOCK=chunk,
        A_BLOCK=triton.next_power_of_2(A), PA_BLOCK=triton.next_power_of_2(am.shape[1]),
        PY_BLOCK=triton.next_power_of_2(y_amax.shape[1]), ATTN_AMAX=has_am, num_warps=warps)
    return q, s


# The SwiGLU kernel the op runs: the one-pass kernel, faster than the two-pass one at the
# rank slice (scripts/bench_kernels.py, docs/PERFORMANCE_LOG.md).
triton_swiglu = triton_swiglu_quant_row


@dataclass(frozen=True)
class ActQuantOps:
    """The quantizations a block runs, as kernels or references."""

    quantize_rows: object
    norm_modulate: object
    residual_norm_modulate: object
    swiglu: object
    concat_quant: object
    residual_layer_norm: object
    residual_add_norm_modulate: object
    gelu: object


def select(fused: bool = True) -> ActQuantOps:
    """The operators (registered below): the Triton kernels on CUDA tensors, the
    references on CPU ones; not `fused`, the references themselves (fused_act_quant off)."""
    if not fused:
        return ActQuantOps(reference, norm_modulate_reference, residual_norm_modulate_reference,
                           swiglu_reference, concat_quant_reference,
                           residual_layer_norm_reference, residual_add_norm_modulate_reference,
                           gelu_quant_reference)
    ops = torch.ops.charengine
    return ActQuantOps(ops.act_quant.default, ops.norm_modulate_quant.default,
                       ops.residual_norm_modulate_quant.default, ops.swiglu_quant.default,
                       ops.concat_quant.default, ops.residual_layer_norm_quant.default,
                       ops.residual_add_norm_modulate_quant.default, ops.gelu_quant.default)


registry.register("act_quant", "(Tensor x) -> (Tensor, Tensor)", reference, triton_act_quant,
                  lambda x: registry.rows_and_scale(x, x.shape[1]))
registry.register("norm_modulate_quant",
                  "(Tensor h, Tensor shift, Tensor scale, float eps) -> (Tensor, Tensor)",
                  norm_modulate_reference, triton_norm_modulate_quant,
                  lambda h, shift, scale, eps: registry.rows_and_scale(h, h.shape[1]))
registry.register("residual_norm_modulate_quant",
                  "(Tensor h, Tensor o, Tensor gate, Tensor shift, Tensor scale, float eps) "
                  "-> (Tensor, Tensor, Tensor)",
                  residual_norm_modulate_reference, triton_residual_norm_modulate_quant,
                  lambda h, o, gate, shift, scale, eps: (*registry.rows_and_scale(h, h.shape[1]),
                                                         torch.empty_like(h)))
registry.register("swiglu_quant", "(Tensor attn_out, Tensor gate, Tensor up) -> (Tensor, Tensor)",
                  swiglu_reference, triton_swiglu,
                  lambda a, gate, up: registry.rows_and_scale(a, a.shape[1] + gate.shape[1]))
registry.register("concat_quant", "(Tensor attn_out, Tensor? attn_amax, Tensor y, Tensor y_amax) "
                  "-> (Tensor, Tensor)", concat_quant_reference, triton_concat_quant,
                  lambda a, am, y, ym: registry.rows_and_scale(a, a.shape[1] + y.shape[1]))
registry.register("residual_layer_norm_quant",
                  "(Tensor h, Tensor o, Tensor gate, Tensor weight, Tensor bias, float eps) "
                  "-> (Tensor, Tensor, Tensor)",
                  residual_layer_norm_reference, triton_residual_layer_norm_quant,
                  lambda h, o, gate, w, b, eps: (*registry.rows_and_scale(h, h.shape[1]),
                                                 torch.empty_like(h)))
registry.register("residual_add_norm_modulate_quant",
                  "(Tensor h, Tensor o, Tensor gate, Tensor add, Tensor shift, Tensor scale, "
                  "float eps) -> (Tensor, Tensor, Tensor)",
                  residual_add_norm_modulate_reference, triton_residual_add_norm_modulate_quant,
                  lambda h, o, gate, add, shift, scale, eps: (
                      *registry.rows_and_scale(h, h.shape[1]), torch.empty_like(h)))
registry.register("gelu_quant", "(Tensor x) -> (Tensor, Tensor)", gelu_quant_reference,
                  triton_gelu_quant, lambda x: registry.rows_and_scale(x, x.shape[1]))
