"""The characters DiT on one TP rank: parallel blocks with AdaLN, QK RMS-norm, 3-D RoPE and
SwiGLU; the forward over a new frame (writing and reading the KV caches) and over the session's
global tokens.

Block: xm = LN(h) * (1 + scale) + shift; [q k v gate up] = W_in xm (FP8, column-parallel;
with gemm_swiglu, silu(gate) * up in the GEMM's epilogue, W_in's gate and up rows stored as
pairs); attention over the cache; o = W_out [attn, silu(gate) * up] (FP8, row-parallel),
all-reduced; h += gate_ada * o (with gemm_residual, in the output projection's epilogue, the
gate folded into its weight scale; else with fused_residual, inside the next block's first
kernel). Shift, scale and gate come from the pass's timestep alone.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from . import fp8
from .cache import KVCache
from .config import EngineConfig, RankShape
from .rope import RopeTables, cos_sin, rotate
from .ops import rms_norm_heads

AllReduce = Callable[[torch.Tensor], torch.Tensor]


def identity(t: torch.Tensor) -> torch.Tensor:
    return t


def timestep_embedding(sigma: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of sigma * 1000, [..., dim]."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32,
                                                         device=sigma.device) / half)
    a = (sigma.float() * 1000.0)[..., None] * freqs
    return torch.cat([torch.cos(a), torch.sin(a)], dim=-1)


def bake_adaln(cfg: EngineConfig, state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """All blocks' modulations for the fixed schedule: table [passes, blocks, 3, d] and the
    final layer's [passes, 2, d], in fp32 (one GEMM per block at build time)."""
    spec, d = cfg.model, cfg.model.dim
    dev = state["time_mlp.0.weight"].device
    c = F.silu(conditioning_vector(state, torch.tensor(cfg.schedule.sigmas, device=dev),
                                   spec.time_freq_dim))
    blocks = [c @ state[f"blocks.{i}.adaln.weight"].float().t() + state[f"blocks.{i}.adaln.bias"].float()
              for i in range(spec.n_blocks)]
    table = torch.stack(blocks, dim=1).reshape(cfg.schedule.passes, spec.n_blocks, 3, d)
    final = c @ state["final_adaln.weight"].float().t() + state["final_adaln.bias"].float()
    return table, final.reshape(-1, 2, d)


def conditioning_vector(w: dict[str, torch.Tensor], sigma: torch.Tensor, freq_dim: int):
    e = timestep_embedding(sigma, freq_dim)
    h = F.silu(e @ w["time_mlp.0.weight"].float().t() + w["time_mlp.0.bias"].float())
    return h @ w["time_mlp.2.weight"].float().t() + w["time_mlp.2.bias"].float()


def patchify(latent: torch.Tensor, p: int) -> torch.Tensor:
    """[C, H, W] -> tokens [(H/p) * (W/p), C * p * p]."""
    C, H, W = latent.shape
    x = latent.reshape(C, H // p, p, W // p, p).permute(1, 3, 0, 2, 4)
    return x.reshape((H // p) * (W // p), C * p * p)


def unpatchify(tokens: torch.Tensor, C: int, H: int, W: int, p: int) -> torch.Tensor:
    x = tokens.reshape(H // p, W // p, C, p, p).permute(2, 0, 3, 1, 4)
    return x.reshape(C, H, W)


@dataclass
class StepConditioning:
    """What a step's four forwards share: built once per step with conditioning_cache on,
    once per forward with it off."""

    audio: torch.Tensor  # [audio_tokens, d]
    cos: torch.Tensor  # new frame's RoPE [T, D/2]
    sin: torch.Tensor
    c: torch.Tensor | None  # [passes, d] timestep conditioning (plain AdaLN path only)
    key_cos_sin: tuple[torch.Tensor, torch.Tensor] | None  # baseline: every slot [S, D/2]
    write_index: torch.Tensor | None = None  # the new frame's slots [T]: one per step, not per block


class CharacterDiT(torch.nn.Module):
    """One rank of the model. `state` is a rank state (weights.shard of a quantized state)."""

    def __init__(self, cfg: EngineConfig, rank: RankShape, state: dict[str, torch.Tensor],
                 all_reduce: AllReduce = identity, adaln_tables=None, device="cpu",
                 attention_tiles=None, fused_gemm_allreduce=None, gemm_plan=None):
        """`fused_gemm_allreduce`: the fused output projection + all-reduce of this rank's
        TP group (plugins/gemm_allreduce.py), given by a loader that has the group; without
        it the GEMM is followed by `all_reduce`. `gemm_plan`: the engine's per-shape GEMM
        choice for each block linear ("w_in", "w_out") at M = tokens per frame."""
        super().__init__()
        from .plugins import act_quant, attention, fp8_gemm, gemm_residual, pre_attention, \
            quack_gemm

        spec = self.spec = cfg.model
        self.cfg, self.rank = cfg, rank
        self.dtype = getattr(torch, cfg.numerics.dtype)
        self.all_reduce = all_reduce
        self.rope = RopeTables(spec).to(device)
        self.A = rank.attn_width(spec)
        self.w = {}
        for name, t in state.items():
            keep = t if t.dtype == fp8.FP8 or name.endswith(".scale") else t.to(self.dtype)
            self.w[name] = keep.to(device)
            self.register_buffer(name.replace(".", "_"), self.w[name], persistent=False)
        sw = cfg.switches
        if sw.baked_adaln:
            table, final = adaln_tables if adaln_tables is not None else bake_adaln(cfg, state)
            self.register_buffer("adaln_table", table.to(device, self.dtype), persistent=False)
            self.register_buffer("final_table", final.to(device, self.dtype), persistent=False)
        self.register_buffer("sigmas", torch.tensor(cfg.schedule.sigmas, device=device),
                             persistent=False)
        self.pre_attention = pre_attention.select() if sw.fused_pre_attention else None
        # the fused exchange comes from a loader with a GPU TP group; otherwise the GEMM
        # (per the plan) is followed by the all-reduce, plugins/gemm_allreduce.reference
        self.gemm_allreduce = fused_gemm_allreduce if sw.fused_gemm_allreduce else None
        self.act = act_quant.select() if sw.fused_act_quant else act_quant.plain()
        # SwiGLU in the input projection's epilogue (its gate and up rows as pairs), the
        # attention kernel giving its rows' maxima
        self.gemm_swiglu = None
        if sw.gemm_swiglu and cfg.numerics.fp8_gemm:
            self.gemm_swiglu = quack_gemm.select_swiglu(device, (gemm_plan or {}).get("w_in"))
            self.pair_gate_up_rows(quack_gemm.interleave_gate_up)
        select_attention = attention.select_amax if self.gemm_swiglu is not None \
            else attention.select
        self.fp8_attention = select_attention(spec.head_dim, attention_tiles) \
            if sw.fp8_attention_kernel and sw.fp8_kv else None
        self.planned_gemm = {kind: fp8_gemm.op(c) for kind, c in (gemm_plan or {}).items()
                             if kind in cfg.numerics.LINEARS}
        # the residual add in the output projection's epilogue: where the GEMMs take FP8
        # activations, the gate is a baked constant per (block, pass) and the planned GEMM
        # has such an epilogue (cuBLASLt, QuACK); scales [blocks, passes, N] fp32
        self.gemm_residual = None
        if sw.gemm_residual and cfg.numerics.fp8_gemm and sw.baked_adaln:
            self.gemm_residual = gemm_residual.select(device, (gemm_plan or {}).get("w_out"))
        if self.gemm_residual is not None:
            gates = self.adaln_table[:, :, 2].float()  # [passes, blocks, d], rounded as baked
            self.register_buffer("gated_scale", torch.stack([
                self.w[f"blocks.{b}.w_out.scale"].float()[None, :] * gates[:, b]
                for b in range(spec.n_blocks)]), persistent=False)
        self.annotate = False  # label regions for torch.profiler (benchmarks set it)

    def pair_gate_up_rows(self, interleave):
        """w_in's gate and up rows (and their scales), past the 3A q/k/v rows, as
        `interleave` pairs them, one block at a time (new tensors: the state given stays as
        it was)."""
        for b in range(self.spec.n_blocks):
            for part in ("q", "scale"):
                name = f"blocks.{b}.w_in.{part}"
                w, paired, qkv = self.w[name], torch.empty_like(self.w[name]), 3 * self.A
                paired[:qkv], paired[qkv:] = w[:qkv], interleave(w[qkv:])
                self.w[name] = paired
                self.register_buffer(name.replace(".", "_"), self.w[name], persistent=False)

    def scope(self, name: str):
        """A profiler label (paper Table 2's components) when annotating, else nothing."""
        return torch.profiler.record_function(name) if self.annotate else contextlib.nullcontext()

    # ---- pieces -------------------------------------------------------------------------
    def dense(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return (x.to(self.dtype) @ self.w[f"{name}.weight"].t()) + self.w[f"{name}.bias"]

    def fp8_linear(self, x: torch.Tensor, name: str, reduce: AllReduce | None = None):
        """A block linear: per-token FP8 activations times the FP8 weight (or, without
        numerics.fp8_gemm, the dequantized weight); `reduce` all-reduces the output."""
        if not self.cfg.numerics.fp8_gemm:
            wq, ws = self.w[f"{name}.q"], self.w[f"{name}.scale"]
            with self.scope("gemm"):
                out = x.to(self.dtype) @ fp8.dequantize(wq, ws[:, None], self.dtype).t()
            return self.reduced(out, reduce)
        with self.scope("act_quant"):
            aq, a_s = self.act.quantize_rows(x)
        return self.fp8_gemm(aq, a_s, name, reduce)

    def fp8_gemm(self, aq: torch.Tensor, a_s: torch.Tensor, name: str,
                 reduce: AllReduce | None = None) -> torch.Tensor:
        """Quantized activations [M, K] (scales [M, 1]) times the FP8 weight; `reduce` is fused
        into the GEMM where fused_gemm_allreduce is on."""
        kind = name.rsplit(".", 1)[1]
        fast = self.cfg.numerics.fast_accum_for(kind)
        wq, ws = self.w[f"{name}.q"], self.w[f"{name}.scale"]
        if reduce is not None and self.gemm_allreduce is not None:
            with self.scope("fp8_gemm"):
                return self.gemm_allreduce(aq, a_s, wq, ws, self.dtype, fast, reduce)
        gemm = fp8.scaled_mm
        if aq.shape[0] == self.spec.tokens_per_frame:  # the shape the plan was measured at
            gemm = self.planned_gemm.get(kind, gemm)
        with self.scope("fp8_gemm"):
            out = gemm(aq, a_s, wq, ws, self.dtype, fast)
        return self.reduced(out, reduce)

    def reduced(self, out: torch.Tensor, reduce: AllReduce | None) -> torch.Tensor:
        if reduce is None:
            return out
        with self.scope("all_reduce"):
            return reduce(out)

    def modulation(self, b: int, p: int, cond: StepConditioning) -> torch.Tensor:
        if self.cfg.switches.baked_adaln:
            return self.adaln_table[p, b]
        with self.scope("adaln"):
            return self.dense(F.silu(cond.c[p]), f"blocks.{b}.adaln").reshape(3, self.spec.dim)

    def final_modulation(self, p: int, cond: StepConditioning) -> torch.Tensor:
        if self.cfg.switches.baked_adaln:
            return self.final_table[p]
        return self.dense(F.silu(cond.c[p]), "final_adaln").reshape(2, self.spec.dim)

    def timestep_conditioning(self) -> torch.Tensor | None:
        """c [passes, d] for the plain AdaLN path (None when the tables are baked)."""
        if self.cfg.switches.baked_adaln:
            return None
        return conditioning_vector(self.w, self.sigmas, self.spec.time_freq_dim).to(self.dtype)

    def conditioning(self, audio_features: torch.Tensor, cache: KVCache) -> StepConditioning:
        cos, sin = cos_sin(self.rope.frame_angles(cache.temporal_index()))
        c = self.timestep_conditioning()
        key = None if self.cfg.switches.rope_at_write else cache.key_cos_sin(self.rope)
        return StepConditioning(self.dense(audio_features, "audio_proj"), cos, sin, c, key,
                                cache.frame_index())

    def qkv_mlp(self, b: int, h: torch.Tensor, mod: torch.Tensor, residual=None):
        """The pending gated residual (o, gate) of the previous block (fused_residual), norm,
        modulation and the input projection: h, then q, k, v [H, T, D] (strided views of the
        projection's output) and the MLP's part: the SwiGLU (gate, up) [T, mlp] each, or with
        gemm_swiglu (silu(gate) * up [T, mlp], its rows' |max| partials [T, P])."""
        shift, scale, _ = mod
        eps = self.spec.norm_eps
        if residual is not None and not self.fuses_residual:
            h, residual = self.add_residual(h, residual), None
        if self.cfg.numerics.fp8_gemm:
            with self.scope("act_quant"):
                if residual is None:
                    aq, a_s = self.act.norm_modulate(h, shift, scale, eps)
                else:
                    aq, a_s, h = self.act.residual_norm_modulate(h, *residual, shift, scale, eps)
            if self.gemm_swiglu is not None:
                with self.scope("fp8_gemm"):
                    y, y_mlp, y_amax = self.gemm_swiglu(
                        aq, a_s, self.w[f"blocks.{b}.w_in.q"], self.w[f"blocks.{b}.w_in.scale"],
                        self.dtype, self.cfg.numerics.fast_accum_for("w_in"), 3 * self.A)
                mlp = (y_mlp, y_amax)
            else:
                y = self.fp8_gemm(aq, a_s, f"blocks.{b}.w_in")
        else:
            xm = F.layer_norm(h, (self.spec.dim,), eps=eps) * (1 + scale) + shift
            y = self.fp8_linear(xm, f"blocks.{b}.w_in")
        T, H, D = h.shape[0], self.rank.heads, self.spec.head_dim
        if self.gemm_swiglu is not None:
            q, k, v = y.split([self.A, self.A, self.A], dim=-1)
        else:
            q, k, v, g, u = y.split([self.A, self.A, self.A, self.rank.mlp, self.rank.mlp], -1)
            mlp = (g, u)
        return (h, *(t.reshape(T, H, D).transpose(0, 1) for t in (q, k, v)), mlp)

    @property
    def fuses_residual(self) -> bool:
        """The gated residual add runs inside the next block's norm + quantization kernel (or
        its reference), where the block linears take FP8 activations."""
        return self.cfg.switches.fused_residual and self.cfg.numerics.fp8_gemm

    def add_residual(self, h, residual):
        """h + gate * o, the block's gated residual; `residual` (o, gate) or None."""
        if residual is None:
            return h
        o, gate = residual
        if self.cfg.switches.fused_act_quant:
            return torch.addcmul(h, gate, o)
        return h + gate * o

    def norm_qk(self, b: int, q, k):
        eps = self.spec.norm_eps
        return (rms_norm_heads(q, self.w[f"blocks.{b}.q_norm"], eps),
                rms_norm_heads(k, self.w[f"blocks.{b}.k_norm"], eps))

    def attend(self, q, k, v, mask) -> torch.Tensor:
        with self.scope("attention"):
            if self.cfg.numerics.fp8_attention:
                q = fp8.quant_dequant_rows(q) if self.cfg.switches.fp8_kv \
                    else fp8.quant_dequant_per_tensor(q)
            o = F.scaled_dot_product_attention(q[None], k[None], v[None],
                                               attn_mask=None if mask is None else mask[None, :])[0]
            return o.transpose(0, 1).reshape(q.shape[1], self.A)

    def attend_fp8(self, bp: int, q8: torch.Tensor, q_scale: torch.Tensor, cache: KVCache):
        """The FP8 attention kernel over cache bp as it lies; queries quantized per (head,
        token). Returns the output [T, A] and, with gemm_swiglu, its (token, head) maxima
        [T, H] (else None)."""
        with self.scope("attention"):
            out = self.fp8_attention(q8, q_scale, cache.k8[bp], cache.v8[bp], cache.scale[bp, 0],
                                     cache.scale[bp, 1], self.dtype)
        return out if self.gemm_swiglu is not None else (out, None)

    def quantize_out_input(self, attn, mlp, attn_amax=None):
        """The output projection's FP8 input [attn, silu(gate) * up] with its scales: SwiGLU
        and quantization from (gate, up), or with gemm_swiglu the concatenation quantized with
        the maxima given (attn's, when None, its own)."""
        with self.scope("act_quant"):
            if self.gemm_swiglu is not None:
                y, y_amax = mlp
                return self.act.concat_quant(attn, attn_amax, y, y_amax)
            return self.act.swiglu(attn, *mlp)

    def finish_block_residual(self, b: int, p: int, attn, mlp, h, attn_amax=None):
        """SwiGLU and the output projection with the gated residual in its epilogue: the new
        h = h + gate * o (gemm_residual). Under TP, h is added once to the sum: by rank 0
        before the all-reduce, or inside the fused exchange's reduction on every rank."""
        name = f"blocks.{b}.w_out"
        aq, a_s = self.quantize_out_input(attn, mlp, attn_amax)
        wq, ws = self.w[f"{name}.q"], self.gated_scale[b, p]
        fast = self.cfg.numerics.fast_accum_for("w_out")
        with self.scope("fp8_gemm"):
            if self.gemm_allreduce is not None:
                return self.gemm_allreduce(aq, a_s, wq, ws, self.dtype, fast, self.all_reduce, h)
            adds_h = self.all_reduce is identity or self.rank.rank == 0
            out = self.gemm_residual(aq, a_s, wq, ws, h if adds_h else None, self.dtype, fast)
        return self.reduced(out, self.all_reduce)

    def finish_block(self, b: int, attn, mlp, attn_amax=None) -> torch.Tensor:
        """SwiGLU and the output projection (all-reduced): the block's o, before its gated
        residual. `mlp` as qkv_mlp gives it."""
        name = f"blocks.{b}.w_out"
        if self.cfg.numerics.fp8_gemm:
            aq, a_s = self.quantize_out_input(attn, mlp, attn_amax)
            return self.fp8_gemm(aq, a_s, name, self.all_reduce)
        gate, up = mlp
        return self.fp8_linear(torch.cat([attn, F.silu(gate) * up], dim=-1), name,
                               self.all_reduce)

    # ---- forwards -----------------------------------------------------------------------
    def frame_block(self, b: int, p: int, h, residual, cond: StepConditioning, cache: KVCache,
                    mask, slots: int | None = None):
        """One block over the new frame: returns h and the block's gated residual (o, gate),
        which the next block adds (see qkv_mlp). `mask` [S] bool or `slots` (attend to the first
        `slots` slots) while the window fills; neither in the steady state."""
        bp = b * self.cfg.schedule.passes + p
        mod = self.modulation(b, p, cond)
        h, q, k, v, mlp = self.qkv_mlp(b, h, mod, residual)
        fp8_attention = self.fp8_attention is not None and cache.quantized and mask is None \
            and slots is None
        with self.scope("pre_attention"):
            q = self.pre_attention_write(b, bp, q, k, v, cond, cache, fp8_attention)
        o_amax = None
        if fp8_attention:
            o, o_amax = self.attend_fp8(bp, *q, cache)
        else:
            with self.scope("cache_upkeep"):
                kc, vc = cache.read(bp, cond.key_cos_sin)
                if slots is not None:
                    kc, vc = kc[:, :slots], vc[:, :slots]
            o = self.attend(q, kc, vc, mask)
        if self.gemm_residual is not None:
            return self.finish_block_residual(b, p, o, mlp, h, o_amax), None
        return h, (self.finish_block(b, o, mlp, o_amax), mod[2])

    def pre_attention_write(self, b: int, bp: int, q, k, v, cond: StepConditioning,
                            cache: KVCache, quantize_q: bool = False):
        """QK norm, RoPE, K/V quantization and the cache write; returns the queries (with
        quantize_q, as (q8, scale) per head and token for the FP8 attention kernel)."""
        if self.pre_attention is not None:
            return self.pre_attention(
                q, k, v, self.w[f"blocks.{b}.q_norm"], self.w[f"blocks.{b}.k_norm"],
                self.spec.norm_eps, cond.cos, cond.sin,
                cache.k8[bp] if cache.quantized else cache.k[bp],
                cache.v8[bp] if cache.quantized else cache.v[bp],
                cache.scale[bp, 0] if cache.quantized else None,
                cache.scale[bp, 1] if cache.quantized else None, cond.write_index,
                quantize_q=quantize_q)
        q, k = self.norm_qk(b, q, k)
        q = rotate(q, cond.cos, cond.sin)
        if self.cfg.switches.rope_at_write:
            k = rotate(k, cond.cos, cond.sin)
        cache.write(bp, k, v)
        if quantize_q:
            q8, qs = self.act.quantize_rows(q.reshape(-1, q.shape[-1]))
            return q8.view(q.shape), qs.view(*q.shape[:2], 1)
        return q

    def forward_frame(self, x: torch.Tensor, p: int, cond: StepConditioning, cache: KVCache,
                      mask=None, slots: int | None = None) -> torch.Tensor:
        """Velocity for the new latent's tokens x [video_tokens, patch_dim] at pass p; writes
        the frame's K/V into caches (block, p)."""
        h, residual = torch.cat([self.dense(x, "patch_embed"), cond.audio]), None
        for b in range(self.spec.n_blocks):
            h, residual = self.frame_block(b, p, h, residual, cond, cache, mask, slots)
        h = self.add_residual(h, residual)
        shift, scale = self.final_modulation(p, cond)
        hv = h[: self.spec.video_tokens]
        hv = F.layer_norm(hv, (self.spec.dim,), eps=self.spec.norm_eps) * (1 + scale) + shift
        return self.dense(hv, "final").float()

    def forward_global(self, ref_tokens: torch.Tensor, prompt: torch.Tensor, cache: KVCache):
        """Session start: for every pass, run the global tokens (reference image, prompt)
        through the blocks, attending among themselves, and write their K/V into the global
        slots of caches (block, pass)."""
        cos, sin = cos_sin(self.rope.global_angles())
        h0 = torch.cat([self.dense(ref_tokens, "patch_embed"), self.dense(prompt, "text_proj")])
        cond = StepConditioning(None, cos, sin, self.timestep_conditioning(), None)
        for p in range(self.cfg.schedule.passes):
            h = h0
            for b in range(self.spec.n_blocks):
                mod = self.modulation(b, p, cond)
                h, q, k, v, mlp = self.qkv_mlp(b, h, mod)
                q, k = self.norm_qk(b, q, k)
                q, kr = rotate(q, cos, sin), rotate(k, cos, sin)
                cache.write_global(b * self.cfg.schedule.passes + p,
                                   kr if self.cfg.switches.rope_at_write else k, v)
                o = F.scaled_dot_product_attention(q[None], kr[None], v[None])[0]
                o = self.finish_block(b, o.transpose(0, 1).reshape(h.shape[0], self.A), mlp)
                h = self.add_residual(h, (o, mod[2]))
