"""A clip generated in process from a rank-0 session and the side networks, step by step as
the runtime does it (audio window -> features -> AR step -> decoder), without an engine
directory or the pipeline's threads: for evaluation scripts and tests."""

from __future__ import annotations

import numpy as np
import torch

from . import audio as audio_mod
from .sidenets import SideNets
from .step import Session


@torch.no_grad()
def animate(session: Session, side: SideNets, image: torch.Tensor, speech: torch.Tensor,
            prompt: str = "", seed: int = 0) -> np.ndarray:
    """image [3, H, W] in [0, 1], speech 16 kHz mono -> frames [T, H, W, 3] uint8 covering the
    speech (whole AR steps)."""
    spec = session.model.spec
    session.start(side.image_encoder(image), side.text_encoder(prompt))
    side.decoder.reset()
    g = torch.Generator().manual_seed(seed)
    lat = (spec.latent_channels, spec.latent_h, spec.latent_w)
    frames = []
    for k in range(audio_mod.steps_for(spec, speech.numel())):
        feats = side.audio_encoder(audio_mod.step_window(spec, speech, k))
        frames.append(side.decoder(session.step(torch.randn(lat, generator=g), feats)))
    video = torch.cat(frames).permute(0, 2, 3, 1)  # [T, H, W, 3]
    return (video * 255).round().clamp(0, 255).byte().numpy()
