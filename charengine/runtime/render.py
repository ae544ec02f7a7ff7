"""A session rendered into an MP4: the writer is closed whatever happens, so Ctrl-C or a
failure mid-session leaves a playable file of every step that was written, and `Rendered`
says what the file at `out` holds (nothing, where it could not be written)."""

from __future__ import annotations

from pathlib import Path

import torch


from .media import Mp4Writer
from .pipeline import StepTimes


class Rendered:
    def __init__(self):
        self.steps = 0
        self.frames = 0  # frames in the file at `out` once it is closed, true after any exit
        self.times: StepTimes | None = None
        self.written = False  # the file is at `out` (the writer moved it there)
        self.error: str | None = None  # why the file could not be written (a full disk)


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
        writer.write(frames, torch.nn.functional.pad(chunk, (0, (b - a) - chunk.numel())))
        result.steps = i + 1
        if on_step is not None:
            on_step(result.steps)

    try:
        worker.start(picture, prompt)
        result.times = worker.run(speech, steps, sink, seed=seed)
    finally:
        writer.close()
        result.written, result.error = writer.written, writer.error
        result.frames = writer.frames if writer.written else 0
    return result
