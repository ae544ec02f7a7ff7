"""The characters DiT's 3-D RoPE positions: a head split temporal / height / width
(ModelSpec.rope_split); a frame's video grid and audio tokens, the global tokens (reference
image grid, prompt at the origin); temporal angles made per position on the device."""

from __future__ import annotations

import torch

from ..rope import section_frequencies
from .spec import ModelSpec


def frequencies(spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(section_frequencies(w, spec.rope_theta) for w in spec.rope_split)


def frame_positions(spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Spatial (row, column) of one frame's tokens: the video grid, then the audio tokens at
    row grid_h (one past the grid) and column j."""
    rows = torch.arange(spec.grid_h).repeat_interleave(spec.grid_w)
    cols = torch.arange(spec.grid_w).repeat(spec.grid_h)
    a = torch.arange(spec.audio_tokens)
    return (torch.cat([rows, torch.full_like(a, spec.grid_h)]).float(),
            torch.cat([cols, a]).float())


def global_positions(spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Spatial positions of the global tokens: the reference image's grid, then the prompt
    tokens all at (0, 0). Their temporal index is 0."""
    rows = torch.arange(spec.grid_h).repeat_interleave(spec.grid_w)
    cols = torch.arange(spec.grid_w).repeat(spec.grid_h)
    z = torch.zeros(spec.prompt_tokens, dtype=torch.long)
    return torch.cat([rows, z]).float(), torch.cat([cols, z]).float()


class RopeTables(torch.nn.Module):
    """Frequencies and the static spatial angles; temporal angles are made per position."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        om_t, om_h, om_w = frequencies(spec)
        self.register_buffer("omega_t", om_t, persistent=False)
        rows, cols = frame_positions(spec)
        self.register_buffer("frame_spatial", torch.cat(
            [rows[:, None] * om_h, cols[:, None] * om_w], dim=1), persistent=False)
        grows, gcols = global_positions(spec)
        self.register_buffer("global_spatial", torch.cat(
            [grows[:, None] * om_h, gcols[:, None] * om_w], dim=1), persistent=False)

    def frame_angles(self, t: torch.Tensor) -> torch.Tensor:
        """Angles [T, D/2] for one frame's tokens at temporal index t (a 0-d device tensor)."""
        temporal = (t.to(torch.float32) * self.omega_t).expand(self.frame_spatial.shape[0], -1)
        return torch.cat([temporal, self.frame_spatial], dim=1)

    def frames_angles(self, t: torch.Tensor) -> torch.Tensor:
        """Angles [F * T, D/2] for F frames at temporal indices t [F], frame-major."""
        temporal = (t.to(torch.float32)[:, None, None] * self.omega_t)
        temporal = temporal.expand(-1, self.frame_spatial.shape[0], -1)
        spatial = self.frame_spatial.expand(t.shape[0], -1, -1)
        return torch.cat([temporal, spatial], dim=2).flatten(0, 1)

    def global_angles(self) -> torch.Tensor:
        temporal = torch.zeros(self.global_spatial.shape[0], self.omega_t.shape[0],
                               device=self.global_spatial.device)
        return torch.cat([temporal, self.global_spatial], dim=1)
