"""LiveTalk's side networks warmed up on their device: one call of each at the shapes a
session runs them at, the decoder's pieces included. (The DiT's warm-up, a throw-away
session through every phase, is charengine/stepping.py's warm_up.)"""

from __future__ import annotations

import torch


def warm_up_side(side, spec, device: torch.device) -> None:
    """One call of each side network on `device` (cuDNN picks its algorithms, workspaces are
    allocated), so a session's image, prompt, audio and first decodes run warm."""
    from . import audio

    with torch.inference_mode():
        side.image_encoder(torch.zeros(3, spec.out_h, spec.out_w, device=device))
        side.text_encoder("")
        window = torch.zeros(audio.window_samples(spec.audio), device=device)
        for k in (0, 1):
            audio.chunk_features(spec.audio, side.audio_encoder, window, k)
        if side.steady_audio is not None:  # the steady chunks' graph
            side.steady_audio.capture()
        z = torch.zeros(spec.latent_channels, spec.chunk_frames, spec.latent_h, spec.latent_w,
                        device=device)
        # the shapes a session decodes, live or rendered: StreamingDecoder.per_latent's
        # pieces (the first two latents together, then one at a time)
        side.decoder.reset()
        for chunk in range(2):
            for piece in side.decoder.per_latent(z):
                side.decoder(piece)
        side.decoder.reset()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
