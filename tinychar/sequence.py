"""The DiT over a whole clip at one noise level, in full precision and differentiable: the
training forward. It computes what the engine's per-step forward computes, all frames at
once: every frame at the same sigma (the per-(block, pass) caches hold each frame's keys from
the same pass), block-causal attention over a window of `cache.window` frames plus the global
tokens (reference image and prompt, which attend among themselves), one temporal RoPE index
per frame. tests/test_sequence.py checks it against the engine's AR steps.

The runtime never imports this module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from charengine.config import EngineConfig
from charengine.characters.model import conditioning_vector
from charengine.ops import gated_residual, modulate, rms_norm_heads, swiglu
from charengine.characters.rope import RopeTables
from charengine.rope import cos_sin, rotate


def block_causal_mask(G: int, T: int, frames: int, window: int, device=None) -> torch.Tensor:
    """[N, N] bool, N = G + frames * T: global tokens see global tokens; a frame's tokens see
    the global tokens and every token of itself and the window - 1 frames before it."""
    n = G + frames * T
    frame = torch.full((n,), -1, dtype=torch.long, device=device)
    frame[G:] = torch.arange(frames, device=device).repeat_interleave(T)
    q, k = frame[:, None], frame[None, :]
    glob_q, glob_k = q < 0, k < 0
    return (glob_q & glob_k) | (~glob_q & glob_k) | (~glob_q & ~glob_k & (k <= q) & (k > q - window))


class SequenceDiT(torch.nn.Module):
    """Holds the full-precision checkpoint tensors (weights.param_shapes names) as
    parameters."""

    def __init__(self, cfg: EngineConfig, state: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg, self.spec = cfg, cfg.model
        self.names = list(state)
        self.params = torch.nn.ParameterList(
            torch.nn.Parameter(state[n].detach().float().clone()) for n in self.names)
        self.rope = RopeTables(self.spec)

    def state(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.params))

    def angles(self, temporal: torch.Tensor) -> torch.Tensor:
        """temporal [B, L] indices of the clip's frames -> angles [B, N, D/2] of every token."""
        B = temporal.shape[0]
        g = self.rope.global_angles().expand(B, -1, -1)
        f = torch.stack([self.rope.frames_angles(t) for t in temporal])
        return torch.cat([g, f], dim=1)

    def forward(self, x: torch.Tensor, audio: torch.Tensor, ref: torch.Tensor,
                prompt: torch.Tensor, sigma: torch.Tensor, temporal: torch.Tensor) -> torch.Tensor:
        """x [B, L, video_tokens, patch_dim] (each frame's latent at sigma, patchified),
        audio [B, L, audio_tokens, audio_dim], ref [B, video_tokens, patch_dim], prompt
        [B, prompt_tokens, text_dim], sigma [B], temporal [B, L] -> velocity like x."""
        spec, w = self.spec, self.state()
        B, L, V, _ = x.shape
        d, H, D = spec.dim, spec.n_heads, spec.head_dim
        T = spec.tokens_per_frame

        def dense(t, name):
            return t @ w[f"{name}.weight"].t() + w[f"{name}.bias"]

        glob = torch.cat([dense(ref, "patch_embed"), dense(prompt, "text_proj")], dim=1)
        frames = torch.cat([dense(x, "patch_embed"), dense(audio, "audio_proj")], dim=2)
        h = torch.cat([glob, frames.reshape(B, L * T, d)], dim=1)
        G, N = glob.shape[1], h.shape[1]
        mask = block_causal_mask(G, T, L, self.cfg.cache.window, x.device)
        cos, sin = cos_sin(self.angles(temporal))
        cos, sin = cos[:, None], sin[:, None]
        c = F.silu(conditioning_vector(w, sigma, spec.time_freq_dim))  # [B, d]
        A, M = d, spec.mlp_hidden
        for b in range(spec.n_blocks):
            shift, scale, gate = dense(c, f"blocks.{b}.adaln").reshape(B, 3, 1, d).unbind(1)
            y = modulate(h, shift, scale, spec.norm_eps) @ w[f"blocks.{b}.w_in"].t()
            q, k, v, g, u = y.split([A, A, A, M, M], dim=-1)
            q, k, v = (t.reshape(B, N, H, D).transpose(1, 2) for t in (q, k, v))
            q = rotate(rms_norm_heads(q, w[f"blocks.{b}.q_norm"], spec.norm_eps), cos, sin)
            k = rotate(rms_norm_heads(k, w[f"blocks.{b}.k_norm"], spec.norm_eps), cos, sin)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            o = o.transpose(1, 2).reshape(B, N, A)
            h = gated_residual(h, gate, torch.cat([o, swiglu(g, u)], dim=-1) @ w[f"blocks.{b}.w_out"].t())
        shift, scale = dense(c, "final_adaln").reshape(B, 2, 1, d).unbind(1)
        hv = h[:, G:].reshape(B, L, T, d)[:, :, :V]
        hv = modulate(hv, shift[:, None], scale[:, None], spec.norm_eps)
        return dense(hv, "final")
