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


def channel_rms_norm(x: torch.Tensor, gain: torch.Tensor, silu: bool) -> torch.Tensor:
    """The Wan VAE's RMS norm: x [B, C, ...] over unit L2 norm across C (F.normalize), times
    sqrt(C) and a per-channel gain, then SiLU where asked; each op in x's dtype."""
    y = F.normalize(x, dim=1) * x.shape[1] ** 0.5 * gain.view(-1, *(1,) * (x.dim() - 2))
    return F.silu(y) if silu else y
