"""The audio encoder's steady window as one CUDA graph.

From the chunk whose window lies wholly after sample 0 on (`first_full_chunk`), every chunk's
features are the same computation of its window's samples: the window's length, the valid
samples, the encoder positions and the rows kept do not depend on the chunk. So one graph,
captured once when the side networks are warmed up, replays wav2vec2 (the CNN, the
projection, the transformer's layers: some hundred small kernels, launch-bound when run
eagerly) for every later chunk; the chunks before it run eagerly, as the plain path does
all of them (`LiveTalkSwitches.audio_graph`)."""

from __future__ import annotations

import threading

import torch

from .audio import (AudioEncoder, AudioSpec, chunk_features, chunk_frames, window_bounds,
                    window_positions, window_samples)


def first_full_chunk(spec: AudioSpec) -> int:
    """The first chunk whose encoder window holds no padding before sample 0."""
    k = 1
    while True:
        w = window_bounds(spec, k)
        if w.b - w.a == window_samples(spec):
            return k
        k += 1


def steady_rows(spec: AudioSpec, encoder: AudioEncoder, window: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
    """A full window's chunk rows [12, feature_dim]: chunk_features for any chunk from
    first_full_chunk on, with the positions given (on the encoder's device)."""
    k = first_full_chunk(spec)
    w = window_bounds(spec, k)
    feats = encoder.window_features(window, window_samples(spec), positions,
                                    w.end_frame - w.first_frame)
    f0, f1 = chunk_frames(k)
    return feats[f0 - w.first_frame:f1 - w.first_frame]


class SteadyAudio:
    """chunk_features for the chunks from first_full_chunk on as a graph replay; `capture()`
    (on a GPU, once the encoder is warm) records it, and until then, or for an earlier chunk,
    `__call__` runs chunk_features eagerly."""

    def __init__(self, spec: AudioSpec, encoder: AudioEncoder):
        self.spec, self.encoder = spec, encoder
        self.first = first_full_chunk(spec)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.lock = threading.Lock()  # one static window for every caller

    def capture(self) -> None:
        device = next(self.encoder.parameters()).device
        w = window_bounds(self.spec, self.first)
        self.positions = window_positions(self.spec, w, None).to(device)
        self.window = torch.zeros(window_samples(self.spec), device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.inference_mode():
            steady_rows(self.spec, self.encoder, self.window, self.positions)  # warm
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.inference_mode():
            self.rows = steady_rows(self.spec, self.encoder, self.window, self.positions)
        self.graph = graph

    def __call__(self, window: torch.Tensor, k: int) -> torch.Tensor:
        if self.graph is None or k < self.first:
            return chunk_features(self.spec, self.encoder, window, k)
        with self.lock:
            self.window.copy_(window)
            self.graph.replay()
            return self.rows.clone()
