"""A live session: speech arrives while the character streams. Between turns the character
listens (silent audio); a barge-in drops the turn's queued speech, the steps not yet started
and the frames not yet played, and returns it to listening.

Speech is 16 kHz mono. Step i takes the next step's worth of samples from the speech buffer
(its frames' speech, and for step 0 also the lookahead its audio window reaches past them),
padded with silence for what has not arrived. Just in time (the default), the take waits
until that speech has arrived (or the turn ended), or until its deadline, whichever comes
first: the step's play slot (when the frames queued and in flight before it will have
played) less the session's processing time (take to first frames at the pacer, less the
time the step was held in the pipeline's queues behind the steps before it, as the steps of
a burst of speech, taken early, are; the most of the last `PROCESSING_WINDOW` steps after
the first; once a step of the steady shape has been measured, of those alone:
`Family.steady_from`, as a LiveTalk session's cache-filling chunks take longer) and a
margin. So a silent or stalled
microphone never starves playback, and speech waits in no queue: from a step's last speech
to its first frame is the processing time and the margin. The first step is taken at once
(the character shows as soon as it can); until a later step's processing time is known, the
deadlines use the worker's measure of a steady step's (`Worker.time_processing`, measured at
ready on a GPU), else the first step's. (The first step's is the longer: a session's first
decode gives more frames. Speech that arrives from the session's first moment fills the
steps after it up to their deadlines, so the time the deadline assumes sets the latency
those steps' speech plays at until a pause brings it back.) The decoder hands on each
latent's frames as they are decoded (where the family's decoder streams latent by latent)
and the pacer plays them as they come. Without
`just_in_time` a step takes its speech when the pipeline asks for it, and the pacer's
backpressure keeps the generator at most a few steps ahead of playback.

The session reports to its Metrics what the page and /metrics show: each step's diffusion
time, each frame against its slot, stalls (a step at least a frame late; a barge-in's gap
is not one), the steps and frames queued, and the latency from speech reaching the session
to the frame that plays it (measured for speech that arrives to an empty buffer: an uploaded
clip's first sample, and the microphone's audio as it streams). Its state (`STATES`) is told
to `on_state`.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from dataclasses import dataclass, field

import torch


from .metrics import Metrics
from .pacer import Pacer, Step
from .pipeline import Pipeline, Stopped
from .worker import Worker

log = logging.getLogger("charengine.live")

# starting: the session is opening, no frame has played; speaking: the playing frame carries
# speech; listening: it is silent between turns; interrupted: a barge-in dropped the turn and
# no speech has played since; ended: the session stopped
STATES = ("starting", "speaking", "listening", "interrupted", "ended")
MIN_STALL_FRAMES = 1.0  # a step this many frame times late holds a frame visibly: a stall
# steps whose processing times (take to first frames) the deadline covers: more than the
# characters family's position-reset period (42 steps), so a reset step's extra time stays in
# the window
PROCESSING_WINDOW = 64
DEADLINE_MARGIN_FRAMES = 0.5  # frame times between a step's first frames and its slot
WAIT_POLL_S = 0.05  # a take waiting for its speech looks at its deadline at least this often
# speech complete this many frame times before its deadline plays that much later than it
# could: leading silence is dropped from the buffer until it is RESYNC_KEEP_FRAMES early (a
# pause brings the latency back to the processing time, the margin and that much)
RESYNC_LEAD_FRAMES = 2.0
RESYNC_KEEP_FRAMES = 1.0
SILENCE_LEVEL = 1e-3  # samples at most this loud (about -60 dBFS) are silence that may be dropped
MAX_QUEUED_SPEECH_S = 900.0  # speech waiting to play: an upload's most and five minutes more


class SpeechBuffer:
    """Queued speech: sample chunks, and None where a turn's audio ends. Speech pushed while
    nothing waits is marked with its arrival time (`clock`), for the latency to its frames."""

    def __init__(self, clock=time.monotonic):
        self.lock = threading.Lock()
        self.arrived = threading.Condition(self.lock)  # notified on every push, end and clear
        self.clock = clock
        self.chunks: list[torch.Tensor | None] = []
        self.chunk_times: list[float] = []  # when each of `chunks` was pushed
        self.pushed = 0  # samples pushed so far
        self.taken = 0  # samples taken (or cleared, or dropped) so far
        self.dropped = 0  # leading silence dropped so far (drop_silence)
        self.marks: list[tuple[int, float]] = []  # (sample index, arrival time)
        self.voiced = False  # whether the last take found speech (take)

    def push(self, samples: torch.Tensor) -> None:
        samples = samples.float().flatten()
        with self.lock:
            now = self.clock()
            if self.pushed == self.taken and samples.numel():
                self.marks.append((self.pushed, now))
            self.chunks.append(samples)
            self.chunk_times.append(now)
            self.pushed += samples.numel()
            self.arrived.notify_all()

    def end_segment(self) -> None:
        with self.lock:
            self.chunks.append(None)
            self.chunk_times.append(self.clock())
            self.arrived.notify_all()

    def clear(self) -> None:
        with self.lock:
            self.chunks.clear()
            self.chunk_times.clear()
            self.marks.clear()
            self.taken = self.pushed
            self.arrived.notify_all()

    def wake(self) -> None:
        """Wake a wait_for (its deadline may have moved)."""
        with self.lock:
            self.arrived.notify_all()

    def drop_silence(self, most: int, level: float = SILENCE_LEVEL) -> int:
        """Drop up to `most` samples of silence (none louder than `level`) from the front,
        up to the first louder sample or a turn's end; returns how many. Speech that
        arrived while nothing waited keeps its mark: if silence marked so is dropped, the
        first sample left is marked with its own arrival."""
        with self.lock:
            dropped = 0
            while self.chunks and self.chunks[0] is not None and dropped < most:
                c = self.chunks[0][: most - dropped]
                loud = (c.abs() > level).nonzero()
                k = int(loud[0]) if loud.numel() else c.numel()
                dropped += k
                if k < self.chunks[0].numel():
                    self.chunks[0] = self.chunks[0][k:]
                    if loud.numel():
                        break
                else:
                    self.chunks.pop(0)
                    self.chunk_times.pop(0)
            self.taken += dropped
            self.dropped += dropped
            kept = [(i, t) for i, t in self.marks if i >= self.taken]
            if len(kept) < len(self.marks) and self.chunks and self.chunks[0] is not None \
                    and not (kept and kept[0][0] == self.taken):
                kept.insert(0, (self.taken, self.chunk_times[0]))
            self.marks = kept
            return dropped

    def queued(self) -> int:
        """Samples waiting, up to a turn's end."""
        with self.lock:
            return self._ahead()[0]

    def _ahead(self) -> tuple[int, bool]:
        """(samples waiting up to a turn's end, whether a turn's end is queued); under the
        lock."""
        have = 0
        for c in self.chunks:
            if c is None:
                return have, True
            have += c.numel()
        return have, False

    def _has(self, n: int) -> bool:
        have, ended = self._ahead()
        return ended or have >= n  # a turn's end: nothing more comes for this take

    def wait_for(self, n: int, timeout: float) -> bool:
        """Whether a take of n samples would find them all (or a turn's end) within
        `timeout` seconds; returns at once when it would."""
        with self.lock:
            if not self._has(n):
                self.arrived.wait(timeout)
            return self._has(n)

    def take(self, n: int) -> tuple[torch.Tensor, bool, bool, list[tuple[int, float]]]:
        """n samples of speech, padded with silence; voiced if any speech was in them; ended
        if a turn's end was reached in them (the rest of the turn, if any, waits); and the
        arrival marks within them as (offset in the n samples, arrival time).

        The silence goes after the speech, except where a take after one that found no
        speech finds only the start of the next (a turn's first words, arriving in real
        time, at a take's deadline) and no turn's end: then it goes before, so that the
        speech still to come follows on without a gap (padding after it would play its
        first syllable, most of a chunk of silence, then the rest)."""
        ended = False
        with self.lock:
            got, have = [], 0
            while self.chunks and have < n:
                c = self.chunks[0]
                if c is None:
                    self.chunks.pop(0)
                    self.chunk_times.pop(0)
                    ended = True
                    break
                part = c[: n - have]
                got.append(part)
                have += part.numel()
                if part.numel() == c.numel():
                    self.chunks.pop(0)
                    self.chunk_times.pop(0)
                else:
                    self.chunks[0] = c[part.numel():]
            if not ended and self.chunks and self.chunks[0] is None:
                self.chunks.pop(0)
                self.chunk_times.pop(0)
                ended = True
            start, self.taken = self.taken, self.taken + have
            marks = [(i - start, t) for i, t in self.marks if i < self.taken]
            self.marks = [(i, t) for i, t in self.marks if i >= self.taken]
        voiced = have > 0
        out = torch.cat(got) if got else torch.zeros(0)
        after_silence, self.voiced = not self.voiced, voiced
        if after_silence and 0 < have < n and not ended:  # a turn's first words
            marks = [(i + n - have, t) for i, t in marks]
            return torch.nn.functional.pad(out, (n - have, 0)), voiced, ended, marks
        return torch.nn.functional.pad(out, (0, n - out.numel())), voiced, ended, marks


@dataclass
class LiveStep(Step):
    """A step for the pacer with the speech arrivals it plays: (sample offset in its audio,
    arrival time)."""
    arrivals: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class TakenSpeech:
    """What a step took from the speech buffer, riding with it to the sink: the speech its
    frames play, whether any was speech, whether a turn ended in it, the barge-in epoch it was
    taken in, the arrivals it plays (sample offset, arrival time), and when it was taken."""
    chunk: torch.Tensor
    voiced: bool
    ended: bool
    epoch: int
    arrivals: list[tuple[int, float]]
    taken_t: float


class LiveSession:
    def __init__(self, worker: Worker, publish, slack: int = 2, metrics: Metrics | None = None,
                 seed: int = 0, session_id: str = "", on_step_done=None, on_error=None,
                 on_state=None, just_in_time: bool = True, stream_decode: bool = True,
                 processing_estimate: float | None = None):
        """publish(frame [3, H, W], audio [samples at 16 kHz], t, voiced) runs on the pacer's
        thread at each frame's time; on_error(message) runs on the session's thread when the
        session fails (a rank died, the decoder failed), once, after it has stopped;
        on_state(state) (one of STATES) runs on the thread that changed it (the pacer's, or
        the caller of interrupt() and stop()); on_step_done(step) after each step's last
        frame. `just_in_time`: each step takes its speech once it has arrived or at its
        deadline (the module's doc), on a thread of its own; `stream_decode`: each latent's
        frames go to the pacer as they are decoded. Both off: the plain pipeline of a
        render, each step's speech taken when the pipeline asks for it.
        `processing_estimate`: a steady step's processing time (seconds) for the deadlines
        before one is measured; the worker's (`processing_s`) where not given."""
        self.worker, self.spec = worker, worker.spec
        self.just_in_time, self.stream_decode = just_in_time, stream_decode
        self.metrics, self.seed, self.session_id = metrics, seed, session_id
        self.speech = SpeechBuffer()
        self.overflowed = False  # say() has dropped speech past MAX_QUEUED_SPEECH_S
        self.family = worker.family
        self.history = torch.zeros(self.family.window_samples(self.spec))
        # speech taken but not yet played: a step's audio window reaches `lookahead` samples
        # past its frames, so playback runs that far behind what the encoder has heard
        self.lookahead = self.family.lookahead_samples(self.spec)
        self.unplayed = torch.zeros(0)
        self.heard = 0  # samples taken into `unplayed` so far
        self.played = 0  # samples handed to steps so far (the start of `unplayed`)
        self.arrivals: list[tuple[int, float]] = []  # (heard index, arrival time) not yet played
        self.epoch = 0  # bumped by each barge-in; steps carry the epoch they were encoded in
        self.epoch_lock = threading.Lock()
        self.publish, self.user_step_done = publish, on_step_done
        self.pipeline: Pipeline | None = None
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.on_error, self.on_state = on_error, on_state
        self.stopping = False
        self.state = "starting"
        self.state_lock = threading.Lock()
        self.count_lock = threading.Lock()
        self.frames_pushed = self.frames_played = 0
        self.last_frame_t = 0.0
        # just in time: frames of the steps taken (this epoch's, plus what the pacer had
        # started at the last barge-in), each step's processing time, the piece being sunk
        self.frames_committed = 0
        # (step, processing time) of the last steps after the first; once a step of the
        # steady shape is among them, the deadlines read only those (the cache's filling
        # steps can take longer)
        self.processing: collections.deque[tuple[int, float]] = \
            collections.deque(maxlen=PROCESSING_WINDOW)
        self.steady_from = self.family.steady_from(worker.cfg)
        self.first_processing: float | None = None  # step 0's (its decode is unlike others')
        self.estimate = processing_estimate if processing_estimate is not None \
            else worker.processing_s
        self.sinking = (-1, 0)  # (step, its frames sunk so far)
        # why each of the last steps was taken when it was, just in time: "speech" (it had
        # all arrived, or a turn's end) or "deadline" (it had not: a silent microphone, or
        # speech arriving late)
        self.take_reasons: collections.deque[str] = collections.deque(maxlen=PROCESSING_WINDOW)
        self.stalls_seen = 0
        self.flush_slots: set[float] = set()  # barge-in restarts: the gap after one is no stall
        self.pacer = Pacer(self._publish, self.spec.fps, self.spec.frames_per_latent, slack,
                           on_frame=self._frame, on_step_done=self._step_done)

    # ---- control (any thread) ---------------------------------------------------------
    def start(self, image: torch.Tensor, prompt: str = "") -> None:
        self.worker.start(image, prompt)
        if self.metrics:  # this session's own, fed into the worker's
            self.metrics = self.metrics.session(self.session_id)
        self.pipeline = self.worker.pipeline(self._encode_audio, seed=self.seed)
        if self.just_in_time or self.stream_decode:
            self.pipeline.live(self._await_speech if self.just_in_time else None,
                               pieces=self.stream_decode)
        self.thread = threading.Thread(target=self._run, name="live-session", daemon=True)
        self.thread.start()

    def say(self, samples: torch.Tensor) -> None:
        """Queue speech (16 kHz mono); past MAX_QUEUED_SPEECH_S waiting, the rest is dropped
        (a client sending faster than it speaks), and the log says so once."""
        room = int(MAX_QUEUED_SPEECH_S * self.spec.side.sample_rate) - self.speech.queued()
        if samples.numel() > room:
            if not self.overflowed:
                log.warning("live session %s: more than %g s of speech queued; dropping what "
                            "comes faster than it plays", self.session_id, MAX_QUEUED_SPEECH_S)
            self.overflowed = True
            samples = samples.flatten()[: max(0, room)]
        self.speech.push(samples)

    def end_turn(self) -> None:
        """The current turn's audio is complete; the step that plays its end says so."""
        self.speech.end_segment()

    def interrupt(self) -> float:
        """Barge-in; returns its time on the pacer's clock."""
        with self.epoch_lock:  # no step is taken until the frames in flight are given back
            self.epoch += 1
            self.speech.clear()
            self.arrivals.clear()
            if self.pipeline is not None:
                self.pipeline.flush_audio()
            t = self.pacer.flush()
            _, started = self.pacer.schedule()
            with self.count_lock:
                self.flush_slots.add(t)
                self.frames_pushed = self.frames_played
                self.frames_committed = started
        self._queued()
        self._set_state("interrupted")
        return t

    def stop(self) -> float | None:
        """End the session; returns its average fps as the metrics saw it."""
        self.stopping = True
        if self.pipeline is not None:
            self.pipeline.stop.set()
        self.pacer.close()  # wakes a sink waiting in push()
        if self.thread is not None:
            self.thread.join()
        self._set_state("ended")
        return self.metrics.session_finished(self.session_id) if self.metrics else None

    def _set_state(self, state: str, only_from: tuple[str, ...] | None = None) -> None:
        with self.state_lock:
            if self.state == state or self.state == "ended" or \
                    (only_from is not None and self.state not in only_from):
                return
            self.state = state
        if self.on_state is not None:
            self.on_state(state)

    # ---- pipeline side ----------------------------------------------------------------
    def take_size(self, i: int) -> int:
        a, b = self.family.step_bounds(self.spec, i)
        return b - a + (self.lookahead if i == 0 else 0)

    def deadline(self) -> float:
        """When the next step must take its speech, on the pacer's clock: its slot (the
        frames taken before it played from the pacer's next slot on) less the processing
        time and the margin. -inf for the first step; inf until the first step's frames
        are at the pacer."""
        next_slot, started = self.pacer.schedule()
        with self.count_lock:
            ahead = max(0, self.frames_committed - started)
            if not self.processing and self.first_processing is None:
                return -math.inf if ahead == 0 else math.inf
            if self.processing:
                steady = [t for i, t in self.processing if i >= self.steady_from]
                processing = max(steady or [t for _, t in self.processing])
            else:
                processing = self.estimate if self.estimate is not None \
                    else self.first_processing
        now = self.pacer.clock.now()
        base = now if next_slot is None else max(now, next_slot)
        return base + (ahead - DEADLINE_MARGIN_FRAMES) / self.spec.fps - processing

    def _await_speech(self, i: int) -> None:
        """Until step i's speech has arrived or its deadline has come (the audio thread);
        why is kept in `take_reasons`."""
        self.take_reasons.append(self._wait_for_speech(i))

    def _wait_for_speech(self, i: int) -> str:
        """Wait until step i's speech has arrived ("speech") or its deadline has come
        ("deadline"). Live speech (arriving as it is taken: no more than a frame's worth
        queued past the take) complete well before its deadline plays later than it needs to
        (the phase a session's start or a slow step left): its leading silence is dropped
        and the wait goes on, so the latency comes back to the processing time in a pause."""
        n = self.take_size(i)
        sample_rate = self.spec.side.sample_rate
        while not self.pipeline.stop.is_set():
            left = self.deadline() - self.pacer.clock.now()
            if left <= 0:
                return "deadline"
            if self.speech.wait_for(n, min(left, WAIT_POLL_S)):
                lead = self.deadline() - self.pacer.clock.now()
                if not (math.isfinite(lead) and lead > RESYNC_LEAD_FRAMES / self.spec.fps):
                    return "speech"
                if self.speech.queued() - n > sample_rate / self.spec.fps:
                    return "speech"  # not speech arriving live (an uploaded clip): all plays
                excess = lead - RESYNC_KEEP_FRAMES / self.spec.fps
                if not self.speech.drop_silence(int(excess * sample_rate)):
                    return "speech"
        raise Stopped

    def _encode_audio(self, i: int):
        a, b = self.family.step_bounds(self.spec, i)
        take = self.take_size(i)
        with self.epoch_lock:
            heard, voiced, ended, marks = self.speech.take(take)
            taken_t = self.pacer.clock.now()
            epoch = self.epoch
            with self.count_lock:
                self.frames_committed += self.family.step_frames(self.spec, i)
            self.arrivals += [(self.heard + k, t) for k, t in marks]
            self.heard += heard.numel()
            end = self.played + (b - a)
            arrivals = [(k - self.played, t) for k, t in self.arrivals if k < end]
            self.arrivals = [(k, t) for k, t in self.arrivals if k >= end]
            self.played = end
        self.history = torch.cat([self.history, heard])[-self.history.numel():]
        feats = self.worker.on_side_stream(lambda x: self.family.encode_audio(
            self.worker.side, self.spec, x.to(self.worker.decoder_device), i), self.history,
            timed=True)
        self.unplayed = torch.cat([self.unplayed, heard])
        chunk, self.unplayed = self.unplayed[: b - a], self.unplayed[b - a:]
        return feats, TakenSpeech(chunk, voiced, ended, epoch, arrivals, taken_t)

    def _sink(self, i: int, frames: torch.Tensor, taken: TakenSpeech) -> None:
        """Step i's frames, whole or the next piece of them (the session's thread)."""
        total = self.family.step_frames(self.spec, i)
        step, done = self.sinking
        f0 = done if step == i else 0
        f1 = f0 + frames.shape[0]
        self.sinking = (i, f1)
        if f0 == 0:
            with self.count_lock:
                now = self.pacer.clock.now()
                took = now - taken.taken_t - self.pipeline.times.held.pop(i, 0.0)
                if i == 0:
                    self.first_processing = took
                else:
                    self.processing.append((i, took))
            self.speech.wake()  # the next take's deadline moved
            if self.metrics and i > 0:
                self.metrics.chunk_latency(took)
            busy = self.pipeline.times.busy_step_s("diffusion", i)
            if self.metrics and busy is not None:  # done: the decoder waited for it
                self.metrics.step_done(busy, total)
        if taken.epoch < self.epoch:
            return  # generated for speech a barge-in cancelled
        n = taken.chunk.numel()
        s0, s1 = round(f0 * n / total), round(f1 * n / total)
        arrivals = [(k - s0, t) for k, t in taken.arrivals
                    if s0 <= k < s1 or (f1 == total and k >= s1)]
        with self.count_lock:
            self.frames_pushed += frames.shape[0]
        self._queued()
        self.pacer.push(LiveStep(frames, taken.chunk[s0:s1], taken.voiced,
                                 taken.ended and f1 == total, f1 == total, arrivals))
        self._queued()

    def _run(self) -> None:
        try:
            self.pipeline.run(None, self._sink)
        except BaseException as e:  # noqa: BLE001 - the session ends; the cause is kept and logged
            self.error = e
            log.error("live session %s failed: %s", self.session_id, e)
            if self.on_error is not None and not self.stopping:
                self.on_error(str(e))

    # ---- the pacer's thread -----------------------------------------------------------
    def _publish(self, frame: torch.Tensor, audio: torch.Tensor, t: float, voiced: bool) -> None:
        self.publish(frame, audio, t, voiced)
        if voiced:
            self._set_state("speaking")
        else:
            self._set_state("listening", only_from=("starting", "speaking"))

    def _frame(self, t: float, slot: float) -> None:
        with self.count_lock:
            self.frames_played += 1
            self.last_frame_t = t
        if self.metrics is None:
            return
        self.metrics.frame(t, slot)
        stalls = self.pacer.playout.stalls
        while self.stalls_seen < len(stalls):
            start, length = stalls[self.stalls_seen]
            self.stalls_seen += 1
            if start not in self.flush_slots and length >= MIN_STALL_FRAMES / self.spec.fps:
                self.metrics.stall(length)
        self._queued()

    def _queued(self) -> None:
        if self.metrics is not None:
            with self.count_lock:
                frames = max(0, self.frames_pushed - self.frames_played)
            self.metrics.queued(self.pacer.queued_steps(), frames)

    def _step_done(self, step: Step) -> None:
        if self.metrics is not None and isinstance(step, LiveStep) and step.arrivals:
            n = step.frames.shape[0]
            begin = self.last_frame_t - (n - 1) / self.spec.fps  # its first frame's time
            per_frame = max(1, step.audio.numel()) / n
            for offset, arrived in step.arrivals:
                played = begin + min(n - 1, int(offset / per_frame)) / self.spec.fps
                self.metrics.speech_latency(max(0.0, played - arrived), arrived)
        if self.user_step_done is not None and step.last:
            self.user_step_done(step)


def wait_until(pred, timeout: float, poll: float = 0.01) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(poll)
    return pred()
