"""A session rendered into an MP4: the writer is closed whatever happens, so Ctrl-C or a
failure mid-session leaves a playable file of every step that was written."""

from __future__ import annotations

from pathlib import Path

import torch


from .media import Mp4Writer
from .pipeline import StepTimes


class Rendered:
    def __init__(self):
        self.steps = 0
        self.frames = 0  # frames in the file (those the writer took), true after any exit
        self.times: StepTimes | None = None

    @property
    def written(self) -> bool:
        """The file exists at `out`: the writer moves it there once it holds a frame."""
        return self.frames > 0


def render(worker, picture: torch.Tensor, prompt: str, speech: torch.Tensor,
           out: Path, seed: int = 0, on_step=None, result: Rendered | None = None) -> Rendered:
    """Animate `picture` to `speech` (16 kHz mono) into `out` with a Worker or a
    DistributedWorker. `on_step(steps_done)` is
    called after each step's frames are written. `result` (if given) is filled in as the
    session runs, so a caller that catches an exception still knows how far it got."""
    spec, family = worker.spec, worker.family
    result = result or Rendered()
    steps = family.steps_for(spec, speech.numel())
    writer = Mp4Writer(out, spec.out_w, spec.out_h, spec.fps, spec.side.sample_rate)

    def sink(i, frames):
        a, b = family.step_bounds(spec, i)
        chunk = speech[a:b]
        try:
            writer.write(frames, torch.nn.functional.pad(chunk, (0, (b - a) - chunk.numel())))
        finally:
            result.frames = writer.frames
        result.steps = i + 1
        if on_step is not None:
            on_step(result.steps)

    try:
        worker.start(picture, prompt)
        result.times = worker.run(speech, steps, sink, seed=seed)
    finally:
        try:
            writer.close()
        finally:
            result.frames = writer.frames
    return result
