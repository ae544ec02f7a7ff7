"""Rotary position embedding on adjacent pairs, and the delta rotation of temporal pairs.

A head of width D is split into sections (a model's temporal / height / width). Pair j of a
section rotates by omega_j * position with omega_j = theta^(-2j / section_width). Pairs are
adjacent elements (x[2j], x[2j+1]) and rotate as (x0 cos - x1 sin, x0 sin + x1 cos), in fp32.
"""

from __future__ import annotations

import torch


def section_frequencies(width: int, theta: float) -> torch.Tensor:
    j = torch.arange(width // 2, dtype=torch.float64)
    return (theta ** (-2.0 * j / width)).to(torch.float32)


def cos_sin(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cos(angles), torch.sin(angles)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of x [..., N, D] by angles whose cos/sin are [N, D/2]; fp32 math,
    result in x's dtype."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)


def rotate_temporal_f32(x: torch.Tensor, omega_t: torch.Tensor, delta: float) -> torch.Tensor:
    """Rotate the temporal pairs of fp32 x [..., D] by omega_j * delta; others unchanged. The
    angles in omega_t's precision (float64 ones keep far positions exact), the math in
    fp32."""
    nt = omega_t.shape[0]
    ang = omega_t * delta
    c, s = torch.cos(ang).float(), torch.sin(ang).float()
    pairs = x[..., : 2 * nt].unflatten(-1, (nt, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rot = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)
    return torch.cat([rot, x[..., 2 * nt:]], dim=-1)
