"""chunk_step replayed from captured CUDA graphs: one for the steady chunk, one for the
reset chunk (delta rotation first) and, with graph_fill_chunks, one for each chunk before the
steady one (the chunks that fill the cache, each of its own shape). Without it those run
eagerly every session. The first steady chunk of a process runs eagerly and warms every
kernel up (the warm-up session's); every graph is captured after it. Inputs are copied into
static buffers; write slots and positions live on the device (the ring cache), so a replay
needs no host state. The FP8 calibration between the fill and steady chunks stays eager
(Session.step: a few kernels, once a session)."""

from __future__ import annotations

import torch

from .. import graph_upload
from .step import chunk_step

STEADY, RESET = "steady", "reset"  # the graphs' keys besides the fill chunks' counts


class GraphedChunk:
    def __init__(self):
        self.graphs: dict[str | int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[str | int, torch.Tensor] = {}
        self.noise = self.audio = None
        self.pool = None

    def ready(self) -> bool:
        return bool(self.graphs)

    def upload(self) -> None:
        """Upload every captured graph to the device (graph_upload), so that each one's
        first replay starts as fast as the later ones."""
        lib, stream = graph_upload.cudart(), torch.cuda.current_stream()
        for g in self.graphs.values():
            graph_upload.upload(lib, g, stream)

    def steady(self, cache, c: int) -> bool:
        """Chunk c has the steady shape: the window is full and the cache in its final
        precision."""
        return c >= cache.S + cache.W - 1 and (cache.quantized or not cache.fp8_kv)

    def key(self, cache, c: int) -> str | int:
        if self.steady(cache, c):
            return RESET if cache.is_reset(c) else STEADY
        return c

    def capture(self, model, cache, c: int) -> None:
        """Capture the steady and reset chunks at a steady chunk count c, and with
        graph_fill_chunks each fill chunk at its count, the cache's precision set to the one
        that chunk runs in (capturing records kernels without running them: the session's
        state is unchanged)."""
        self.pool = torch.cuda.graph_pool_handle()
        for reset in (False, True) if cache.reset_on else (False,):
            at = next(i for i in range(c, c + cache.R + 1) if cache.is_reset(i) == reset)
            self._capture(RESET if reset else STEADY, model, cache, at)
        if model.cfg.switches.graph_fill_chunks:
            quantized = cache.quantized
            try:
                for f in range(cache.first_steady()):
                    cache.quantized = cache.quantized_at(f)
                    self._capture(f, model, cache, f)
            finally:
                cache.quantized = quantized

    def _capture(self, key, model, cache, c: int) -> None:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            self.outputs[key] = chunk_step(model, cache, self.noise, self.audio, c)
        self.graphs[key] = g

    def __call__(self, model, cache, noise, audio, c: int):
        if not model.cfg.switches.ring_cache:
            return chunk_step(model, cache, noise, audio, c)
        key = self.key(cache, c)
        if key not in self.graphs:
            if self.graphs or not self.steady(cache, c):
                return chunk_step(model, cache, noise, audio, c)  # a fill chunk, eagerly
            # the first steady chunk, run eagerly: kernels load, workspaces are made
            self.noise = noise.to(model.device).clone()
            self.audio = audio.to(model.device).clone()
            out = chunk_step(model, cache, noise, audio, c)
            torch.cuda.synchronize()
            self.capture(model, cache, c + 1)
            return out
        self.noise.copy_(noise)
        self.audio.copy_(audio)
        self.graphs[key].replay()
        return self.outputs[key].clone()
