"""A clip generated in process from a rank-0 session and the side networks, step by step as
the runtime does it (audio window -> features -> AR step -> decoder), without an engine
directory or the pipeline's threads: for evaluation scripts and tests."""

from __future__ import annotations

import numpy as np
import torch

from charengine.characters import audio as audio_mod
from charengine.characters.spec import ModelSpec
from charengine.characters.sidenets import SideNets, load_side, random_side_state
from charengine.stepping import Session


def random_model_side(spec: ModelSpec, trained: dict[str, torch.Tensor], seed: int = 0) -> SideNets:
    """The side networks of a random-weight baseline: seeded audio and text encoders, the
    trained decoder and image encoder (so its frames are decoded like the trained model's)."""
    keep = ("decoder.", "image_encoder.")
    return load_side(spec, {**random_side_state(spec, seed),
                            **{k: v for k, v in trained.items() if k.startswith(keep)}})


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
