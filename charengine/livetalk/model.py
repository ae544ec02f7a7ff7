"""The LiveTalk DiT on one device: its plain path is the upstream model's math in its order
and precision (bf16 activations, fp32 norms, the q/k RMS norm across all heads rounded
before its weight, complex float64 RoPE), each engine technique behind its switch.

A forward runs one pass over a chunk of F latent frames (F x T tokens): patch embedding of
the noisy latent with the reference latent and its mask, additive audio before blocks
2 .. n_blocks // 2, then per block: gated self-attention over the block's cache (the chunk's
K/V written first), cross-attention to the prompt, gated GELU FFN; the head's modulated
norm and projection. The AdaLN modulation of pass p comes from its timestep: from the baked
tables (baked_adaln) or the time MLPs per call."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .. import fp8
from ..ops import gated_residual, gated_residual_once, gelu_tanh, modulate
from ..ops import rms_norm_width as rms_norm
from ..plugins import act_quant, attention, pre_attention_width, rms_norm as rms_norm_op
from ..plugins import gemm as gemm_mod
from .cache import ChunkCache
from .rope import ComplexRotation, TableRotation
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
        sw = cfg.switches
        if sw.fused_qkv:
            self.w = fuse_qkv(self.w, self.spec.n_blocks)
        self.fast_accum = cfg.numerics.fast_accum and self.device.type == "cuda"
        self.gemms = self._gemms(gemm_plan or {})
        self.audio_at = audio_block_index(self.spec)
        # the kernels, chosen once: fused quantization (kernels on CUDA tensors, their
        # references on CPU ones) or the plain per-linear quantization
        self.fp8_linears = any(v.dtype == fp8.FP8 for v in self.w.values())
        self.act = act_quant.select() if sw.fused_act_quant else act_quant.plain()
        tiles = attention.SPLIT_TILES if sw.split_attention else attention.AttentionTiles()
        self.attend8 = attention.select(
            self.spec.head_dim,
            dataclasses.replace(tiles, pipelined=True) if sw.pipelined_attention else tiles)
        self.pre_attention = pre_attention_width.op if sw.fused_pre_attention else None
        self.pre_attention_wide = pre_attention_width.op if sw.fused_wide_pre_attention \
            else None
        self.q_norm = rms_norm_op.select() if sw.fused_q_norm else rms_norm
        # the cross-attention in FP8 (the prompt's K/V quantized at session start)
        self.fp8_cross = sw.fp8_cross_attention and sw.text_kv_once and \
            cfg.numerics.fp8_attention
        self.q_norm_quant = rms_norm_op.select_heads_quant()
        self.attend8_cross = attention.select(self.spec.head_dim, attention.CROSS_TILES)
        # the fused epilogues that hand their FP8 quantization to the next linear
        self.fused_residual = self.fused_input and sw.fused_residual
        self.fused_gelu = self.fp8_linears and sw.fused_gelu_quant
        self.ones = torch.ones(self.spec.dim, device=self.device, dtype=self.dtype)
        if sw.baked_adaln:
            tables = tables if tables is not None else self.bake_tables()
            self.adaln = tables["adaln_table"].to(self.device, self.dtype)
            self.head_mod = tables["head_table"].to(self.device, self.dtype)
        self.ref = self.y_first = self.y_next = self.context = None

    # ---- linears -------------------------------------------------------------------------
    def _gemms(self, plan: dict) -> dict:
        """Each FP8 linear kind's GEMM: the builder's choice on a GPU, else _scaled_mm (or
        its exact emulation)."""
        if self.device.type != "cuda":
            return {}
        return {kind: gemm_mod.select(choice, "plain", self.device)
                for kind, choice in plan.items()}

    def linear(self, name: str, x, kind: str | None = None) -> torch.Tensor:
        """x: activations, or (for FP8 weights) their per-token quantization (q, scale),
        made once by the caller for the linears that share it."""
        w, b = self.w[f"{name}.weight"], self.w[f"{name}.bias"]
        if w.dtype != fp8.FP8:
            return F.linear(x, w, b)
        aq, a_s = x if isinstance(x, tuple) else \
            self.act.quantize_rows(x.reshape(-1, x.shape[-1]))
        gemm = self.gemms.get(kind, fp8.scaled_mm) if aq.shape[0] == self.spec.chunk_tokens \
            else fp8.scaled_mm
        ws = self.w[f"{name}.weight_scale"]
        if self.cfg.switches.gemm_bias and gemm_mod.takes_bias(gemm):
            return gemm(aq, a_s, w, ws, self.dtype, self.fast_accum, bias=b)
        return gemm(aq, a_s, w, ws, self.dtype, self.fast_accum) + b

    # ---- the timestep's modulation -------------------------------------------------------
    def time_embedding(self, timestep: float) -> torch.Tensor:
        e = sinusoid(timestep, self.spec.freq_dim, self.dtype).to(self.device)
        return self.linear("time_embedding.2", F.silu(self.linear("time_embedding.0", e)))

    def modulations(self, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pass p's ([blocks, 6, dim], [2, dim]) modulation (p == passes: the commit pass)."""
        if self.cfg.switches.baked_adaln:
            return self.adaln[p], self.head_mod[p]
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
        [prompt_tokens, text_dim]: the conditioning inputs, the text context and, with
        text_kv_once, every block's cross-attention K/V."""
        spec, dt = self.spec, self.dtype
        ref = ref_latent.to(self.device, dt)
        frames = ref[:, None].expand(-1, spec.chunk_frames, -1, -1)
        mask = torch.ones(1, spec.chunk_frames, spec.latent_h, spec.latent_w, device=self.device,
                          dtype=dt)
        mask_first = mask.clone()
        mask_first[:, 0] = 0
        x = prompt.to(self.device, dt)
        context = self.linear("text_embedding.2", gelu_tanh(self.linear("text_embedding.0", x)))
        # written into the same tensors every session: captured graphs read these buffers
        self._keep("ref", ref)
        self._keep("y_next", torch.cat([frames, mask]))
        self._keep("y_first", torch.cat([frames, mask_first]))
        self._keep("context", context)
        if self.cfg.switches.text_kv_once:
            kv = [self.cross_kv(b) for b in range(spec.n_blocks)]
            k, v = torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])
            if self.fp8_cross:
                cache.keep_text_fp8(k, v)
            else:
                cache.keep_text(k, v)

    def _keep(self, name: str, value: torch.Tensor) -> None:
        """Set buffer `name` to value: in place once it exists."""
        if getattr(self, name) is None:
            setattr(self, name, value.contiguous())
        else:
            getattr(self, name).copy_(value)

    def cross_kv(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block b's cross-attention k, v [heads, prompt_tokens, head_dim]."""
        spec, pre = self.spec, f"blocks.{b}.cross_attn"
        k = rms_norm(self.linear(f"{pre}.k", self.context), self.w[f"{pre}.norm_k.weight"],
                     spec.norm_eps)
        v = self.linear(f"{pre}.v", self.context)
        return self.heads(k).transpose(0, 1), self.heads(v).transpose(0, 1)

    # ---- per chunk -----------------------------------------------------------------------
    def audio_conditioning(self, feats: torch.Tensor) -> torch.Tensor:
        """Chunk audio feature rows [audio_rows, audio_dim] -> [audio blocks, F, dim]."""
        spec = self.spec
        x = feats.to(self.device, self.dtype).reshape(spec.chunk_frames, -1)
        a = self.linear("audio_proj.proj", x)
        a = F.layer_norm(a, (spec.audio_hidden,), self.w["audio_proj.norm_out.weight"],
                         self.w["audio_proj.norm_out.bias"])
        return torch.stack([self.linear(f"audio_cond_projs.{j}", a)
                            for j in range(len(spec.audio_blocks))])

    def rope(self, cache: ChunkCache):
        """The chunk's rotation from the cache's positions: fp32 tables or complex128."""
        if self.cfg.switches.rope_tables:
            return TableRotation(*cache.rope.tables(cache.positions))
        return ComplexRotation(cache.rope.phasors(cache.positions))

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.spec.n_heads, self.spec.head_dim))

    def forward(self, x: torch.Tensor, y: torch.Tensor, p: int, cache: ChunkCache,
                audio: torch.Tensor, rope, n_slots: int, commit: bool = False):
        """One pass over the chunk latent x [C, F, h, w] with its conditioning y; writes
        every block's K/V at the cache's write slots and attends over its first n_slots.
        Returns the flow prediction [C, F, h, w], or None for a commit pass that skips the
        unused tail (skip_commit_tail)."""
        spec, w = self.spec, self.w
        h = self.embed(torch.cat([x, y]))  # [F * T, dim], tokens ordered (frame, row, column)
        mods, head_mod = self.modulations(p)
        T, eps, last = spec.frame_tokens, spec.norm_eps, spec.n_blocks - 1
        pending = None  # with fused_residual: the FFN residual (output, gate) not yet added
        for b in range(spec.n_blocks):
            add = audio[self.audio_at[b]] if b in self.audio_at else None
            shift1, scale1, gate1, shift2, scale2, gate2 = mods[b]
            if pending is not None:  # the residual and the audio inside the AdaLN kernel
                a, h = self.residual_input(h, *pending, add, shift1, scale1)
            else:
                if add is not None:
                    h = add.repeat_interleave(T, dim=0) + h
                a = self.norm_input(h, shift1, scale1)
            pre = f"blocks.{b}.self_attn"
            q, k, v = self.qkv(b, a)
            qn, kn = w[f"{pre}.norm_q.weight"], w[f"{pre}.norm_k.weight"]
            if self.fused_pre(cache):  # the FP8 queries; K/V written
                q = self.pre_attention(self.heads(q), self.heads(k), self.heads(v), qn, kn,
                                       eps, rope.cos, rope.sin, *cache.stores_fp8(b),
                                       cache.write_index)
            elif self.fused_wide_pre(cache):  # the queries [heads, T, head_dim]; K/V written
                q, _ = self.pre_attention_wide(self.heads(q), self.heads(k), self.heads(v), qn,
                                               kn, eps, rope.cos, rope.sin, *cache.stores(b),
                                               None, None, cache.write_index)
            else:
                q = rope(self.heads(rms_norm(q, qn, eps))).transpose(0, 1)
                cache.write(b, rope(self.heads(rms_norm(k, kn, eps))), self.heads(v))
            if commit and b == last and self.cfg.switches.skip_commit_tail:
                return None
            o = self.linear(f"{pre}.o", self.self_attention(b, q, cache, n_slots), "attn")
            n3w, n3b = w[f"blocks.{b}.norm3.weight"], w[f"blocks.{b}.norm3.bias"]
            if self.fused_residual:  # the residual inside the cross-attention's norm kernel
                aq, a_s, h = self.act.residual_layer_norm(h, o, gate1, n3w, n3b, eps)
                a = (aq, a_s)
            else:
                h = gated_residual(h, gate1, o)
                a = F.layer_norm(h, (spec.dim,), n3w, n3b, eps)
            cross = self.cross_attention(b, a, cache)
            if self.fused_input:  # the residual add inside the FFN input's quantization
                aq, a_s, h = self.act.residual_norm_modulate(h, cross, self.ones, shift2,
                                                             scale2, eps)
                a = (aq, a_s)
            else:
                h = h + cross
                a = modulate(h, shift2, scale2, eps)
            up = self.linear(f"blocks.{b}.ffn.0", a, "ffn_up")
            up = self.act.gelu(up) if self.fused_gelu else gelu_tanh(up)
            f = self.linear(f"blocks.{b}.ffn.2", up, "ffn_down")
            if self.fused_residual:
                pending = (f, gate2)
            else:
                h = gated_residual(h, gate2, f)
        if pending is not None:
            f, gate = pending
            h = gated_residual_once(h, gate, f)
        shift, scale = head_mod
        out = self.linear("head.head", modulate(h, shift, scale, eps))
        return self.unpatchify(out, x.shape[1])

    def embed(self, inp: torch.Tensor) -> torch.Tensor:
        """The patch embedding of inp [C_in, F, h, w]: tokens [F * T, dim] ordered (frame,
        row, column); with patch_gemm contiguous rows from one GEMM over the patches (each
        patch's values ordered (channel, row, column), as the Conv3d weight's), else the
        Conv3d's output viewed as rows."""
        spec, p = self.spec, self.spec.patch
        weight, bias = self.w["patch_embedding.weight"], self.w["patch_embedding.bias"]
        if self.cfg.switches.patch_gemm:
            c, f = inp.shape[:2]
            patches = inp.view(c, f, spec.grid_h, p, spec.grid_w, p).permute(1, 2, 4, 0, 3, 5)
            return F.linear(patches.reshape(f * spec.frame_tokens, c * p * p), weight.flatten(1),
                            bias)
        h = F.conv3d(inp[None], weight, bias, stride=(1, p, p))
        return h.flatten(2)[0].t()

    @property
    def fused_input(self) -> bool:
        """AdaLN and the FP8 quantization of the block linears' input in one op."""
        return self.fp8_linears and self.cfg.switches.fused_act_quant

    def norm_input(self, h, shift, scale):
        """The self-attention's input: AdaLN of h, quantized once for q, k and v where they
        are FP8 linears and fused_act_quant is on."""
        if self.fused_input:
            return self.act.norm_modulate(h, shift, scale, self.spec.norm_eps)
        return modulate(h, shift, scale, self.spec.norm_eps)

    def residual_input(self, h, o, gate, add, shift, scale):
        """The next block's AdaLN input quantized, with the previous block's gated residual
        h + gate * o (and the block's audio rows, `add`) added inside: (q, scale), new h."""
        eps = self.spec.norm_eps
        if add is None:
            aq, a_s, h = self.act.residual_norm_modulate(h, o, gate, shift, scale, eps)
        else:
            aq, a_s, h = self.act.residual_add_norm_modulate(h, o, gate, add, shift, scale, eps)
        return (aq, a_s), h

    def qkv(self, b: int, a) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Block b's q, k, v [T, dim]: one GEMM (fused_qkv, its output split) or three."""
        pre = f"blocks.{b}.self_attn"
        if self.cfg.switches.fused_qkv:
            return self.linear(f"{pre}.qkv", a, "qkv").split(self.spec.dim, dim=-1)
        return tuple(self.linear(f"{pre}.{n}", a, "attn") for n in "qkv")

    def fused_pre(self, cache: ChunkCache) -> bool:
        """The chunk's pre-attention runs fused (the FP8 cache in use, FP8 attention)."""
        return self.pre_attention is not None and cache.quantized and \
            self.cfg.numerics.fp8_attention

    def fused_wide_pre(self, cache: ChunkCache) -> bool:
        """The chunk's pre-attention runs fused into the cache in the model's dtype (the
        chunks before the FP8 calibration, or every chunk without fp8_kv)."""
        return self.pre_attention_wide is not None and not cache.quantized

    def self_attention(self, b: int, q, cache: ChunkCache, n_slots: int):
        """q [heads, T, head_dim] (after RoPE), or its FP8 quantization per (head, token)
        (q8 [heads, T, head_dim], scale [heads, T, 1]), over block b's first n_slots cached
        slots -> [T, dim]: the FP8 attention over the FP8 cache as it lies, or SDPA in the
        model's dtype."""
        if cache.quantized and self.cfg.numerics.fp8_attention:
            H, D = self.spec.n_heads, self.spec.head_dim
            if isinstance(q, tuple):
                q8, qs = q
            else:
                q8, qs = self.act.quantize_rows(q.reshape(-1, D))
            k8, v8, ks, vs = cache.read_fp8(b, n_slots)
            return self.attend8(q8.view(H, -1, D), qs.view(H, -1, 1), k8, v8, ks, vs,
                                self.dtype)
        kc, vc = cache.read(b, n_slots)
        o = F.scaled_dot_product_attention(q[None], kc[None], vc[None])
        return o[0].transpose(0, 1).flatten(1)

    def cross_attention(self, b: int, a, cache: ChunkCache) -> torch.Tensor:
        """a: the normed input (norm3's), or its FP8 quantization (q, scale). With
        fp8_cross_attention, the FP8 attention kernel over the prompt's FP8 K/V."""
        spec, w, pre = self.spec, self.w, f"blocks.{b}.cross_attn"
        if self.fp8_cross:
            q8, qs = self.q_norm_quant(self.linear(f"{pre}.q", a, "attn"),
                                       w[f"{pre}.norm_q.weight"], spec.norm_eps, spec.n_heads)
            o = self.attend8_cross(q8, qs, *cache.text_fp8(b), self.dtype)
            return self.linear(f"{pre}.o", o, "attn")
        q = self.q_norm(self.linear(f"{pre}.q", a, "attn"), w[f"{pre}.norm_q.weight"],
                        spec.norm_eps)
        if self.cfg.switches.text_kv_once:
            k, v = cache.text_k[b], cache.text_v[b]
        else:
            k, v = self.cross_kv(b)
        o = F.scaled_dot_product_attention(self.heads(q).transpose(0, 1)[None], k[None], v[None])
        return self.linear(f"{pre}.o", o[0].transpose(0, 1).flatten(1), "attn")

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
