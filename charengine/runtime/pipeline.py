"""The in-process pipeline: three steps in flight, depth-one queues.

    rank 0 (decoder side):  encode audio i, hand it over; then decode latent i-1
    diffusion:              take audio i, denoise latent i, hand it over
    sink (caller's thread): take the frames of step i-2, write or play them

Every queue holds one item, so a slow stage holds the others back (backpressure). Each stage
records when it starts and ends each step on the host, and the busy time of its work where
it reports one (a stage's output as `Timed`: on a GPU the work a stage launches outlives its
call, so its host interval is not its time), and how long each step was held in the queues
behind the steps before it (`StepTimes.held`); a failure in any stage stops all of them and
is raised in the caller's thread.

A live session runs it in live mode (`live()`): the audio has a thread of its own, so a step
may wait for its speech (`await_audio(i)`, before the take) without holding back the decode
of the step before it, and the decoder hands each piece of a step's frames (each latent's, from
`decode_pieces`) to the sink as it is decoded, so a step's first frames play before its last
are decoded. A render (`run` without `live()`) is the plain pipeline above.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from charengine.timing import DeviceSpan


PARTS = ("audio", "diffusion", "decode")  # the stages whose busy time is reported
# how long a pipeline stopped by a KeyboardInterrupt (Ctrl-C) still waits for its stage
# threads: each stops at its next queue operation, within the step it runs; a hung one is
# left after this (any other stop waits for them as long as they run)
STAGES_JOIN_S = 10.0


@dataclass
class Timed:
    """A stage's output with the busy time of its work: a DeviceSpan (read when the work
    is done) or seconds (measured elsewhere: a TP rank's). A stage may return one; the
    pipeline records its time (StepTimes.busy) and hands the output on whole to the next
    stage (a diffusion's to the decoder, which waits for the span's `done`)."""
    value: object
    span: DeviceSpan | float

    def seconds(self, wait: bool = False) -> float | None:
        """The busy seconds (a DeviceSpan's: None while its work runs, unless `wait`)."""
        return self.span.seconds(wait) if isinstance(self.span, DeviceSpan) else self.span

    @property
    def done(self):
        """The event at the work's end for another stream to wait on (None off CUDA, and
        for seconds measured elsewhere)."""
        return self.span.done if isinstance(self.span, DeviceSpan) else None


@dataclass
class StepTimes:
    """Per step, in order: each stage's host interval (start, end) on perf_counter, which
    says when things happened and what overlapped (on a GPU a stage's host interval is its
    launch, or its launch and a wait, not its work), and `busy`, each stage's busy time (how
    long its work took on its device: GPU time on a GPU) as the stage reported it (PARTS; a
    DeviceSpan until read): the figures charrun reports (`busy_s`)."""
    audio: list[tuple[float, float]] = field(default_factory=list)
    diffusion: list[tuple[float, float]] = field(default_factory=list)
    decode: list[tuple[float, float]] = field(default_factory=list)
    sink: list[tuple[float, float]] = field(default_factory=list)
    # the decode's start and the end of its first piece (live mode; a render's is `decode`)
    first_piece: list[tuple[float, float]] = field(default_factory=list)
    # seconds each step was held in the queues on its way to the sink (its audio features
    # waiting for the diffusion stage, its latent for the decoder, its first frames for the
    # sink): behind the steps before it, not working (a step taken early, as a burst of
    # speech's are, waits so); until its first frames are at the sink, which may pop it
    held: dict[int, float] = field(default_factory=dict)
    busy: dict[str, list] = field(default_factory=lambda: {p: [] for p in PARTS})

    def add_busy(self, part: str, span) -> None:
        self.busy[part].append(span)

    def busy_step_s(self, part: str, i: int, wait: bool = False) -> float | None:
        """Step i's device seconds in `part` (None where not reported, or still running and
        not waited for)."""
        spans = self.busy[part]
        if i >= len(spans):
            return None
        x = spans[i]
        return x.seconds(wait) if isinstance(x, DeviceSpan) else x

    def busy_s(self, part: str) -> list[float]:
        """Every step's device seconds in `part`, its work waited for (after a run); the
        host intervals' lengths where the stage reported no busy time."""
        if not self.busy[part]:
            return [e - s for s, e in getattr(self, part)]
        return [self.busy_step_s(part, i, wait=True) for i in range(len(self.busy[part]))]


def _unwrap(times: StepTimes, part: str, out):
    """A stage's output with its busy time recorded (where it reported one)."""
    if isinstance(out, Timed):
        times.add_busy(part, out.span)
        return out.value
    return out


# what a stage gives: its output, or its output and its work's busy time
Staged = torch.Tensor | Timed


class Stopped(Exception):
    pass


class Pipeline:
    def __init__(self, encode_audio: Callable[[int], Staged | tuple[Staged, object]],
                 diffuse: Callable[[int, torch.Tensor], Staged],
                 decode: Callable[[Staged], Staged], poll_s: float = 0.05,
                 decode_pieces: Callable[[Staged], Iterator[Staged]] | None = None):
        """encode_audio(i) returns the step's audio features, or (features, meta): meta
        rides along with the step to the sink (sink(i, frames, meta) then). diffuse(i,
        features) gives the step's latent, which `decode` takes as diffuse gave it (a Timed
        whole: the decoder waits for its work's end). decode_pieces (optional): the step's
        frames from its latent in pieces, in order, for live mode (without it live mode
        hands on each step's frames whole, from `decode`)."""
        self.encode_audio, self.diffuse, self.decode = encode_audio, diffuse, decode
        self.decode_pieces = decode_pieces
        self.poll_s = poll_s
        self.is_live = False
        self.await_audio: Callable[[int], None] | None = None
        self.pieces = False
        self.times = StepTimes()
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.audio_q: queue.Queue = queue.Queue(maxsize=1)
        self.latent_q: queue.Queue = queue.Queue(maxsize=1)
        self.frame_q: queue.Queue = queue.Queue(maxsize=1)

    def _put(self, q: queue.Queue, item) -> None:
        while not self.stop.is_set():
            try:
                q.put(item, timeout=self.poll_s)
                return
            except queue.Full:
                pass
        raise Stopped

    def _get(self, q: queue.Queue):
        while not self.stop.is_set():
            try:
                return q.get(timeout=self.poll_s)
            except queue.Empty:
                pass
        raise Stopped

    def _timed(self, log: list, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        log.append((t0, time.perf_counter()))
        return out

    def _held(self, i: int, since: float, until: float | None = None) -> None:
        """Step i waited in a queue from `since` until `until` (now where not given)."""
        until = time.perf_counter() if until is None else until
        self.times.held[i] = self.times.held.get(i, 0.0) + max(0.0, until - since)

    def _latent_held(self, i: int, latent, diffused: tuple[float, float],
                     until: float | None = None) -> None:
        """Step i's latent waited for the decoder from when its work was done: the end of
        the diffusion call that gave it (`diffused`, the call's host interval), or on a device
        the call's start plus its busy time where that is later (the work runs on while the
        latent waits); nothing if its work still ran when taken."""
        started, handed = diffused
        busy = latent.seconds() if isinstance(latent, Timed) else 0.0
        if busy is not None:
            self._held(i, max(handed, started + busy), until)

    def _guard(self, fn):
        def run():
            try:
                with torch.inference_mode():
                    fn()
            except Stopped:
                pass
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                self.errors.append(e)
                self.stop.set()
        return run

    def live(self, await_audio: Callable[[int], None] | None = None,
             pieces: bool = True) -> Pipeline:
        """Live mode (before `run`): the audio on a thread of its own, each step's take after
        await_audio(i) returns (it raises Stopped to end the pipeline); with `pieces`, the
        sink is called once per piece of a step's frames (sink(i, piece, meta), the pieces in
        order), else once per step. Returns the pipeline."""
        self.is_live, self.await_audio = True, await_audio
        self.pieces = pieces and self.decode_pieces is not None
        return self

    def flush_audio(self) -> int:
        """Barge-in: drop encoded audio of steps not yet started; returns how many."""
        dropped = 0
        while True:
            try:
                self.audio_q.get_nowait()
                dropped += 1
            except queue.Empty:
                return dropped

    def _rank0(self, steps: int | None) -> None:
        i = 0
        while steps is None or i <= steps:
            if steps is None or i < steps:
                self._encode(i)
            if i >= 1:
                j, latent, meta, diffused = self._get(self.latent_q)
                self._latent_held(j, latent, diffused)
                frames = _unwrap(self.times, "decode",
                                 self._timed(self.times.decode, self.decode, latent))
                self._put(self.frame_q, (j, frames, meta, True, time.perf_counter()))
            i += 1

    def _audio(self, steps: int | None) -> None:
        i = 0
        while steps is None or i < steps:
            if self.await_audio is not None:
                self.await_audio(i)
            self._encode(i)
            i += 1

    def _encode(self, i: int) -> None:
        """Step i's audio features (and meta) onto the audio queue."""
        out = self._timed(self.times.audio, self.encode_audio, i)
        if isinstance(out, tuple):
            out = (_unwrap(self.times, "audio", out[0]), out[1])
        else:
            out = (_unwrap(self.times, "audio", out), None)
        self._put(self.audio_q, (i, out, time.perf_counter()))

    def _decoder(self, steps: int | None) -> None:
        i = 0
        while steps is None or i < steps:
            j, latent, meta, diffused = self._get(self.latent_q)
            t0 = time.perf_counter()
            self._latent_held(j, latent, diffused, t0)
            pieces = self.decode_pieces(latent) if self.pieces else iter((self.decode(latent),))
            busy = 0.0
            for k, frames in enumerate(pieces):
                if k == 0:
                    self.times.first_piece.append((t0, time.perf_counter()))
                if isinstance(frames, Timed):  # each piece's work is done when it is handed on
                    busy += frames.seconds(wait=True)
                    frames = frames.value
                self._put(self.frame_q, (j, frames, meta, False, time.perf_counter()))
            self.times.decode.append((t0, time.perf_counter()))
            self.times.add_busy("decode", busy)
            self._put(self.frame_q, (j, None, meta, True, None))  # the step's end
            i += 1

    def _diffusion(self, steps: int | None) -> None:
        i = 0
        while steps is None or i < steps:
            j, (feats, meta), ready = self._get(self.audio_q)
            self._held(j, ready)
            latent = self._timed(self.times.diffusion, self.diffuse, j, feats)
            if isinstance(latent, Timed):  # read once the decoder has waited for it
                self.times.add_busy("diffusion", latent.span)
            # with the call's host interval: on a device its work ends later than the call
            # (the decoder reads the work's end from the call's start and its busy time)
            self._put(self.latent_q, (j, latent, meta, self.times.diffusion[-1]))
            i += 1

    def run(self, steps: int | None, sink: Callable) -> StepTimes:
        """Run `steps` AR steps (None: until stop is set); `sink(i, frames)` (or
        sink(i, frames, meta) when encode_audio gives meta) is called in this thread, in
        order (in live mode with pieces, once per piece; `times.sink` has each step's first
        call)."""
        stages = [("diffusion", self._diffusion)]
        stages += [("audio", self._audio), ("decode", self._decoder)] if self.is_live \
            else [("rank0", self._rank0)]
        threads = [threading.Thread(target=self._guard(lambda f=f: f(steps)), name=name)
                   for name, f in stages]
        for t in threads:
            t.start()
        interrupted = False
        try:
            done, first = 0, True
            while steps is None or done < steps:
                # a step's frames whole or a piece of them, and when they were ready for the sink;
                # (j, None, meta, True, None): its end
                j, frames, meta, ends, ready = self._get(self.frame_q)
                if frames is not None:
                    if first:
                        self._held(j, ready)
                    args = (j, frames) if meta is None else (j, frames, meta)
                    t0 = time.perf_counter()
                    sink(*args)
                    if first:
                        self.times.sink.append((t0, time.perf_counter()))
                    first = False
                if ends:
                    done, first = done + 1, True
        except Stopped:
            pass
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            self.stop.set()
            if join_through_interrupts(threads, interrupted):
                raise KeyboardInterrupt  # after the stages stopped, not in their midst
        if self.errors:
            raise self.errors[0]
        return self.times


def join_through_interrupts(threads: list[threading.Thread], interrupted: bool) -> bool:
    """Join `threads`, going on through a KeyboardInterrupt (a second Ctrl-C while they
    stop): a process that exits with a stage still inside a torch op aborts ("terminate
    called without an active exception"). They are waited for as long as they run, or, once
    a KeyboardInterrupt came (`interrupted`: before the join), STAGES_JOIN_S from then.
    Returns whether one came during the join."""
    caught, end = False, time.monotonic() + STAGES_JOIN_S if interrupted else None
    for t in threads:
        while t.is_alive() and (end is None or time.monotonic() < end):
            try:
                t.join(None if end is None else max(0.0, end - time.monotonic()))
            except KeyboardInterrupt:
                caught = True
                end = end if end is not None else time.monotonic() + STAGES_JOIN_S
    return caught
