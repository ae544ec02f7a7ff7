"""The latent decoder (one latent -> frames_per_latent RGB frames) and its mirror, the image
encoder (reference image -> one latent).

The decoder is a causal 3-D conv network: every temporal conv sees only the current and
earlier inputs, keeping the last frames of its input from the previous latent as state, so a
session decodes latent by latent with the same result as decoding the whole clip at once.
Each stage upsamples 2x: time in the first log2(frames_per_latent) stages, space in the first
log2(vae_stride).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .spec import ModelSpec


class CausalConv3d(torch.nn.Module):
    def __init__(self, cin: int, cout: int, kt: int = 3):
        super().__init__()
        self.conv = torch.nn.Conv3d(cin, cout, (kt, 3, 3), padding=(0, 1, 1))
        self.kt = kt
        self.state: torch.Tensor | None = None  # last kt - 1 input frames of the session

    def reset(self) -> None:
        self.state = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        past = self.state if self.state is not None else torch.zeros_like(x[:, :, :1]).expand(
            -1, -1, self.kt - 1, -1, -1)
        x = torch.cat([past, x], dim=2)
        self.state = x[:, :, -(self.kt - 1):].detach().clone()
        return self.conv(x)


def _stages(spec: ModelSpec) -> list[tuple[bool, bool]]:
    """(temporal 2x, spatial 2x) per stage."""
    nt = spec.frames_per_latent.bit_length() - 1
    ns = spec.vae_stride.bit_length() - 1
    return [(i < nt, i < ns) for i in range(len(spec.side.decoder_channels) - 1)]


class Decoder(torch.nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        ch = spec.side.decoder_channels
        self.spec = spec
        self.conv_in = CausalConv3d(spec.latent_channels, ch[0])
        n = spec.side.decoder_convs
        self.convs = torch.nn.ModuleList(
            torch.nn.ModuleList(CausalConv3d(ch[i] if j == 0 else ch[i + 1], ch[i + 1])
                                for j in range(n))
            for i in range(len(ch) - 1))
        self.conv_out = CausalConv3d(ch[-1], 3)
        self.ups = _stages(spec)

    def reset(self) -> None:
        for m in self.modules():
            if isinstance(m, CausalConv3d):
                m.reset()

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        """latent [C, h, w] -> frames [frames_per_latent, 3, H, W] in [0, 1], continuing the
        session's causal state."""
        return self.forward_sequence(latent[None, :, None])[0].transpose(0, 1)

    def forward_sequence(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [B, C, F, h, w] -> frames [B, 3, F * frames_per_latent, H, W] in [0, 1]
        (training: the whole sequence at once, from the current causal state)."""
        x = self.conv_in(latents.to(self.conv_in.conv.weight.dtype))
        for convs, (t2, s2) in zip(self.convs, self.ups):
            x = F.interpolate(x, scale_factor=(2 if t2 else 1, 2 if s2 else 1, 2 if s2 else 1),
                              mode="nearest")
            for conv in convs:
                x = F.silu(conv(x))
        x = self.conv_out(x)
        return (torch.tanh(x.float()) + 1) / 2


class SessionDecoder:
    """One more session's decoder over a shared Decoder's weights: the causal convs' states
    are this session's, swapped in for each call and out after it (the worker decodes one
    call at a time, so calls of different sessions never overlap)."""

    def __init__(self, decoder: Decoder):
        self.decoder = decoder
        self.convs = [m for m in decoder.modules() if isinstance(m, CausalConv3d)]
        self.states: list[torch.Tensor | None] = [None] * len(self.convs)

    def reset(self) -> None:
        self.states = [None] * len(self.convs)

    def __call__(self, latent: torch.Tensor) -> torch.Tensor:
        held = [m.state for m in self.convs]
        for m, s in zip(self.convs, self.states):
            m.state = s
        try:
            return self.decoder(latent)
        finally:
            self.states = [m.state for m in self.convs]
            for m, s in zip(self.convs, held):
                m.state = s


class ImageEncoder(torch.nn.Module):
    """Reference image [3, H, W] in [0, 1] -> latent [C, h, w]: strided 2-D convs."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        ch = spec.side.decoder_channels[::-1]
        ns = spec.vae_stride.bit_length() - 1
        self.conv_in = torch.nn.Conv2d(3, ch[0], 3, padding=1)
        self.downs = torch.nn.ModuleList(
            torch.nn.Conv2d(ch[i], ch[i + 1], 3, stride=2 if i < ns else 1, padding=1)
            for i in range(len(ch) - 1))
        self.conv_out = torch.nn.Conv2d(ch[-1], spec.latent_channels, 3, padding=1)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(image[None].to(self.conv_in.weight.dtype) * 2 - 1)
        for conv in self.downs:
            x = F.silu(conv(x))
        return self.conv_out(x)[0].float()


class VideoEncoder(torch.nn.Module):
    """frames_per_latent frames [B, 3, F, H, W] in [0, 1] -> one latent [B, C, h, w] each F:
    the frames stacked on channels, then strided 2-D convs. Used to make training latents."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        ch = spec.side.decoder_channels[::-1]
        ns = spec.vae_stride.bit_length() - 1
        self.n = spec.frames_per_latent
        self.conv_in = torch.nn.Conv2d(3 * self.n, ch[0], 3, padding=1)
        self.downs = torch.nn.ModuleList(
            torch.nn.Conv2d(ch[i], ch[i + 1], 3, stride=2 if i < ns else 1, padding=1)
            for i in range(len(ch) - 1))
        self.conv_out = torch.nn.Conv2d(ch[-1], spec.latent_channels, 3, padding=1)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        B, _, T, H, W = frames.shape
        x = frames.reshape(B, 3, T // self.n, self.n, H, W).permute(0, 2, 1, 3, 4, 5)
        x = x.reshape(B * (T // self.n), 3 * self.n, H, W) * 2 - 1
        x = self.conv_in(x)
        for conv in self.downs:
            x = F.silu(conv(x))
        z = self.conv_out(x)
        return z.reshape(B, T // self.n, *z.shape[1:]).transpose(1, 2)  # [B, C, F, h, w]
