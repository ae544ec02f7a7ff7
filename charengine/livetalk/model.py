"""The LiveTalk DiT on one device: its plain path is the upstream model's math in its order
and precision (bf16 activations, fp32 norms, the q/k RMS norm across all heads rounded
before its weight, complex float64 RoPE), each engine technique behind its switch.

A forward runs one pass over a chunk of F latent frames (F x T tokens): patch embedding of
the noisy latent with the reference latent and its mask, additive audio before blocks
2 .. n_blocks // 2, then per block: gated self-attention over the block's cache (the chunk's
K/V written first), cross-attention to the prompt, gated GELU FFN; the head's modulated
norm and projection. The AdaLN modulation of pass p comes from its timestep: from the baked
tables (baked_adaln) or the time MLPs per call. Every op runs through the block's ops
(ops.py), chosen once at construction: the forward below is straight-line code that reads no
switch. A forward takes a batch of sessions' chunks (one or more): their tokens stacked
through every linear, norm and modulation, each session's pre-attention, attention and
cross-attention over its own cache; a batch of one is the single session's forward."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import fp8
from ..ops import gelu_tanh, modulate
from ..ops import rms_norm_width as rms_norm
from ..plugins import gemm as gemm_mod
from .cache import ChunkCache
from .ops import BlockOps, Heads, add_pending, parts, stacked
from .spec import LiveTalkSpec


def sinusoid(timestep: float, width: int, dtype) -> torch.Tensor:
    """The timestep's [1, width] embedding: cos then sin, base 10000, in float64."""
    half = width // 2
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64).div(half))
    s = torch.tensor([timestep], dtype=torch.float64)[:, None] * freqs[None]
    return torch.cat([torch.cos(s), torch.sin(s)], dim=1).to(dtype)


def audio_block_index(spec: LiveTalkSpec) -> dict[int, int]:
    return {b: j for j, b in enumerate(spec.audio_blocks)}


class LiveTalkDiT:
    def __init__(self, cfg, state: dict, device, tables: dict | None = None,
                 gemm_plan: dict | None = None):
        self.cfg, self.spec = cfg, cfg.model
        self.device = torch.device(device)
        self.dtype = getattr(torch, cfg.numerics.dtype)
        self.w = {k: v.to(self.device) if v.dtype == fp8.FP8 or k.endswith("weight_scale")
                  else v.to(self.device, self.dtype) for k, v in state.items()}
        if cfg.switches.fused_qkv:
            self.w = fuse_qkv(self.w, self.spec.n_blocks)
        self.ops = BlockOps(cfg, self.w, self.device, self.dtype, self._gemms(gemm_plan or {}),
                            self.cross_kv)
        self.linear, self.heads = self.ops.linear, Heads(self.spec)
        self.audio_at = [audio_block_index(self.spec).get(b) for b in range(self.spec.n_blocks)]
        # the pass's modulation, chosen once: the baked tables or the time MLPs per call
        if cfg.switches.baked_adaln:
            tables = tables if tables is not None else self.bake_tables()
            self.adaln = tables["adaln_table"].to(self.device, self.dtype)
            self.head_mod = tables["head_table"].to(self.device, self.dtype)
            self.modulations = self.baked_modulations
        else:
            self.modulations = self.computed_modulations
        self.rope = self.ops.rope
        self.kv_once = cfg.switches.text_kv_once
        # the schedule's sigmas as the fp32 values its tensors hold, rounded once here (a
        # step reads them as constants: it makes no tensor on the host)
        self.sigmas = [float(torch.tensor(s, dtype=torch.float32)) for s in cfg.schedule.sigmas]

    def _gemms(self, plan: dict) -> dict:
        """Each FP8 linear kind's GEMM: the builder's choice on a GPU, else _scaled_mm (or
        its exact emulation)."""
        if self.device.type != "cuda":
            return {}
        return {kind: gemm_mod.select(choice, "plain", self.device)
                for kind, choice in plan.items()}

    # ---- the timestep's modulation -------------------------------------------------------
    def time_embedding(self, timestep: float) -> torch.Tensor:
        e = sinusoid(timestep, self.spec.freq_dim, self.dtype).to(self.device)
        return self.linear("time_embedding.2", F.silu(self.linear("time_embedding.0", e)))

    def baked_modulations(self, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pass p's ([blocks, 6, dim], [2, dim]) modulation from the baked tables (p ==
        passes: the commit pass)."""
        return self.adaln[p], self.head_mod[p]

    def computed_modulations(self, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pass p's modulation through the time MLPs."""
        return self._modulations(self.pass_timestep(p))

    def pass_timestep(self, p: int) -> float:
        sched = self.cfg.schedule
        return sched.timesteps[p] if p < sched.passes else 0.0

    def _modulations(self, timestep: float):
        spec = self.spec
        t = self.time_embedding(timestep)
        t_mod = self.linear("time_projection.1", F.silu(t)).unflatten(1, (6, spec.dim))
        blocks = torch.stack([self.w[f"blocks.{b}.modulation"][0] + t_mod[0]
                              for b in range(spec.n_blocks)])
        return blocks, self.w["head.modulation"][0] + t

    def bake_tables(self) -> dict[str, torch.Tensor]:
        """The modulation of every pass and the commit pass, as the plain path computes it."""
        mods = [self._modulations(self.pass_timestep(p))
                for p in range(self.cfg.schedule.passes + 1)]
        return {"adaln_table": torch.stack([m[0] for m in mods]),
                "head_table": torch.stack([m[1] for m in mods])}

    # ---- once per session ----------------------------------------------------------------
    def start(self, ref_latent: torch.Tensor, prompt: torch.Tensor, cache: ChunkCache) -> None:
        """The reference latent [C, h, w] (normalized) and the prompt's features
        [prompt_tokens, text_dim]: the session's conditioning inputs, text context and, with
        text_kv_once, every block's cross-attention K/V, all kept in `cache` (the session's
        state; the model holds none)."""
        spec, dt = self.spec, self.dtype
        ref = ref_latent.to(self.device, dt)
        frames = ref[:, None].expand(-1, spec.chunk_frames, -1, -1)
        mask = torch.ones(1, spec.chunk_frames, spec.latent_h, spec.latent_w, device=self.device,
                          dtype=dt)
        mask_first = mask.clone()
        mask_first[:, 0] = 0
        x = prompt.to(self.device, dt)
        context = self.linear("text_embedding.2", gelu_tanh(self.linear("text_embedding.0", x)))
        cache.keep("ref", ref)
        cache.keep("y_next", torch.cat([frames, mask]))
        cache.keep("y_first", torch.cat([frames, mask_first]))
        cache.keep("context", context)
        if self.kv_once:
            kv = [self.cross_kv(b, cache.context) for b in range(spec.n_blocks)]
            k, v = torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])
            keep = cache.keep_text_fp8 if self.ops.fp8_cross else cache.keep_text
            keep(k, v)

    def cross_kv(self, b: int, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block b's cross-attention k, v [heads, prompt_tokens, head_dim] from the session's
        text context."""
        spec, pre = self.spec, f"blocks.{b}.cross_attn"
        k = rms_norm(self.linear(f"{pre}.k", context), self.w[f"{pre}.norm_k.weight"],
                     spec.norm_eps)
        v = self.linear(f"{pre}.v", context)
        return self.heads(k).transpose(0, 1), self.heads(v).transpose(0, 1)

    # ---- per chunk (of each session in a batch) ---------------------------------------
    def audio_conditioning(self, feats) -> torch.Tensor:
        """Each session's chunk audio feature rows [audio_rows, audio_dim] -> [audio blocks,
        B * F, dim], the sessions' frames one after another."""
        spec = self.spec
        x = stacked([f.to(self.device, self.dtype).reshape(spec.chunk_frames, -1)
                     for f in feats])
        a = self.linear("audio_proj.proj", x)
        a = F.layer_norm(a, (spec.audio_hidden,), self.w["audio_proj.norm_out.weight"],
                         self.w["audio_proj.norm_out.bias"])
        return torch.stack([self.linear(f"audio_cond_projs.{j}", a)
                            for j in range(len(spec.audio_blocks))])

    def forward(self, xs, ys, p: int, caches: list[ChunkCache], audio: torch.Tensor, ropes,
                n_slots: list[int], commit: bool = False):
        """One pass over the chunk latents xs[i] [C, F, h, w] of a batch of sessions (one or
        more, each with its conditioning ys[i], cache, rotation and slots): their tokens
        stacked for every linear, norm and modulation, each session's attention over its
        own cache, where it writes its K/V at its write slots and attends over its first
        n_slots[i]. Returns each session's flow prediction [C, F, h, w], or None for a
        commit pass that stops after the last block's K/V write (skip_commit_tail)."""
        ops, w, n = self.ops, self.w, len(caches)
        # [B * F * T, dim], tokens ordered (session, frame, row, column)
        h = stacked([ops.embed(torch.cat([x, y])) for x, y in zip(xs, ys)])
        mods, head_mod = self.modulations(p)
        phase = ops.phase(caches[0])
        if any(ops.phase(c) is not phase for c in caches):
            raise ValueError("a batch's caches are in different phases")
        stop = ops.commit_stop if commit else None
        residual = None  # a pending FFN residual (output, gate) the next input op adds
        for b, j in enumerate(self.audio_at):
            shift1, scale1, gate1, shift2, scale2, gate2 = mods[b]
            add = None if j is None else audio[j]
            a, h = ops.block_input(h, residual, add, shift1, scale1)
            pre = f"blocks.{b}.self_attn"
            qn, kn = w[f"{pre}.norm_q.weight"], w[f"{pre}.norm_k.weight"]
            q, k, v = (parts(t, n) for t in ops.qkv(b, a))
            qs = [phase.pre_attention(b, q[i], k[i], v[i], qn, kn, ropes[i], caches[i])
                  for i in range(n)]
            if b == stop:
                return None
            o = stacked([phase.attention(b, qs[i], caches[i], n_slots[i]) for i in range(n)])
            o = self.linear(f"{pre}.o", o, "attn")
            a, h = ops.attention_residual(b, h, o, gate1)
            a, h = ops.ffn_input(h, ops.cross_attention(b, a, caches), shift2, scale2)
            h, residual = ops.ffn_residual(h, ops.ffn(b, a), gate2)
        h = add_pending(h, residual)
        shift, scale = head_mod
        out = self.linear("head.head", modulate(h, shift, scale, self.spec.norm_eps))
        return [self.unpatchify(o, x.shape[1]) for o, x in zip(parts(out, n), xs)]

    def unpatchify(self, out: torch.Tensor, frames: int) -> torch.Tensor:
        """[F * T, (py, px, C)] -> [C, F, h, w]."""
        spec, p = self.spec, self.spec.patch
        x = out.view(frames, spec.grid_h, spec.grid_w, p, p, spec.latent_channels)
        return x.permute(5, 0, 1, 3, 2, 4).reshape(spec.latent_channels, frames, spec.latent_h,
                                                    spec.latent_w)


def fuse_qkv(w: dict, n_blocks: int) -> dict:
    """The weights with every block's self-attention q, k, v (weights, biases and FP8
    scales) concatenated along their outputs as `self_attn.qkv`: one GEMM computes the
    three (a weight's rows, and its per-output-channel scales, are independent)."""
    w = dict(w)
    for b in range(n_blocks):
        pre = f"blocks.{b}.self_attn"
        for part in ("weight", "bias", "weight_scale"):
            names = [f"{pre}.{n}.{part}" for n in "qkv"]
            if names[0] in w:
                w[f"{pre}.qkv.{part}"] = fp8.cat([w.pop(n) for n in names])
    return w
