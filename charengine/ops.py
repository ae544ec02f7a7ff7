"""The plain math of a block's pieces, written once: the model's plain paths, the plugins'
references (which the fast kernels are tested against) and the training forward all compute
through these."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def modulate(h: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """AdaLN: LN(h) * (1 + scale) + shift over the last dimension (a norm without weights)."""
    return F.layer_norm(h, (h.shape[-1],), eps=eps) * (1 + scale) + shift


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU in its tanh form (LiveTalk's FFN, as upstream's nn.GELU(approximate="tanh"))."""
    return F.gelu(x, approximate="tanh")


def gated_residual(h: torch.Tensor, gate: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """h + gate * o, rounded after the product and after the sum."""
    return h + gate * o


def gated_residual_once(h: torch.Tensor, gate: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """h + gate * o rounded once (torch.addcmul): what the fused kernels compute."""
    return torch.addcmul(h, gate, o)


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-norm over the last (head) dimension in fp32, result in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def rms_norm_width(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over the whole last dimension in fp32, rounded to x's dtype before the weight
    (LiveTalk's q/k norm across all heads, in its own order)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def stacked_taps(past: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A causal n+1-tap temporal conv's input as one 2-D conv takes it: frames x [F, H, W, C]
    after their n past frames past [n, H, W, C] -> [F, H, W, (n + 1) C], output frame f's
    taps (frames f .. f + n of the two, oldest first) side by side on the channels."""
    t = torch.cat([past, x])
    n, frames = past.shape[0], x.shape[0]
    return torch.cat([t[i:i + frames] for i in range(n + 1)], dim=-1)


def keep_past(past: torch.Tensor, x: torch.Tensor) -> None:
    """A causal conv's past frames past [n, ...] become, in place, the last n frames of past
    followed by frames x [F, ...]."""
    n = past.shape[0]
    if n:
        past.copy_(x[-n:] if x.shape[0] >= n else torch.cat([past, x])[-n:])


def channel_rms_norm(x: torch.Tensor, gain: torch.Tensor, silu: bool) -> torch.Tensor:
    """The Wan VAE's RMS norm: x [B, C, ...] over unit L2 norm across C (F.normalize), times
    sqrt(C) and a per-channel gain, then SiLU where asked; each op in x's dtype."""
    y = F.normalize(x, dim=1) * x.shape[1] ** 0.5 * gain.view(-1, *(1,) * (x.dim() - 2))
    return F.silu(y) if silu else y


def channel_norm_taps(x: torch.Tensor, gain: torch.Tensor, bias: torch.Tensor | None,
                      past: torch.Tensor, silu: bool) -> torch.Tensor:
    """Pixel rows x [F, H, W, C] (plus a per-channel bias, if given) through
    `channel_rms_norm` (and SiLU), as the stacked taps of a causal conv after past [n, H, W, C]
    (`stacked_taps`); past becomes the last n frames of the two, in place."""
    if bias is not None:
        x = x + bias
    y = channel_rms_norm(x.permute(3, 0, 1, 2)[None], gain, silu)[0].permute(1, 2, 3, 0)
    taps = stacked_taps(past, y)
    keep_past(past, y)
    return taps


def nearest2x_rows(rows: torch.Tensor) -> torch.Tensor:
    """Frames' pixel rows [T, H, W, C] resized 2x in height and width (nearest) -> [T, 2 H,
    2 W, C], contiguous."""
    y = F.interpolate(rows.permute(0, 3, 1, 2), scale_factor=2.0, mode="nearest")
    return y.permute(0, 2, 3, 1).contiguous()


def bias_residual_rows(h: torch.Tensor, bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Pixel rows h [..., C] plus a per-channel bias [C] plus the residual x (as h)."""
    return h + bias + x
