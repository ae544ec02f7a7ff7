"""chunk_step replayed from captured CUDA graphs: one for the steady chunk, one for the
reset chunk (delta rotation first). The chunks that fill the cache and the FP8 calibration
run eagerly, once per session; the first steady chunk runs eagerly too and warms every
kernel up. Inputs are copied into static buffers; write slots and positions live on the
device (the ring cache), so a replay needs no host state."""

from __future__ import annotations

import torch

from .step import chunk_step


class GraphedChunk:
    def __init__(self):
        self.graphs: dict[bool, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[bool, torch.Tensor] = {}
        self.noise = self.audio = None
        self.pool = None

    def ready(self) -> bool:
        return bool(self.graphs)

    def steady(self, cache, c: int) -> bool:
        """Chunk c has the steady shape: the window is full and the cache in its final
        precision."""
        return c >= cache.S + cache.W - 1 and (cache.quantized or not cache.fp8_kv)

    def capture(self, model, cache, c: int) -> None:
        """Capture the steady and reset chunks at a steady chunk count c (capturing records
        kernels without running them: the session's state is unchanged)."""
        self.pool = torch.cuda.graph_pool_handle()
        for reset in (False, True) if cache.reset_on else (False,):
            at = next(i for i in range(c, c + cache.R + 1) if cache.is_reset(i) == reset)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.outputs[reset] = chunk_step(model, cache, self.noise, self.audio, at)
            self.graphs[reset] = g

    def __call__(self, model, cache, noise, audio, c: int):
        if not model.cfg.switches.ring_cache or not self.steady(cache, c):
            return chunk_step(model, cache, noise, audio, c)
        if not self.graphs:  # a real chunk, run eagerly: kernels load, workspaces are made
            self.noise = noise.to(model.device).clone()
            self.audio = audio.to(model.device).clone()
            out = chunk_step(model, cache, noise, audio, c)
            torch.cuda.synchronize()
            self.capture(model, cache, c + 1)
            return out
        self.noise.copy_(noise)
        self.audio.copy_(audio)
        self.graphs[cache.is_reset(c)].replay()
        return self.outputs[cache.is_reset(c)].clone()
