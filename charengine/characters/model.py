"""The characters DiT on one TP rank: what a step computes. Parallel blocks with AdaLN, QK
RMS-norm, 3-D RoPE and SwiGLU; the forward over a new frame (writing and reading the KV
caches) and over the session's global tokens. Every piece runs through the block's ops
(ops.py), chosen once at construction, so the forwards below are straight-line code.

Block: xm = LN(h) * (1 + scale) + shift; [q k v gate up] = W_in xm (FP8, column-parallel;
with gemm_swiglu, silu(gate) * up in the GEMM's epilogue, W_in's gate and up rows stored as
pairs); attention over the cache; o = W_out [attn, silu(gate) * up] (FP8, row-parallel),
all-reduced; h += gate_ada * o (with gemm_residual, in the output projection's epilogue, the
gate folded into its weight scale; else with fused_residual, inside the next block's first
kernel). Shift, scale and gate come from the pass's timestep alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import fp8
from ..config import EngineConfig
from ..mapping import identity
from ..ops import modulate, rms_norm_heads
from ..rope import cos_sin, rotate
from .cache import KVCache
from .ops import BlockOps
from .rope import RopeTables
from .spec import RankShape


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


class BakedModulation:
    """AdaLN from the tables baked for the fixed schedule (baked_adaln)."""

    def __init__(self, table: torch.Tensor, final: torch.Tensor):
        self.table, self.final_table = table, final

    def conditioning(self):
        return None

    def block(self, b: int, p: int, cond) -> torch.Tensor:
        return self.table[p, b]

    def final(self, p: int, cond) -> torch.Tensor:
        return self.final_table[p]


class ComputedModulation:
    """AdaLN from the timestep MLP at every call (the paper's baseline)."""

    def __init__(self, model: "CharacterDiT"):
        self.model = model

    def conditioning(self) -> torch.Tensor:
        """c [passes, d] of the schedule's sigmas."""
        m = self.model
        return conditioning_vector(m.w, m.sigmas, m.spec.time_freq_dim).to(m.dtype)

    def block(self, b: int, p: int, cond) -> torch.Tensor:
        with self.model.scope("adaln"):
            return self.model.dense(F.silu(cond.c[p]), f"blocks.{b}.adaln").reshape(
                3, self.model.spec.dim)

    def final(self, p: int, cond) -> torch.Tensor:
        return self.model.dense(F.silu(cond.c[p]), "final_adaln").reshape(2, self.model.spec.dim)


class CharacterDiT(torch.nn.Module):
    """One rank of the model. `state` is a rank state (its engine weights)."""

    def __init__(self, cfg: EngineConfig, rank: RankShape, state: dict[str, torch.Tensor],
                 all_reduce=identity, adaln_tables=None, device="cpu", attention_tiles=None,
                 fused_gemm_allreduce=None, gemm_plan=None):
        """`fused_gemm_allreduce`: the fused output projection + all-reduce of this rank's
        TP group (plugins/gemm_allreduce.py), given by a loader that has the group; without
        it the GEMM is followed by `all_reduce`. `gemm_plan`: the engine's per-shape GEMM
        choice for each block linear ("w_in", "w_out") at M = tokens per frame. Built by
        charengine/characters/rank.py's rank_session."""
        super().__init__()
        spec = self.spec = cfg.model
        self.cfg, self.rank = cfg, rank
        self.dtype = getattr(torch, cfg.numerics.dtype)
        self.rope = RopeTables(spec).to(device)
        self.A = rank.attn_width(spec)
        self.w = {}
        for name, t in state.items():
            keep = t if t.dtype == fp8.FP8 or name.endswith(".scale") else t.to(self.dtype)
            self.w[name] = keep.to(device)
            self.register_buffer(name.replace(".", "_"), self.w[name], persistent=False)
        self.register_buffer("sigmas", torch.tensor(cfg.schedule.sigmas, device=device),
                             persistent=False)
        self.ops = BlockOps(cfg, rank, device, gemm_plan, fused_gemm_allreduce, all_reduce,
                            attention_tiles)
        if cfg.switches.baked_adaln:
            table, final = adaln_tables if adaln_tables is not None else bake_adaln(cfg, state)
            self.register_buffer("adaln_table", table.to(device, self.dtype), persistent=False)
            self.register_buffer("final_table", final.to(device, self.dtype), persistent=False)
            self.modulation = BakedModulation(self.adaln_table, self.final_table)
        else:
            self.modulation = ComputedModulation(self)
        if self.ops.pairs_gate_up:
            from ..plugins.quack_gemm import interleave_gate_up

            self.pair_gate_up_rows(interleave_gate_up)
        # the output projection's scales with each (block, pass)'s gate folded in, [blocks,
        # passes, N] fp32 (gemm_residual), else one per block
        if self.ops.folds_gate:
            gates = self.adaln_table[:, :, 2].float()  # [passes, blocks, d], rounded as baked
            self.register_buffer("gated_scale", torch.stack([
                self.w[f"blocks.{b}.w_out.scale"].float()[None, :] * gates[:, b]
                for b in range(spec.n_blocks)]), persistent=False)
        else:
            self.gated_scale = None

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

    @property
    def annotate(self) -> bool:
        """Label regions for torch.profiler (benchmarks set it)."""
        return self.ops.labels.on

    @annotate.setter
    def annotate(self, on: bool) -> None:
        self.ops.labels.on = on

    def scope(self, name: str):
        """A profiler label (paper Table 2's components) when annotating, else nothing."""
        return self.ops.labels(name)

    def dense(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return (x.to(self.dtype) @ self.w[f"{name}.weight"].t()) + self.w[f"{name}.bias"]

    def linear(self, b: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w[f"blocks.{b}.{kind}.q"], self.w[f"blocks.{b}.{kind}.scale"]

    def conditioning(self, audio_features: torch.Tensor, cache: KVCache) -> StepConditioning:
        cos, sin = cos_sin(self.rope.frame_angles(cache.temporal_index()))
        key = None if self.cfg.switches.rope_at_write else cache.key_cos_sin(self.rope)
        return StepConditioning(self.dense(audio_features, "audio_proj"), cos, sin,
                                self.modulation.conditioning(), key, cache.frame_index())

    # ---- forwards -----------------------------------------------------------------------
    def frame_block(self, b: int, p: int, h, residual, cond: StepConditioning, cache: KVCache,
                    attend):
        """One block over the new frame: returns h and the block's pending gated residual
        (o, gate), which the next block adds (None where the output projection added it)."""
        ops, w = self.ops, self.w
        bp = b * self.cfg.schedule.passes + p
        shift, scale, gate = self.modulation.block(b, p, cond)
        x, h = ops.norm_in(h, residual, shift, scale)
        q, k, v, mlp = ops.in_proj(x, *self.linear(b, "w_in"))
        with self.scope("pre_attention"):
            q = ops.pre_attention(q, k, v, w[f"blocks.{b}.q_norm"], w[f"blocks.{b}.k_norm"],
                                  cond, cache, bp, attend.kernel)
        o, o_amax = ops.attention(q, cache, bp, cond, attend)
        w_q, w_s = self.linear(b, "w_out")
        gated = self.gated_scale[b, p] if self.gated_scale is not None else None
        return ops.out_proj.finish(o, mlp, h, gate, w_q, w_s, gated, o_amax)

    def forward_frame(self, x: torch.Tensor, p: int, cond: StepConditioning, cache: KVCache,
                      mask=None, slots: int | None = None) -> torch.Tensor:
        """Velocity for the new latent's tokens x [video_tokens, patch_dim] at pass p; writes
        the frame's K/V into caches (block, p). `mask` [S] bool or `slots` (attend to the first
        `slots` slots) while the window fills; neither in the steady state."""
        attend = self.ops.attention.phase(cache, mask, slots)
        h, residual = torch.cat([self.dense(x, "patch_embed"), cond.audio]), None
        for b in range(self.spec.n_blocks):
            h, residual = self.frame_block(b, p, h, residual, cond, cache, attend)
        h = self.ops.add_residual(h, residual)
        shift, scale = self.modulation.final(p, cond)
        hv = modulate(h[: self.spec.video_tokens], shift, scale, self.spec.norm_eps)
        return self.dense(hv, "final").float()

    def forward_global(self, ref_tokens: torch.Tensor, prompt: torch.Tensor, cache: KVCache):
        """Session start: for every pass, run the global tokens (reference image, prompt)
        through the blocks, attending among themselves, and write their K/V into the global
        slots of caches (block, pass): keys after RoPE where RoPE is applied at write."""
        ops, w, eps = self.ops, self.w, self.spec.norm_eps
        cos, sin = cos_sin(self.rope.global_angles())
        h0 = torch.cat([self.dense(ref_tokens, "patch_embed"), self.dense(prompt, "text_proj")])
        cond = StepConditioning(None, cos, sin, self.modulation.conditioning(), None)
        at_write = self.cfg.switches.rope_at_write
        for p in range(self.cfg.schedule.passes):
            h = h0
            for b in range(self.spec.n_blocks):
                shift, scale, gate = self.modulation.block(b, p, cond)
                x, h = ops.norm_in(h, None, shift, scale)
                q, k, v, mlp = ops.in_proj(x, *self.linear(b, "w_in"))
                q = rms_norm_heads(q, w[f"blocks.{b}.q_norm"], eps)
                k = rms_norm_heads(k, w[f"blocks.{b}.k_norm"], eps)
                q, kr = rotate(q, cos, sin), rotate(k, cos, sin)
                cache.write_global(b * self.cfg.schedule.passes + p, kr if at_write else k, v)
                o = F.scaled_dot_product_attention(q[None], kr[None], v[None])[0]
                o = ops.plain_out.project(o.transpose(0, 1).reshape(h.shape[0], self.A), mlp,
                                          *self.linear(b, "w_out"))
                h = ops.add_residual(h, (o, gate))
