"""A LiveTalk step: one chunk of latent frames, denoised in the schedule's passes with
re-noising between them, then the commit pass at t = 0 that writes the clean chunk's K/V;
and the session that drives it.

`chunk_step` reads only tensors apart from its static arguments (the chunk's kind, which
the host knows from its own count): with the ring cache, write slots and positions derive
on the device, so the steady and reset chunks replay from CUDA graphs (graphs.py)."""

from __future__ import annotations

import torch

from .cache import ChunkCache
from .model import LiveTalkDiT


def float32(x: float) -> float:
    """x as the fp32 value the schedule's tensors hold."""
    return float(torch.tensor(x, dtype=torch.float32))


def chunk_step(model: LiveTalkDiT, cache: ChunkCache, noise: torch.Tensor, audio: torch.Tensor,
               c: int) -> torch.Tensor:
    """Chunk c's clean latent [C, F, h, w] (fp32) from `noise` [passes, C, F, h, w] (the
    first pass's input, then each re-noising's draw) and its audio feature rows."""
    sched, dt = model.cfg.schedule, model.dtype
    sigmas = [float32(s) for s in sched.sigmas]
    cache.begin_chunk(c)
    cond = model.audio_conditioning(audio)
    rope = model.rope(cache)
    n = cache.valid_slots(c)
    first = c == 0
    y = model.y_first if first else model.y_next
    noise = noise.to(model.device, dt)
    x = noise[0].clone()
    for p in range(sched.passes):
        if first:
            x[:, 0] = model.ref
        v = model.forward(x, y, p, cache, cond, rope, n)
        x0 = (x.double() - sigmas[p] * v.double()).to(dt)
        if p + 1 < sched.passes:
            s = sigmas[p + 1]
            x = ((1 - s) * x0.float() + s * noise[p + 1].float()).to(dt)
    if first:
        x0[:, 0] = model.ref
    model.forward(x0, y, sched.passes, cache, cond, rope, n, commit=True)
    cache.end_chunk()
    return x0.float()


class Session:
    """Drives one model through a session: chunk count, FP8 calibration, the step function
    (chunk_step or a graphed equivalent of its signature)."""

    def __init__(self, model: LiveTalkDiT, cache: ChunkCache, step_fn=chunk_step):
        self.model, self.cache, self.step_fn = model, cache, step_fn
        self.cfg = model.cfg
        self.k = 0  # host-side chunk count: picks the chunk's kind, never read from the device

    def start(self, ref_latent: torch.Tensor, prompt: torch.Tensor) -> None:
        """New reference latent [C, h, w] and prompt features [prompt_tokens, text_dim]."""
        self.cache.new_session()
        self.k = 0
        self.model.start(ref_latent, prompt, self.cache)

    def step(self, noise: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        cc = self.cfg.cache
        if self.cfg.switches.fp8_kv and self.k == cc.calibration_chunks:
            self.cache.calibrate(self.cache.valid_slots(self.k - 1))
        out = self.step_fn(self.model, self.cache, noise, audio, self.k)
        self.k += 1
        return out
