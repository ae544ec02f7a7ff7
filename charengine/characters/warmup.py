"""The characters family's side networks warmed up on their device: one call of each at the
shapes a session runs them at. (The DiT's warm-up, a throw-away session through every phase,
is charengine/stepping.py's warm_up.)"""

from __future__ import annotations

import torch

from . import audio as audio_mod
from .sidenets import SideNets


def warm_up_side(side: SideNets, spec, device: torch.device) -> None:
    """One call of each side network on `device` (cuDNN picks its algorithms, workspaces are
    allocated), so the first session's image, prompt, audio and first decode run warm."""
    with torch.inference_mode():
        side.image_encoder(torch.zeros(3, spec.out_h, spec.out_w, device=device))
        side.text_encoder("")
        speech = torch.zeros(audio_mod.window_samples(spec), device=device)
        side.audio_encoder(audio_mod.step_window(spec, speech, 0))
        side.decoder.reset()
        side.decoder(torch.zeros(spec.latent_channels, spec.latent_h, spec.latent_w,
                                 device=device))
        side.decoder.reset()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
