"""The characters block's ops, each chosen once from the config, the device, the engine's
GEMM plan and the TP exchange (vLLM's CustomOp is the model: each op holds its plain
reference or its fast path, picked at construction). The block (model.py) computes through a
`BlockOps` in straight-line code; no op decides anything per call but by the host-side phase
of the cache (filling, calibrated) and the shapes.

The plain math of every piece is written once: charengine/ops.py (modulation, SwiGLU, gated
residual, head RMS-norm), charengine/rope.py, and the plugins' references
(plugins/*.reference, plugins/gemm.REFERENCES), which the fast kernels are tested against.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import fp8
from ..family import GemmProblem
from ..mapping import identity
from ..ops import gated_residual, gated_residual_once, modulate, rms_norm_heads, swiglu
from ..rope import rotate
from .spec import RankShape

LINEARS = ("w_in", "w_out")  # the block linears: input (q, k, v, gate, up) and output


class Labels:
    """Profiler labels (paper Table 2's components), recorded only while `on`."""

    def __init__(self):
        self.on = False

    def __call__(self, name: str):
        return torch.profiler.record_function(name) if self.on else contextlib.nullcontext()


def epilogues(cfg) -> dict[str, str]:
    """Each block linear's GEMM epilogue (plugins/gemm.py) under cfg: SwiGLU in the input
    projection (gemm_swiglu), the gated residual in the output projection (gemm_residual,
    which needs the gate baked per pass), else the plain product."""
    sw, fp8_gemm = cfg.switches, cfg.numerics.fp8_gemm
    return {"w_in": "swiglu" if sw.gemm_swiglu and fp8_gemm else "plain",
            "w_out": "residual" if sw.gemm_residual and fp8_gemm and sw.baked_adaln
            else "plain"}


def gemm_problems(cfg, state: dict, mapping) -> dict[str, GemmProblem]:
    """The rank's block linears at the steady shape (M = tokens per frame), as the engine's
    switches run them; none without FP8 GEMMs."""
    spec = cfg.model
    if not cfg.numerics.fp8_gemm:
        return {}
    T, dtype = spec.tokens_per_frame, getattr(torch, cfg.numerics.dtype)
    split = 3 * RankShape.of(spec, mapping.tp, mapping.rank).attn_width(spec)
    dev = state["blocks.0.w_in.q"].device
    out = {}
    for kind, epi in epilogues(cfg).items():
        weights = [(state[f"blocks.{i}.{kind}.q"], state[f"blocks.{i}.{kind}.scale"])
                   for i in range(spec.n_blocks)]
        out[kind] = GemmProblem(epi, weights, T, split if epi == "swiglu" else 0,
                                torch.randn(T, spec.dim, device=dev).to(dtype)
                                if epi == "residual" else None)
    return out


@dataclass
class Attend:
    """How one forward's attention reads the cache (the host-side phase): `mask` [S] bool or
    `slots` (the first `slots` slots) while the window fills; `kernel`: the FP8 attention
    kernel over the ring as it lies (calibrated, full window)."""

    mask: torch.Tensor | None = None
    slots: int | None = None
    kernel: bool = False


# ---- the residual stream ------------------------------------------------------------------
class ResidualAdd:
    """h + gate * o of a pending residual (o, gate), or h where none is pending: rounded once
    (torch.addcmul) with fused_act_quant, as its kernels round, else after each op."""

    def __init__(self, once: bool):
        self.add = gated_residual_once if once else gated_residual

    def __call__(self, h, residual):
        if residual is None:
            return h
        o, gate = residual
        return self.add(h, gate, o)


class NormModulate:
    """The input projection's input in full precision: the pending residual added, then
    AdaLN. Returns (x, h)."""

    def __init__(self, add: ResidualAdd, eps: float):
        self.add, self.eps = add, eps

    def __call__(self, h, residual, shift, scale):
        h = self.add(h, residual)
        return modulate(h, shift, scale, self.eps), h


class NormQuant:
    """The pending residual added, then AdaLN and per-token FP8 quantization in one op (its
    kernel or reference). Returns ((x_q, x_scale), h)."""

    def __init__(self, add: ResidualAdd, act, eps: float, labels: Labels):
        self.add, self.act, self.eps, self.labels = add, act, eps, labels

    def __call__(self, h, residual, shift, scale):
        h = self.add(h, residual)
        with self.labels("act_quant"):
            return self.act.norm_modulate(h, shift, scale, self.eps), h


class ResidualNormQuant(NormQuant):
    """As NormQuant with the pending residual added inside the same op (fused_residual)."""

    def __call__(self, h, residual, shift, scale):
        with self.labels("act_quant"):
            if residual is None:
                return self.act.norm_modulate(h, shift, scale, self.eps), h
            aq, a_s, h = self.act.residual_norm_modulate(h, *residual, shift, scale, self.eps)
            return (aq, a_s), h


# ---- block linears ------------------------------------------------------------------------
class DequantLinear:
    """A block linear without FP8 activations: x times the dequantized FP8 weight."""

    def __init__(self, dtype, labels: Labels):
        self.dtype, self.labels = dtype, labels

    def __call__(self, x, w_q, w_s, reduce=None):
        with self.labels("gemm"):
            out = x.to(self.dtype) @ fp8.dequantize(w_q, w_s[:, None], self.dtype).t()
        return reduced(out, reduce, self.labels)


class Fp8Linear:
    """A block linear on per-token FP8 activations (x_q, x_scale): the planned GEMM at the
    steady shape it was measured at, `_scaled_mm` at any other; with `reduce`, the TP
    exchange fused into the GEMM where there is one, else the GEMM then `reduce`."""

    def __init__(self, dtype, fast_accum: bool, planned, steady_m: int, exchange,
                 labels: Labels):
        self.dtype, self.fast, self.planned, self.steady_m = dtype, fast_accum, planned, steady_m
        self.exchange, self.labels = exchange, labels

    def __call__(self, x, w_q, w_s, reduce=None):
        aq, a_s = x
        if reduce is not None and self.exchange is not None:
            with self.labels("fp8_gemm"):
                return self.exchange(aq, a_s, w_q, w_s, self.dtype, self.fast, reduce)
        gemm = self.planned if self.planned is not None and aq.shape[0] == self.steady_m \
            else fp8.scaled_mm
        with self.labels("fp8_gemm"):
            out = gemm(aq, a_s, w_q, w_s, self.dtype, self.fast)
        return reduced(out, reduce, self.labels)


def reduced(out, reduce, labels: Labels):
    if reduce is None:
        return out
    with labels("all_reduce"):
        return reduce(out)


class InProj:
    """The input projection: q, k, v [H, T, D] (strided views of its output) and the MLP's
    (gate, up) [T, mlp] each."""

    def __init__(self, linear, shape: RankShape, head_dim: int):
        self.linear, self.H, self.D = linear, shape.heads, head_dim
        self.A, self.M = shape.heads * head_dim, shape.mlp

    def __call__(self, x, w_q, w_s):
        y = self.linear(x, w_q, w_s)
        A = self.A
        q, k, v, g, u = y.split([A, A, A, self.M, self.M], -1)
        return (*self.heads(q, k, v), (g, u))

    def heads(self, *ts):
        """[T, A] projections as [H, T, D] strided views."""
        return tuple(t.reshape(t.shape[0], self.H, self.D).transpose(0, 1) for t in ts)


class SwiGLUInProj(InProj):
    """The input projection with SwiGLU in its epilogue (gemm_swiglu; the weight's gate and
    up rows stored as pairs): q, k, v and (silu(gate) * up [T, mlp], its rows' |max|
    partials)."""

    def __init__(self, gemm, dtype, fast_accum: bool, shape: RankShape, head_dim: int,
                 labels: Labels):
        super().__init__(None, shape, head_dim)
        self.gemm, self.dtype, self.fast, self.labels = gemm, dtype, fast_accum, labels

    def __call__(self, x, w_q, w_s):
        aq, a_s = x
        with self.labels("fp8_gemm"):
            y, y_mlp, y_amax = self.gemm(aq, a_s, w_q, w_s, self.dtype, self.fast, 3 * self.A)
        A = self.A
        return (*self.heads(*y.split([A, A, A], dim=-1)), (y_mlp, y_amax))


# ---- pre-attention and attention ----------------------------------------------------------
def _stores(cache, bp: int):
    """Cache bp's K and V stores and scales as they lie (FP8 once calibrated)."""
    if cache.quantized:
        return cache.k8[bp], cache.v8[bp], cache.scale[bp, 0], cache.scale[bp, 1]
    return cache.k[bp], cache.v[bp], None, None


class PreAttention:
    """QK RMS-norm, RoPE at the new frame's position, K/V quantization with the cache's
    scales and the write at the device-side write position: one op (`fn`: the fused plugin
    op, or its reference plugins/pre_attention.reference). Returns the queries, with
    quantize_q as (q8, scale) per (head, token)."""

    def __init__(self, fn, eps: float):
        self.fn, self.eps = fn, eps

    def __call__(self, q, k, v, q_norm, k_norm, cond, cache, bp: int, quantize_q: bool):
        return self.fn(q, k, v, q_norm, k_norm, self.eps, cond.cos, cond.sin,
                       *_stores(cache, bp), cond.write_index, quantize_q=quantize_q)


class RopeAtReadPreAttention:
    """The paper's baseline: keys are cached before RoPE (every read re-ropes the cache)."""

    def __init__(self, act, eps: float):
        self.act, self.eps = act, eps

    def __call__(self, q, k, v, q_norm, k_norm, cond, cache, bp: int, quantize_q: bool):
        q, k = rms_norm_heads(q, q_norm, self.eps), rms_norm_heads(k, k_norm, self.eps)
        q = rotate(q, cond.cos, cond.sin)
        cache.write(bp, k, v)
        if quantize_q:
            q8, qs = self.act.quantize_rows(q.reshape(-1, q.shape[-1]))
            return q8.view(q.shape), qs.view(*q.shape[:2], 1)
        return q


class Attention:
    """Attention of the new frame over cache bp: the FP8 kernel over the ring as it lies
    where there is one and the phase allows (`kernel`: the op, with its output's maxima
    where `with_amax`), else the cache read (dequantized, or the baseline's per-read RoPE and
    re-quantization) and SDPA, the queries through FP8 as the numerics say. Returns
    (o [T, A], its (token, head) maxima or None)."""

    def __init__(self, cfg, kernel, with_amax: bool, width: int, dtype, labels: Labels):
        self.kernel, self.with_amax, self.A, self.dtype = kernel, with_amax, width, dtype
        self.fp8_q = cfg.numerics.fp8_attention
        self.rows = cfg.switches.fp8_kv  # queries per (head, token) with the FP8 cache
        self.labels = labels

    def phase(self, cache, mask=None, slots: int | None = None) -> Attend:
        return Attend(mask, slots, self.kernel is not None and cache.quantized and mask is None
                      and slots is None)

    def __call__(self, q, cache, bp: int, cond, attend: Attend):
        if attend.kernel:
            with self.labels("attention"):
                out = self.kernel(*q, cache.k8[bp], cache.v8[bp], cache.scale[bp, 0],
                                  cache.scale[bp, 1], self.dtype)
            return out if self.with_amax else (out, None)
        with self.labels("cache_upkeep"):
            kc, vc = cache.read(bp, cond.key_cos_sin)
            if attend.slots is not None:
                kc, vc = kc[:, :attend.slots], vc[:, :attend.slots]
        with self.labels("attention"):
            if self.fp8_q:
                q = fp8.quant_dequant_rows(q) if self.rows else fp8.quant_dequant_per_tensor(q)
            mask = attend.mask
            o = F.scaled_dot_product_attention(q[None], kc[None], vc[None],
                                               attn_mask=None if mask is None else mask[None, :])[0]
            return o.transpose(0, 1).reshape(q.shape[1], self.A), None


# ---- the output projection ----------------------------------------------------------------
class OutInput:
    """The output projection's input [attn, silu(gate) * up]: in full precision, or FP8 per
    token: SwiGLU and quantization from (gate, up) in one op, or with gemm_swiglu the
    concatenation quantized with the maxima the input projection and attention gave."""

    def __init__(self, act, fp8_gemm: bool, swiglu_epilogue: bool, labels: Labels):
        self.act, self.labels = act, labels
        self.mode = "concat" if swiglu_epilogue else "swiglu" if fp8_gemm else "plain"

    def __call__(self, attn, mlp, attn_amax=None):
        if self.mode == "plain":
            gate, up = mlp
            return torch.cat([attn, swiglu(gate, up)], dim=-1)
        with self.labels("act_quant"):
            if self.mode == "concat":
                y, y_amax = mlp
                return self.act.concat_quant(attn, attn_amax, y, y_amax)
            return self.act.swiglu(attn, *mlp)


class OutProj:
    """The output projection, all-reduced: `project` gives the block's o; `finish` gives
    (h, the pending residual (o, gate)) for the next block to add."""

    def __init__(self, out_input: OutInput, linear, all_reduce):
        self.input, self.linear, self.all_reduce = out_input, linear, all_reduce

    def project(self, attn, mlp, w_q, w_s, attn_amax=None):
        return self.linear(self.input(attn, mlp, attn_amax), w_q, w_s, self.all_reduce)

    def finish(self, attn, mlp, h, gate, w_q, w_s, gated_scale, attn_amax=None):
        return h, (self.project(attn, mlp, w_q, w_s, attn_amax), gate)


class ResidualOutProj(OutProj):
    """The output projection with the gated residual in its epilogue (gemm_residual): the
    new h = h + gate * o, the gate folded into the weight's scale per (block, pass). Under TP
    h is added once to the sum: by rank 0 before the all-reduce, or inside the fused
    exchange's reduction on every rank."""

    def __init__(self, out_input, linear, all_reduce, gemm, exchange, adds_h: bool, dtype,
                 fast_accum: bool, labels: Labels):
        super().__init__(out_input, linear, all_reduce)
        self.gemm, self.exchange, self.adds_h = gemm, exchange, adds_h
        self.dtype, self.fast, self.labels = dtype, fast_accum, labels

    def finish(self, attn, mlp, h, gate, w_q, w_s, gated_scale, attn_amax=None):
        aq, a_s = self.input(attn, mlp, attn_amax)
        with self.labels("fp8_gemm"):
            if self.exchange is not None:
                return self.exchange(aq, a_s, w_q, gated_scale, self.dtype, self.fast,
                                     self.all_reduce, h), None
            out = self.gemm(aq, a_s, w_q, gated_scale, h if self.adds_h else None, self.dtype,
                            self.fast)
        return reduced(out, self.all_reduce, self.labels), None


# ---- the block's ops, built once ----------------------------------------------------------
class BlockOps:
    """Every op a characters block runs, chosen once. `gemm_plan`: the engine's GEMM choice
    per block linear at the steady shape (on a GPU); `exchange`: the TP group's fused GEMM +
    all-reduce, or None; `all_reduce`: the TP group's sum (identity at TP-1)."""

    def __init__(self, cfg, shape: RankShape, device, gemm_plan=None, exchange=None,
                 all_reduce=identity, attention_tiles=None):
        from ..plugins import act_quant, attention, gemm, pre_attention

        spec, sw, num = cfg.model, cfg.switches, cfg.numerics
        device, plan = torch.device(device), gemm_plan or {}
        dtype, eps = getattr(torch, num.dtype), spec.norm_eps
        exchange = exchange if sw.fused_gemm_allreduce else None
        self.labels = labels = Labels()
        self.epilogues = epi = epilogues(cfg)
        act = self.act = act_quant.select(sw.fused_act_quant)
        add = self.add_residual = ResidualAdd(sw.fused_act_quant)
        if not num.fp8_gemm:
            self.norm_in = NormModulate(add, eps)
            linear = {k: DequantLinear(dtype, labels) for k in LINEARS}
        else:
            norm = ResidualNormQuant if sw.fused_residual else NormQuant
            self.norm_in = norm(add, act, eps, labels)
            linear = {k: Fp8Linear(dtype, num.fast_accum_for(k),
                                   gemm.select(plan[k]) if k in plan and epi[k] == "plain"
                                   else None, spec.tokens_per_frame, exchange, labels)
                      for k in LINEARS}
        if epi["w_in"] == "swiglu":
            self.in_proj = SwiGLUInProj(gemm.select(plan.get("w_in"), "swiglu", device), dtype,
                                        num.fast_accum_for("w_in"), shape, spec.head_dim, labels)
        else:
            self.in_proj = InProj(linear["w_in"], shape, spec.head_dim)
        swiglu_epi = epi["w_in"] == "swiglu"
        if sw.fused_pre_attention:
            self.pre_attention = PreAttention(pre_attention.select(), eps)
        elif sw.rope_at_write:
            self.pre_attention = PreAttention(pre_attention.reference, eps)
        else:
            self.pre_attention = RopeAtReadPreAttention(act, eps)
        kernel = None
        if sw.fp8_attention_kernel and sw.fp8_kv:
            kernel = attention.select(spec.head_dim, attention_tiles, amax=swiglu_epi)
        self.attention = Attention(cfg, kernel, swiglu_epi, shape.heads * spec.head_dim, dtype,
                                   labels)
        out_input = OutInput(act, num.fp8_gemm, swiglu_epi, labels)
        residual_gemm = gemm.select(plan.get("w_out"), "residual", device) \
            if epi["w_out"] == "residual" else None
        # the frame forward's output projection; the session start's is always `project`
        self.plain_out = OutProj(out_input, linear["w_out"], all_reduce)
        if residual_gemm is not None:
            self.out_proj = ResidualOutProj(
                out_input, linear["w_out"], all_reduce, residual_gemm, exchange,
                all_reduce is identity or shape.rank == 0, dtype, num.fast_accum_for("w_out"),
                labels)
        else:
            self.out_proj = self.plain_out

    @property
    def folds_gate(self) -> bool:
        """The output projection's weight scales carry the AdaLN gate per (block, pass)."""
        return isinstance(self.out_proj, ResidualOutProj)

    @property
    def pairs_gate_up(self) -> bool:
        """The input projection's gate and up rows are stored as pairs (SwiGLU epilogue)."""
        return isinstance(self.in_proj, SwiGLUInProj)
