"""A throw-away session that runs every code path a real LiveTalk session runs: session
start, the chunks that fill the cache (the first with the reference overwrite), the FP8
calibration, and the first steady chunk, after which the steady and reset graphs are
captured. charbuild runs it on the target GPU so every kernel is compiled into the engine;
charrun runs it at load so nothing is left to compile or capture when a user arrives."""

from __future__ import annotations

import torch

from .graphs import GraphedChunk
from .step import Session


def warm_up(session: Session, seed: int = 0) -> int:
    """Run seeded random inputs through `session` (stepping through a GraphedChunk) until
    its graphs are captured (without the ring cache: through the first steady chunk), then
    upload every graph to the device; returns the chunks run."""
    graphed = session.step_fn
    if not isinstance(graphed, GraphedChunk):
        raise TypeError("warm_up needs a session stepping through a GraphedChunk")
    spec, cc = session.cfg.model, session.cfg.cache
    dev = session.model.device
    g = torch.Generator(device=dev).manual_seed(seed)

    def rand(*shape):
        return torch.randn(shape, generator=g, device=dev)

    limit = max(spec.sink_chunks + spec.window_chunks, cc.calibration_chunks) + 2
    # without the ring, chunks read host-side offsets and run eagerly: there is no graph to
    # capture, and one steady chunk has run every kernel
    graphs = session.cfg.switches.ring_cache
    steady = spec.sink_chunks + spec.window_chunks
    latent = (spec.latent_channels, spec.chunk_frames, spec.latent_h, spec.latent_w)
    with torch.inference_mode():
        session.start(rand(spec.latent_channels, spec.latent_h, spec.latent_w),
                      rand(spec.prompt_tokens, spec.text_dim))
        for k in range(limit):
            session.step(rand(session.cfg.schedule.passes, *latent),
                         rand(spec.audio_rows, spec.audio_dim))
            if graphed.ready() or (not graphs and k + 1 >= steady):
                break
        if graphs and graphed.ready():
            # a graph's first launch would upload it to the device: uploaded now, a user's
            # first chunks do not pay for that (in place of replaying every graph once)
            graphed.upload()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    if graphs and not graphed.ready():
        raise RuntimeError(f"warm-up reached no steady chunk in {limit} chunks")
    return k + 1


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
