"""LiveTalk's 3-D RoPE: a head's interleaved pairs split temporal / height / width (44 / 42
/ 42 of 128), each axis with its own ladder theta^(-2j / n); tokens at (absolute or reset)
latent-frame index, row and column.

Two ways to apply it, behind `rope_tables`: the plain one multiplies complex float64 pairs
by float64 phasors (upstream's numerics); the table one rotates in fp32 by cos/sin computed
on the device from the chunk's positions (float64 angles, so far positions keep their
precision)."""

from __future__ import annotations

import torch

from ..rope import rotate, rotate_temporal_f32
from .spec import LiveTalkSpec


def ladder(width: int, theta: float) -> torch.Tensor:
    """float64 frequencies of one axis's width / 2 pairs."""
    return 1.0 / theta ** (torch.arange(0, width, 2, dtype=torch.float64)[: width // 2] / width)


class ChunkRope:
    """Angles of a chunk's tokens: the temporal part from the frames' positions, the height
    and width parts fixed for the grid."""

    def __init__(self, spec: LiveTalkSpec, device):
        nt, nh, nw = spec.rope_split
        self.spec, self.device = spec, torch.device(device)
        self.omega_t = ladder(nt, spec.rope_theta).to(self.device)
        rows = torch.arange(spec.grid_h, dtype=torch.float64)[:, None] * ladder(nh, spec.rope_theta)
        cols = torch.arange(spec.grid_w, dtype=torch.float64)[:, None] * ladder(nw, spec.rope_theta)
        hw = torch.cat([rows[:, None, :].expand(-1, spec.grid_w, -1),
                        cols[None, :, :].expand(spec.grid_h, -1, -1)], dim=-1)
        self.hw = hw.reshape(spec.frame_tokens, -1).to(self.device)  # [T, (nh + nw) / 2]

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """float64 angles [F * T, head_dim / 2] of a chunk's tokens at frame `positions` [F]."""
        t = positions.to(self.device, torch.float64)[:, None] * self.omega_t  # [F, nt / 2]
        T = self.spec.frame_tokens
        t = t[:, None, :].expand(-1, T, -1)
        hw = self.hw[None].expand(positions.shape[0], -1, -1)
        return torch.cat([t, hw], dim=-1).reshape(positions.shape[0] * T, -1)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos, sin [F * T, head_dim / 2] (the `rope_tables` path)."""
        a = self.angles(positions)
        return torch.cos(a).float(), torch.sin(a).float()

    def phasors(self, positions: torch.Tensor) -> torch.Tensor:
        """complex128 [F * T, head_dim / 2] (the plain path)."""
        a = self.angles(positions)
        return torch.polar(torch.ones_like(a), a)


def apply_complex(x: torch.Tensor, phasors: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] rotated by complex128 phasors [N, D / 2] in float64; result in x's dtype."""
    xc = torch.view_as_complex(x.to(torch.float64).unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(xc * phasors[:, None, :]).flatten(-2).to(x.dtype)


def apply_tables(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] rotated in fp32 by cos/sin [N, D / 2]; result in x's dtype."""
    return rotate(x.transpose(0, 1), cos, sin).transpose(0, 1)


def rotate_temporal(x: torch.Tensor, omega_t: torch.Tensor, delta: float) -> torch.Tensor:
    """The delta rotation: x [..., D] with its temporal pairs turned by omega_t * delta
    (float64 angles, fp32 math), the rest unchanged; result in x's dtype."""
    nt = omega_t.shape[0]
    rot = rotate_temporal_f32(x[..., : 2 * nt].float(), omega_t, delta)
    return torch.cat([rot.to(x.dtype), x[..., 2 * nt:]], dim=-1)


class TableRotation:
    """A chunk's rotation from fp32 cos/sin tables [F * T, D / 2] (the `rope_tables` path;
    the fused pre-attention reads the tables themselves)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return apply_tables(x, self.cos, self.sin)


class ComplexRotation:
    """A chunk's rotation by complex128 phasors (the plain path)."""

    cos = sin = None

    def __init__(self, phasors: torch.Tensor):
        self.phasors = phasors

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return apply_complex(x, self.phasors)
