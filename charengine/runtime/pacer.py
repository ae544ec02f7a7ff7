"""The pacer: plays finished steps at the frame rate on one clock (runtime/clock.py), each
frame with its slice of the step's audio. On an underrun it holds the last frame and shifts
its schedule by the delay (runtime/playout.py); it never drops a frame, except on a
barge-in, which drops every frame not yet played.

A step may come in pieces (a live session pushes each latent's frames as they are decoded,
the last piece marked `last`): each piece takes the next slot of its own, so a step's first
frames play before its last are decoded.

Backpressure: push() returns once at most slack - 1 steps' worth of frames (slack - 1 times
frames_per_step) wait to play, so with slack s the generator starts step k only after step
k - s has started playing (a step counts as started when the pacer takes it, right after the
previous step's last frame).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch

from .clock import Clock, MonotonicClock
from .playout import Playout


@dataclass
class Step:
    frames: torch.Tensor  # [frames_per_step, 3, H, W]
    audio: torch.Tensor  # [samples] for the whole step
    voiced: bool = False
    segment_end: bool = False  # a turn's audio ends within this step
    last: bool = True  # the step's last piece (a step pushed whole is its own last piece)


def split_audio(audio: torch.Tensor, parts: int) -> list[torch.Tensor]:
    n = audio.numel()
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [audio[bounds[i]: bounds[i + 1]] for i in range(parts)]


class Pacer:
    def __init__(self, publish: Callable[[torch.Tensor, torch.Tensor, float, bool], None],
                 fps: float = 24.0, frames_per_step: int = 4, slack: int = 2,
                 clock: Clock | None = None, on_frame=None, on_step_done=None):
        """publish(frame [3, H, W], audio [samples], t, voiced) is called at each frame's time
        t on `clock` (runtime/clock.py; the monotonic clock by default), never after a flush()
        has returned for a frame taken before it (the frame's publish and the flush exclude
        each other). on_frame(t, slot) (optional) sees each frame's time and its slot;
        on_step_done(step) (optional) runs after the last frame of each step or piece pushed
        (not after a flush)."""
        if slack < 1:
            raise ValueError("slack must be at least 1")
        self.publish, self.fps, self.slack = publish, fps, slack
        self.clock = MonotonicClock() if clock is None else clock
        self.frames_per_step = frames_per_step
        self.on_frame, self.on_step_done = on_frame, on_step_done
        self.playout = Playout(fps, frames_per_step)
        self.queue: list[Step] = []
        self.frames_started = 0  # frames of the steps (and pieces) taken to play so far
        self.cv = threading.Condition()
        self.closed = False
        self.epoch = 0  # bumped by flush(): the playing step stops
        self.playing = False
        self.thread = threading.Thread(target=self._run, name="pacer", daemon=True)
        self.thread.start()

    # ---- producer side ---------------------------------------------------------------
    def queued_frames(self) -> int:
        """Frames pushed and not yet taken to play (the caller holds `cv`)."""
        return sum(s.frames.shape[0] for s in self.queue)

    def queued_steps(self) -> int:
        """Steps waiting to play, whole or in part."""
        with self.cv:
            return sum(s.last for s in self.queue) + (bool(self.queue) and
                                                      not self.queue[-1].last)

    def schedule(self) -> tuple[float | None, int]:
        """(the slot of the next frame to be taken to play, None before the first; the frames
        taken to play so far): a frame pushed f frames after those plays at slot + f / fps,
        unless playback stalls first."""
        with self.cv:
            return self.playout.next_slot, self.frames_started

    def push(self, step: Step, timeout: float | None = None) -> bool:
        """Queue a finished step (or piece); wait until at most slack - 1 steps' worth of
        frames wait to play. False if the pacer closed or the wait timed out."""
        limit = (self.slack - 1) * self.frames_per_step
        with self.cv:
            if self.closed:
                return False
            self.queue.append(step)
            self.cv.notify_all()
            return self.cv.wait_for(lambda: self.closed or self.queued_frames() <= limit,
                                    timeout) and not self.closed

    def flush(self) -> float:
        """Barge-in: drop every queued step and the rest of the playing one. Returns the
        time of the flush on the pacer's clock."""
        with self.cv:
            self.epoch += 1
            self.queue.clear()
            now = self.clock.now()
            self.playout.restart_at(now)
            self.cv.notify_all()
            return now

    def close(self, drain: bool = False) -> None:
        """Stop; with drain, first play what is queued."""
        with self.cv:
            if drain:
                self.cv.wait_for(lambda: not self.queue and not self.playing)
            self.closed = True
            self.cv.notify_all()
        self.thread.join()

    # ---- the playing thread ----------------------------------------------------------
    def _sleep_until(self, t: float, epoch: int) -> bool:
        """Wait until clock t; False if closed or flushed meanwhile."""
        with self.cv:
            return not self.clock.wait_until(
                self.cv, lambda: self.closed or self.epoch != epoch, t)

    def _run(self) -> None:
        while True:
            with self.cv:
                self.clock.wait_until(self.cv, lambda: self.closed or bool(self.queue), None)
                if self.closed:
                    return
                step = self.queue.pop(0)
                self.playing = True
                epoch = self.epoch
                begin = self.playout.start(self.clock.now(), step.frames.shape[0])
                self.frames_started += step.frames.shape[0]
                self.cv.notify_all()
            audio = split_audio(step.audio, step.frames.shape[0])
            for j in range(step.frames.shape[0]):
                slot = begin + j / self.fps
                if not self._sleep_until(slot, epoch):
                    break
                with self.cv:  # a flush now waits for this frame, then nothing more plays
                    if self.epoch != epoch:
                        break
                    t = self.clock.now()
                    self.publish(step.frames[j], audio[j], t, step.voiced)
                if self.on_frame is not None:
                    self.on_frame(t, slot)
            else:
                if self.on_step_done is not None:
                    self.on_step_done(step)
            with self.cv:
                self.playing = False
                self.cv.notify_all()
