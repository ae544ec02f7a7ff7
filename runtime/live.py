"""A live session: speech arrives while the character streams. Between turns the character
listens (silent audio); a barge-in drops the turn's queued speech, the steps not yet started
and the frames not yet played, and returns it to listening.

Speech is 16 kHz mono. Step i takes the next step's worth of samples from the speech buffer
(silence when it is empty) when rank 0 encodes its audio; the pacer's backpressure keeps the
generator at most a few steps ahead of playback.
"""

from __future__ import annotations

import logging
import threading
import time

import torch


from .metrics import Metrics
from .pacer import Pacer, Step
from .pipeline import Pipeline
from .worker import Worker

log = logging.getLogger("charengine.live")


class SpeechBuffer:
    """Queued speech: sample chunks, and None where a turn's audio ends."""

    def __init__(self):
        self.lock = threading.Lock()
        self.chunks: list[torch.Tensor | None] = []

    def push(self, samples: torch.Tensor) -> None:
        with self.lock:
            self.chunks.append(samples.float().flatten())

    def end_segment(self) -> None:
        with self.lock:
            self.chunks.append(None)

    def clear(self) -> None:
        with self.lock:
            self.chunks.clear()

    def take(self, n: int) -> tuple[torch.Tensor, bool, bool]:
        """n samples of speech, padded with silence; voiced if any speech was in them; ended
        if a turn's end was reached in them (the rest of the turn, if any, waits)."""
        ended = False
        with self.lock:
            got, have = [], 0
            while self.chunks and have < n:
                c = self.chunks[0]
                if c is None:
                    self.chunks.pop(0)
                    ended = True
                    break
                part = c[: n - have]
                got.append(part)
                have += part.numel()
                if part.numel() == c.numel():
                    self.chunks.pop(0)
                else:
                    self.chunks[0] = c[part.numel():]
            if not ended and self.chunks and self.chunks[0] is None:
                self.chunks.pop(0)
                ended = True
        voiced = have > 0
        out = torch.cat(got) if got else torch.zeros(0)
        return torch.nn.functional.pad(out, (0, n - out.numel())), voiced, ended


class LiveSession:
    def __init__(self, worker: Worker, publish, slack: int = 2, metrics: Metrics | None = None,
                 seed: int = 0, session_id: str = "", on_step_done=None, on_error=None):
        """publish(frame [3, H, W], audio [samples at 16 kHz], t, voiced) runs on the pacer's
        thread at each frame's time; on_error(message) runs on the session's thread when the
        session fails (a rank died, the decoder failed), once, after it has stopped."""
        self.worker, self.spec = worker, worker.spec
        self.metrics, self.seed, self.session_id = metrics, seed, session_id
        self.speech = SpeechBuffer()
        self.family = worker.family
        self.history = torch.zeros(self.family.window_samples(self.spec))
        # speech taken but not yet played: a step's audio window reaches `lookahead` samples
        # past its frames, so playback runs that far behind what the encoder has heard
        self.lookahead = self.family.lookahead_samples(self.spec)
        self.unplayed = torch.zeros(0)
        self.epoch = 0  # bumped by each barge-in; steps carry the epoch they were encoded in
        self.epoch_lock = threading.Lock()
        self.pacer = Pacer(publish, self.spec.fps, self.spec.frames_per_latent, slack,
                           on_frame=metrics.frame if metrics else None, on_step_done=on_step_done)
        self.pipeline: Pipeline | None = None
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.on_error = on_error
        self.stopping = False

    # ---- control (any thread) ---------------------------------------------------------
    def start(self, image: torch.Tensor, prompt: str = "") -> None:
        self.worker.start(image, prompt)
        if self.metrics:
            self.metrics.session_started()
        self.pipeline = self.worker.pipeline(self._encode_audio, seed=self.seed)
        self.thread = threading.Thread(target=self._run, name="live-session", daemon=True)
        self.thread.start()

    def say(self, samples: torch.Tensor) -> None:
        self.speech.push(samples)

    def end_turn(self) -> None:
        """The current turn's audio is complete; the step that plays its end says so."""
        self.speech.end_segment()

    def interrupt(self) -> float:
        """Barge-in; returns its time on the pacer's clock."""
        with self.epoch_lock:
            self.epoch += 1
            self.speech.clear()
        if self.pipeline is not None:
            self.pipeline.flush_audio()
        return self.pacer.flush()

    def stop(self) -> float | None:
        """End the session; returns its average fps as the metrics saw it."""
        self.stopping = True
        if self.pipeline is not None:
            self.pipeline.stop.set()
        self.pacer.close()  # wakes a sink waiting in push()
        if self.thread is not None:
            self.thread.join()
        return self.metrics.session_finished(self.session_id) if self.metrics else None

    # ---- pipeline side ----------------------------------------------------------------
    def _encode_audio(self, i: int):
        a, b = self.family.step_bounds(self.spec, i)
        take = b - a + (self.lookahead if i == 0 else 0)
        with self.epoch_lock:
            heard, voiced, ended = self.speech.take(take)
            epoch = self.epoch
        self.history = torch.cat([self.history, heard])[-self.history.numel():]
        feats = self.worker.on_side_stream(lambda x: self.family.encode_audio(
            self.worker.side, self.spec, x.to(self.worker.decoder_device), i), self.history)
        self.unplayed = torch.cat([self.unplayed, heard])
        chunk, self.unplayed = self.unplayed[: b - a], self.unplayed[b - a:]
        return feats, (chunk, voiced, ended, epoch)

    def _sink(self, i: int, frames: torch.Tensor, meta) -> None:
        chunk, voiced, ended, epoch = meta
        if self.metrics and len(self.pipeline.times.diffusion) > i:
            t0, t1 = self.pipeline.times.diffusion[i]
            self.metrics.step.observe(t1 - t0)
        if epoch < self.epoch:
            return  # generated for speech a barge-in cancelled
        self.pacer.push(Step(frames, chunk, voiced, ended))

    def _run(self) -> None:
        try:
            self.pipeline.run(None, self._sink)
        except BaseException as e:  # noqa: BLE001 - the session ends; the cause is kept and logged
            self.error = e
            log.error("live session %s failed: %s", self.session_id, e)
            if self.on_error is not None and not self.stopping:
                self.on_error(str(e))


def wait_until(pred, timeout: float, poll: float = 0.01) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(poll)
    return pred()
