"""A throw-away session that runs every code path a real session runs: session start, the
masked cache-filling steps, the FP8 calibration, and the first steady step, at which the
steady and reset graphs are captured (capturing launches every kernel of both).

charbuild runs it on the target GPU so that every Triton kernel is compiled into the engine;
charrun runs it at load so that kernels are loaded, cuBLASLt and cuDNN have chosen their
algorithms and the step graphs exist before the first real session starts."""

from __future__ import annotations

import torch

from . import audio as audio_mod
from .graphs import GraphedStep
from .sidenets import SideNets
from .step import Session


def warm_up(session: Session, seed: int = 0) -> int:
    """Run seeded random inputs through `session` (its step_fn a GraphedStep) until its
    graphs are captured; returns the steps taken. The next session's start resets every
    cache and counter, and the graphs stay valid (they read the same buffers)."""
    graphed = session.step_fn
    if not isinstance(graphed, GraphedStep):
        raise TypeError("warm_up needs a session stepping through a GraphedStep")
    spec, cc = session.cfg.model, session.cfg.cache
    dev = session.cache.step.device
    g = torch.Generator(device=dev).manual_seed(seed)

    def rand(*shape):
        return torch.randn(shape, generator=g, device=dev)

    limit = max(cc.window, cc.calibration_steps) + 2
    with torch.inference_mode():
        session.start(rand(spec.latent_channels, spec.latent_h, spec.latent_w),
                      rand(spec.prompt_tokens, spec.text_dim))
        for k in range(limit):
            session.step(rand(spec.latent_channels, spec.latent_h, spec.latent_w),
                         rand(spec.audio_tokens, spec.audio_dim))
            if graphed.ready():
                break
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    if not graphed.ready():
        raise RuntimeError(f"warm-up reached no steady step in {limit} steps")
    return k + 1


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
