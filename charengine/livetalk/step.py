"""A LiveTalk step: one chunk of latent frames, denoised in the schedule's passes with
re-noising between them, then the commit pass at t = 0 that writes the clean chunk's K/V;
and the phase rule of a session of them.

`chunk_step` reads only tensors apart from its static arguments (the chunk's kind, which
the host knows from its own count): with the ring cache, write slots and positions derive
on the device, so the steady and reset chunks replay from CUDA graphs. The session, the
graphs and the warm-up are charengine/stepping.py's; ChunkSteps is this family's rule for
them. The FP8 calibration between the fill and steady chunks stays eager (a few kernels,
once a session)."""

from __future__ import annotations

import torch

from .cache import ChunkCache
from .model import LiveTalkDiT


def chunk_step(model: LiveTalkDiT, cache: ChunkCache, noise: torch.Tensor, audio: torch.Tensor,
               c: int) -> torch.Tensor:
    """Chunk c's clean latent [C, F, h, w] (fp32) from `noise` [passes, C, F, h, w] (the
    first pass's input, then each re-noising's draw) and its audio feature rows."""
    return chunk_steps(model, [cache], [noise], [audio], [{"c": c}])[0]


def chunk_steps(model: LiveTalkDiT, caches: list[ChunkCache], noises, audios,
                kinds: list[dict]) -> list[torch.Tensor]:
    """chunk_step of a batch of sessions together: session i's chunk kinds[i]["c"] over its
    cache from its noise and audio. Their tokens go through every linear stacked, each
    session's attention over its own cache; a session's latent is what chunk_step gives it
    alone up to the roundings of the larger GEMMs (its rows are its own: nothing of one
    session reaches another)."""
    sched, dt, sigmas = model.cfg.schedule, model.dtype, model.sigmas
    cs = [kind["c"] for kind in kinds]
    for cache, c in zip(caches, cs):
        cache.begin_chunk(c)
    cond = model.audio_conditioning(audios)
    ropes = [model.rope(cache) for cache in caches]
    ns = [cache.valid_slots(c) for cache, c in zip(caches, cs)]
    firsts = [c == 0 for c in cs]
    ys = [cache.y_first if first else cache.y_next for cache, first in zip(caches, firsts)]
    noises = [noise.to(model.device, dt) for noise in noises]
    xs = [noise[0].clone() for noise in noises]
    for p in range(sched.passes):
        for x, cache, first in zip(xs, caches, firsts):
            if first:
                x[:, 0] = cache.ref
        vs = model.forward(xs, ys, p, caches, cond, ropes, ns)
        x0s = [(x.double() - sigmas[p] * v.double()).to(dt) for x, v in zip(xs, vs)]
        if p + 1 < sched.passes:
            s = sigmas[p + 1]
            xs = [((1 - s) * x0.float() + s * noise[p + 1].float()).to(dt)
                  for x0, noise in zip(x0s, noises)]
    for x0, cache, first in zip(x0s, caches, firsts):
        if first:
            x0[:, 0] = cache.ref
    model.forward(x0s, ys, sched.passes, caches, cond, ropes, ns, commit=True)
    for cache in caches:
        cache.end_chunk()
    return [x0.float() for x0 in x0s]


STEADY, RESET = "steady", "reset"  # the graphs' keys besides the fill chunks' counts


class ChunkSteps:
    """The LiveTalk family's phase rule (charengine/stepping.py's StepRule): step k is chunk
    k; the FP8 calibration runs before chunk calibration_chunks over the slots written so
    far. With the ring cache the steady and reset chunks replay their graphs and, with
    graph_fill_chunks, so does each chunk that fills the cache (each of its own shape);
    without the ring every chunk reads host-side offsets and runs eagerly."""

    def __init__(self, cfg):
        spec, cc, sw = cfg.model, cfg.cache, cfg.switches
        self.fp8_kv, self.calibration = sw.fp8_kv, cc.calibration_chunks
        self.graphed, self.fill_graphs = sw.ring_cache, sw.graph_fill_chunks
        self.steady_step = spec.sink_chunks + spec.window_chunks
        self.warm_up_limit = max(self.steady_step, cc.calibration_chunks) + 2

    def start(self, model: LiveTalkDiT, cache: ChunkCache, reference, prompt) -> None:
        model.start(reference, prompt, cache)

    def before(self, cache: ChunkCache, k: int) -> None:
        if self.fp8_kv and k == self.calibration:
            cache.calibrate(cache.valid_slots(k - 1))

    def kind(self, k: int) -> dict:
        return {"c": k}

    def resets_at(self, cache: ChunkCache, k: int) -> bool:
        return cache.is_reset(k)

    def steady(self, cache: ChunkCache, c: int) -> bool:
        """Chunk c has the steady shape: the window is full and the cache in its final
        precision."""
        return c >= cache.S + cache.W - 1 and (cache.quantized or not cache.fp8_kv)

    def graph_key(self, cache: ChunkCache, kind: dict):
        if not self.graphed:
            return None
        c = kind["c"]
        if self.steady(cache, c):
            return RESET if cache.is_reset(c) else STEADY
        return c

    def batch_kind(self, cache: ChunkCache, kind: dict) -> dict | None:
        """With the ring cache, a steady or reset chunk joins a batch as the first steady
        chunk that is no reset (whose count gives the same slots and shapes: the ring's
        write slots and positions derive on the device); the others run alone."""
        if not self.graphed or not self.steady(cache, kind["c"]):
            return None
        first = cache.first_steady()
        return {"c": next(c for c in range(first, first + cache.R + 1)
                          if not cache.is_reset(c))}

    def before_batch(self, cache: ChunkCache, kind: dict) -> None:
        """A reset chunk's rotation of the window keys (a batch's step has none)."""
        if cache.is_reset(kind["c"]):
            cache.delta_rotate()

    def captures_at(self, cache: ChunkCache, kind: dict) -> bool:
        return self.steady(cache, kind["c"])

    def captures(self, cache: ChunkCache, kind: dict):
        """The steady and reset chunks at the chunk counts after `kind`'s, and with
        graph_fill_chunks each fill chunk at its count, the cache's precision set to the one
        that chunk runs in."""
        c = kind["c"] + 1
        for reset in (False, True) if cache.reset_on else (False,):
            at = next(i for i in range(c, c + cache.R + 1) if cache.is_reset(i) == reset)
            yield (RESET if reset else STEADY), {"c": at}
        if self.fill_graphs:
            quantized = cache.quantized
            try:
                for f in range(cache.first_steady()):
                    cache.quantized = cache.quantized_at(f)
                    yield f, {"c": f}
            finally:
                cache.quantized = quantized
