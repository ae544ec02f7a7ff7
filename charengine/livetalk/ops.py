"""The LiveTalk block's ops, each chosen once from the config, the weights and the engine's
GEMM plan, as the characters family's ops.py chooses its own: the model's forward computes
through a `BlockOps` in straight-line code and reads no switch. The one thing a forward asks
is the cache's phase (`BlockOps.phase`): whether its FP8 store is in use, which picks the
pre-attention and attention of that phase, both chosen at construction.

The plain math of every piece is written once: charengine/ops.py (modulation, gated
residual, GELU, the RMS norm across the width) and the plugins' references, which the fused
kernels are tested against."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import fp8
from ..ops import gated_residual, gated_residual_once, gelu_tanh, modulate
from ..ops import rms_norm_width as rms_norm
from .rope import ComplexRotation, TableRotation


def parts(x: torch.Tensor, n: int, dim: int = 0) -> tuple[torch.Tensor, ...]:
    """A batch's n sessions' equal parts of x stacked along `dim`, each contiguous (x itself
    where n is 1)."""
    return (x,) if n == 1 else tuple(p.contiguous() for p in x.chunk(n, dim))


def stacked(xs, dim: int = 0) -> torch.Tensor:
    """The sessions' tensors stacked along `dim` (the one itself where there is one)."""
    return xs[0] if len(xs) == 1 else torch.cat(list(xs), dim)


class Heads:
    """[..., dim] as [..., heads, head_dim]."""

    def __init__(self, spec):
        self.shape = (spec.n_heads, spec.head_dim)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, self.shape)


# ---- linears ------------------------------------------------------------------------------
class Linears:
    """Every linear of the model by its weight's name. Weights in the model's dtype go
    through F.linear; FP8 weights take per-token FP8 activations (quantized here unless the
    caller passes (q, scale), made once for the linears that share it), through the GEMM the
    engine planned for the linear's kind at the chunk's shape and `_scaled_mm` at any other,
    the bias in the GEMM's epilogue where gemm_bias is on and the GEMM takes one."""

    def __init__(self, w: dict, act, gemms: dict, dtype, fast_accum: bool, steady_m: int,
                 gemm_bias: bool):
        from ..plugins.gemm import takes_bias

        self.w, self.act, self.dtype, self.fast, self.steady_m = w, act, dtype, fast_accum, \
            steady_m
        self.fp8 = frozenset(k[: -len(".weight")] for k, v in w.items()
                             if k.endswith(".weight") and v.dtype == fp8.FP8)
        self.planned = {kind: (g, gemm_bias and takes_bias(g)) for kind, g in gemms.items()}
        self.other = (fp8.scaled_mm, gemm_bias and takes_bias(fp8.scaled_mm))

    def __call__(self, name: str, x, kind: str | None = None) -> torch.Tensor:
        w, b = self.w[f"{name}.weight"], self.w[f"{name}.bias"]
        if name not in self.fp8:
            return F.linear(x, w, b)
        aq, a_s = x if isinstance(x, tuple) else \
            self.act.quantize_rows(x.reshape(-1, x.shape[-1]))
        gemm, with_bias = self.planned.get(kind, self.other) if aq.shape[0] == self.steady_m \
            else self.other
        ws = self.w[f"{name}.weight_scale"]
        if with_bias:
            return gemm(aq, a_s, w, ws, self.dtype, self.fast, bias=b)
        return gemm(aq, a_s, w, ws, self.dtype, self.fast) + b


class SplitQKV:
    """Block b's q, k, v [T, dim]: three linears."""

    def __init__(self, linear):
        self.linear = linear

    def __call__(self, b: int, a):
        pre = f"blocks.{b}.self_attn"
        return tuple(self.linear(f"{pre}.{n}", a, "attn") for n in "qkv")


class FusedQKV:
    """Block b's q, k, v [T, dim]: one GEMM over the concatenated weight (fused_qkv), its
    output split."""

    def __init__(self, linear, dim: int):
        self.linear, self.dim = linear, dim

    def __call__(self, b: int, a):
        return self.linear(f"blocks.{b}.self_attn.qkv", a, "qkv").split(self.dim, dim=-1)


# ---- the patch embedding and the rotation -------------------------------------------------
class PatchConv:
    """The patch embedding as upstream's Conv3d, its output viewed as rows [F * T, dim]."""

    def __init__(self, w: dict, patch: int):
        self.weight, self.bias = w["patch_embedding.weight"], w["patch_embedding.bias"]
        self.patch = patch

    def __call__(self, inp: torch.Tensor) -> torch.Tensor:
        p = self.patch
        h = F.conv3d(inp[None], self.weight, self.bias, stride=(1, p, p))
        return h.flatten(2)[0].t()


class PatchGemm(PatchConv):
    """The patch embedding as one GEMM over the patches (patch_gemm): contiguous rows, each
    patch's values ordered (channel, row, column) as the Conv3d weight's."""

    def __init__(self, w: dict, spec):
        super().__init__(w, spec.patch)
        self.grid, self.T = (spec.grid_h, spec.grid_w), spec.frame_tokens

    def __call__(self, inp: torch.Tensor) -> torch.Tensor:
        c, f = inp.shape[:2]
        p, (gh, gw) = self.patch, self.grid
        patches = inp.view(c, f, gh, p, gw, p).permute(1, 2, 4, 0, 3, 5)
        return F.linear(patches.reshape(f * self.T, c * p * p), self.weight.flatten(1),
                        self.bias)


def table_rope(cache):
    """The chunk's rotation from fp32 tables at the cache's positions (rope_tables)."""
    return TableRotation(*cache.rope.tables(cache.positions))


def complex_rope(cache):
    """The chunk's rotation as upstream's complex128 phasors at the cache's positions."""
    return ComplexRotation(cache.rope.phasors(cache.positions))


# ---- the block's inputs -------------------------------------------------------------------
class NormInput:
    """The self-attention's input in the model's dtype: the block's audio rows `add` added
    to h, then AdaLN. `residual` (a pending FFN residual) is always None here. Returns
    (a, h)."""

    def __init__(self, frame_tokens: int, eps: float):
        self.T, self.eps = frame_tokens, eps

    def with_audio(self, h, add):
        return h if add is None else add.repeat_interleave(self.T, dim=0) + h

    def __call__(self, h, residual, add, shift, scale):
        h = self.with_audio(h, add)
        return modulate(h, shift, scale, self.eps), h


class QuantInput(NormInput):
    """As NormInput with AdaLN and the per-token FP8 quantization q, k and v share in one op
    (fused_act_quant): returns ((q, scale), h)."""

    def __init__(self, act, frame_tokens: int, eps: float):
        super().__init__(frame_tokens, eps)
        self.act = act

    def __call__(self, h, residual, add, shift, scale):
        h = self.with_audio(h, add)
        return self.act.norm_modulate(h, shift, scale, self.eps), h


class ResidualQuantInput(QuantInput):
    """As QuantInput with the previous block's pending gated residual h + gate * o (and the
    audio rows) added inside the same op (fused_residual)."""

    def __call__(self, h, residual, add, shift, scale):
        if residual is None:
            return super().__call__(h, residual, add, shift, scale)
        o, gate = residual
        if add is None:
            aq, a_s, h = self.act.residual_norm_modulate(h, o, gate, shift, scale, self.eps)
        else:
            aq, a_s, h = self.act.residual_add_norm_modulate(h, o, gate, add, shift, scale,
                                                             self.eps)
        return (aq, a_s), h


# ---- pre-attention and self-attention, per phase of the cache -----------------------------
class PlainPreAttention:
    """The queries and keys RMS-normed across the width, rotated; K/V written through the
    cache (quantized there once calibrated). Returns q [heads, T, head_dim]."""

    def __init__(self, heads: Heads, eps: float):
        self.heads, self.eps = heads, eps

    def __call__(self, b, q, k, v, qn, kn, rope, cache):
        q = rope(self.heads(rms_norm(q, qn, self.eps))).transpose(0, 1)
        cache.write(b, rope(self.heads(rms_norm(k, kn, self.eps))), self.heads(v))
        return q


class WidePreAttention(PlainPreAttention):
    """The pre-attention in one op writing the cache in the model's dtype
    (fused_wide_pre_attention): returns q [heads, T, head_dim]."""

    def __init__(self, fn, heads: Heads, eps: float):
        super().__init__(heads, eps)
        self.fn = fn

    def __call__(self, b, q, k, v, qn, kn, rope, cache):
        h = self.heads
        q, _ = self.fn(h(q), h(k), h(v), qn, kn, self.eps, rope.cos, rope.sin, *cache.stores(b),
                       None, None, cache.write_index)
        return q


class Fp8PreAttention(WidePreAttention):
    """The pre-attention in one op writing the FP8 cache (fused_pre_attention with FP8
    attention): returns the FP8 queries (q8, scale) per (head, token)."""

    def __call__(self, b, q, k, v, qn, kn, rope, cache):
        h = self.heads
        return self.fn(h(q), h(k), h(v), qn, kn, self.eps, rope.cos, rope.sin,
                       *cache.stores_fp8(b), cache.write_index)


class CacheAttention:
    """SDPA of q [heads, T, head_dim] over block b's first n slots, read in the model's
    dtype (dequantized once calibrated) -> [T, dim]."""

    def __call__(self, b, q, cache, n_slots):
        kc, vc = cache.read(b, n_slots)
        o = F.scaled_dot_product_attention(q[None], kc[None], vc[None])
        return o[0].transpose(0, 1).flatten(1)


class Fp8CacheAttention:
    """The FP8 attention kernel over block b's FP8 cache as it lies; q is the FP8 queries
    (q8, scale), or quantized here per (head, token) -> [T, dim]."""

    def __init__(self, kernel, act, spec, dtype):
        self.kernel, self.act, self.dtype = kernel, act, dtype
        self.H, self.D = spec.n_heads, spec.head_dim

    def __call__(self, b, q, cache, n_slots):
        H, D = self.H, self.D
        q8, qs = q if isinstance(q, tuple) else self.act.quantize_rows(q.reshape(-1, D))
        k8, v8, ks, vs = cache.read_fp8(b, n_slots)
        return self.kernel(q8.view(H, -1, D), qs.view(H, -1, 1), k8, v8, ks, vs, self.dtype)


@dataclass(frozen=True)
class Phase:
    """A forward's pre-attention and self-attention for the cache's phase."""

    pre_attention: object
    attention: object


# ---- after the self-attention -------------------------------------------------------------
class AttentionResidual:
    """h + gate * o, then the cross-attention's input norm (norm3): returns (a, h)."""

    def __init__(self, w: dict, dim: int, eps: float):
        self.w, self.dim, self.eps = w, dim, eps

    def norm3(self, b):
        return self.w[f"blocks.{b}.norm3.weight"], self.w[f"blocks.{b}.norm3.bias"]

    def __call__(self, b, h, o, gate):
        h = gated_residual(h, gate, o)
        return F.layer_norm(h, (self.dim,), *self.norm3(b), self.eps), h


class FusedAttentionResidual(AttentionResidual):
    """The residual inside the norm's kernel, its output quantized per token
    (fused_residual): returns ((q, scale), h)."""

    def __init__(self, act, w: dict, dim: int, eps: float):
        super().__init__(w, dim, eps)
        self.act = act

    def __call__(self, b, h, o, gate):
        aq, a_s, h = self.act.residual_layer_norm(h, o, gate, *self.norm3(b), self.eps)
        return (aq, a_s), h


class CrossAttention:
    """Cross-attention to the prompt of each session in the batch: the queries of all of them
    in one projection and RMS-normed (`q_norm`: its kernel or the plain norm), SDPA over each
    session's prompt K/V (`kv(b, cache)`: kept at session start with text_kv_once, else
    computed per call), the output projection of all of them."""

    def __init__(self, linear, w: dict, heads: Heads, q_norm, kv, eps: float):
        self.linear, self.w, self.heads, self.q_norm, self.kv = linear, w, heads, q_norm, kv
        self.eps = eps

    def __call__(self, b, a, caches):
        pre = f"blocks.{b}.cross_attn"
        q = self.q_norm(self.linear(f"{pre}.q", a, "attn"), self.w[f"{pre}.norm_q.weight"],
                        self.eps)
        os = []
        for qi, cache in zip(parts(q, len(caches)), caches):
            k, v = self.kv(b, cache)
            o = F.scaled_dot_product_attention(self.heads(qi).transpose(0, 1)[None], k[None],
                                               v[None])
            os.append(o[0].transpose(0, 1).flatten(1))
        return self.linear(f"{pre}.o", stacked(os), "attn")


class Fp8CrossAttention:
    """Cross-attention through the FP8 attention kernel over each session's prompt FP8 K/V
    (fp8_cross_attention): the queries of the batch normed and quantized per (head, token)
    in one op."""

    def __init__(self, linear, w: dict, norm_quant, kernel, spec, dtype):
        self.linear, self.w, self.norm_quant, self.kernel = linear, w, norm_quant, kernel
        self.eps, self.H, self.dtype = spec.norm_eps, spec.n_heads, dtype

    def __call__(self, b, a, caches):
        pre = f"blocks.{b}.cross_attn"
        q8, qs = self.norm_quant(self.linear(f"{pre}.q", a, "attn"),
                                 self.w[f"{pre}.norm_q.weight"], self.eps, self.H)
        n = len(caches)
        os = [self.kernel(q8i, qsi, *cache.text_fp8(b), self.dtype) for q8i, qsi, cache in
              zip(parts(q8, n, 1), parts(qs, n, 1), caches)]
        return self.linear(f"{pre}.o", stacked(os), "attn")


def kept_text_kv(b, cache):
    """Block b's prompt K/V kept at session start (text_kv_once)."""
    return cache.text_k[b], cache.text_v[b]


class FfnInput:
    """h + the cross-attention's output, then the FFN's AdaLN: returns (a, h)."""

    def __init__(self, eps: float):
        self.eps = eps

    def __call__(self, h, cross, shift, scale):
        h = h + cross
        return modulate(h, shift, scale, self.eps), h


class FusedFfnInput(FfnInput):
    """The add inside the FFN input's AdaLN and quantization (fused_act_quant): returns
    ((q, scale), h)."""

    def __init__(self, act, dim: int, device, dtype, eps: float):
        super().__init__(eps)
        self.act = act
        self.ones = torch.ones(dim, device=device, dtype=dtype)

    def __call__(self, h, cross, shift, scale):
        aq, a_s, h = self.act.residual_norm_modulate(h, cross, self.ones, shift, scale, self.eps)
        return (aq, a_s), h


class Ffn:
    """Block b's GELU FFN: up, GELU (`gelu`: with fused_gelu_quant its output quantized in
    the same op), down."""

    def __init__(self, linear, gelu):
        self.linear, self.gelu = linear, gelu

    def __call__(self, b, a):
        up = self.gelu(self.linear(f"blocks.{b}.ffn.0", a, "ffn_up"))
        return self.linear(f"blocks.{b}.ffn.2", up, "ffn_down")


def ffn_residual(h, f, gate):
    """h + gate * f now; nothing left pending."""
    return gated_residual(h, gate, f), None


def pending_ffn_residual(h, f, gate):
    """The FFN's residual (f, gate) left for the next block's input op to add
    (fused_residual)."""
    return h, (f, gate)


def add_pending(h, residual):
    """The last block's pending residual, rounded once as the fused ops round."""
    if residual is None:
        return h
    f, gate = residual
    return gated_residual_once(h, gate, f)


# ---- the block's ops, built once ----------------------------------------------------------
class BlockOps:
    """Every op the LiveTalk DiT runs, chosen once. `w`: the weights on the device (q, k, v
    fused where fused_qkv); `gemms`: the engine's GEMM per linear kind at the chunk's shape
    (on a GPU); `cross_kv(b, context)`: block b's prompt K/V computed from a session's
    text context."""

    def __init__(self, cfg, w: dict, device, dtype, gemms: dict, cross_kv):
        from ..plugins import act_quant, attention, pre_attention_width
        from ..plugins import rms_norm as rms_norm_op

        spec, sw, num = cfg.model, cfg.switches, cfg.numerics
        device = torch.device(device)
        eps, T = spec.norm_eps, spec.frame_tokens
        heads = Heads(spec)
        fp8_linears = any(v.dtype == fp8.FP8 for v in w.values())
        fused_input = fp8_linears and sw.fused_act_quant
        fused_residual = fused_input and sw.fused_residual
        act = act_quant.select(sw.fused_act_quant)
        self.linear = linear = Linears(w, act, gemms, dtype,
                                       num.fast_accum and device.type == "cuda",
                                       spec.chunk_tokens, sw.gemm_bias)
        self.qkv = FusedQKV(linear, spec.dim) if sw.fused_qkv else SplitQKV(linear)
        self.embed = PatchGemm(w, spec) if sw.patch_gemm else PatchConv(w, spec.patch)
        self.rope = table_rope if sw.rope_tables else complex_rope
        if fused_residual:
            self.block_input = ResidualQuantInput(act, T, eps)
        elif fused_input:
            self.block_input = QuantInput(act, T, eps)
        else:
            self.block_input = NormInput(T, eps)
        plain_pre, sdpa = PlainPreAttention(heads, eps), CacheAttention()
        wide = WidePreAttention(pre_attention_width.select(), heads, eps) \
            if sw.fused_wide_pre_attention else plain_pre
        self.filling = Phase(wide, sdpa)
        if num.fp8_attention:
            tiles = attention.SPLIT_TILES if sw.split_attention else attention.AttentionTiles()
            if sw.pipelined_attention:
                tiles = dataclasses.replace(tiles, pipelined=True)
            kernel = Fp8CacheAttention(attention.select(spec.head_dim, tiles), act, spec,
                                       dtype)
            pre = Fp8PreAttention(pre_attention_width.select(), heads, eps) \
                if sw.fused_pre_attention else plain_pre
            self.quantized = Phase(pre, kernel)
        else:
            self.quantized = Phase(plain_pre, sdpa)
        self.attention_residual = FusedAttentionResidual(act, w, spec.dim, eps) \
            if fused_residual else AttentionResidual(w, spec.dim, eps)
        if sw.fp8_cross_attention and sw.text_kv_once and num.fp8_attention:
            self.cross_attention = Fp8CrossAttention(
                linear, w, rms_norm_op.select(heads_quant=True),
                attention.select(spec.head_dim, attention.CROSS_TILES), spec, dtype)
        else:
            self.cross_attention = CrossAttention(
                linear, w, heads, rms_norm_op.select() if sw.fused_q_norm else rms_norm,
                kept_text_kv if sw.text_kv_once else (lambda b, cache: cross_kv(b, cache.context)),
                eps)
        self.fp8_cross = isinstance(self.cross_attention, Fp8CrossAttention)
        self.ffn_input = FusedFfnInput(act, spec.dim, device, dtype, eps) if fused_input \
            else FfnInput(eps)
        self.ffn = Ffn(linear, act.gelu if fp8_linears and sw.fused_gelu_quant else gelu_tanh)
        self.ffn_residual = pending_ffn_residual if fused_residual else ffn_residual
        # the commit pass stops after the last block's K/V write (skip_commit_tail)
        self.commit_stop = spec.n_blocks - 1 if sw.skip_commit_tail else None

    def phase(self, cache) -> Phase:
        """The pre-attention and attention for the cache as it lies: its FP8 store in use
        (after the calibration) or its store in the model's dtype."""
        return self.quantized if cache.quantized else self.filling
