"""A worker's metrics, one object for /metrics and the page: Prometheus metrics
(prometheus-client, on its own registry) and the live numbers of the session in progress,
both made from the same observations.

What a session reports: each step's diffusion time and frames, each frame's time and slot,
each stall, the latency from speech to the frame that plays it, and the steps and frames
queued for playback. /metrics has the fps played per 10 s interval, every fifth frame's
drift from its slot, step times, speech latency, stalls, sessions started, finished and below
target, and the live numbers of the last minute (`charengine_live_*`); `live()` gives the
page those same numbers. Step times are what the session's stages report: on a GPU the
diffusion's GPU time (runtime/pipeline.py, `Timed`). A session whose steady part streams
below target (BELOW_TARGET_FRACTION of the engine's fps) is counted and logged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger("charengine.worker")

LIVE_WINDOW_S = 60.0  # the live numbers and the page's chart: the last minute
PLAYBACK_WINDOW_S = 5.0  # the live playback fps: frames played in the last five seconds
DRIFT_EVERY = 5  # the drift histogram sees every fifth frame
STEP_QUANTILES = (0.5, 0.9)
DRIFT_QUANTILES = (0.9, 1.0)
LATENCY_QUANTILES = (0.5, 0.9)
CHUNK_QUANTILES = (0.5, 0.9, 0.99)
STEP_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.1667, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0)
DRIFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
LATENCY_BUCKETS = (0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
# A session is below target where its steady part plays under this fraction of the engine's
# fps (23.5 of 24 fps, 15.7 of 16); its steady part starts STEADY_AFTER_S after its first
# frame and must last STEADY_MIN_S to be judged.
BELOW_TARGET_FRACTION = 0.98
STEADY_AFTER_S = 1.0
STEADY_MIN_S = 1.0


class Window:
    """Observations (time, value, weight) of the last `span_s` seconds, safe across threads."""

    def __init__(self, span_s: float):
        self.span_s = span_s
        self.items: deque[tuple[float, float, float]] = deque()
        self.lock = threading.Lock()

    def add(self, t: float, value: float, weight: float = 1.0) -> None:
        with self.lock:
            self.items.append((t, value, weight))
            self._trim(t)

    def _trim(self, now: float) -> None:
        while self.items and self.items[0][0] < now - self.span_s:
            self.items.popleft()

    def since(self, now: float) -> list[tuple[float, float, float]]:
        with self.lock:
            self._trim(now)
            return list(self.items)

    def clear(self) -> None:
        with self.lock:
            self.items.clear()


def quantiles(values, qs) -> dict[str, float | None]:
    """{"0.5": median, ...} of `values` (None where there are none)."""
    if not len(values):
        return {str(q): None for q in qs}
    return {str(q): float(v) for q, v in zip(qs, np.quantile(np.asarray(values), qs))}


class LiveCollector:
    """The live numbers as Prometheus gauges, computed at each scrape from the same windows
    the page's numbers come from."""

    def __init__(self, metrics: "Metrics"):
        self.metrics = metrics

    def describe(self):
        return []  # computed at each scrape: nothing to register ahead

    def collect(self):
        live = self.metrics.live()
        for name, key, doc in (
                ("playback_fps", "playback_fps", "Frames played per second, last 5 s"),
                ("generation_fps", "generation_fps", "Frames generated per second of "
                 "diffusion time, last minute"),
                ("realtime_factor", "realtime_factor", "Generation fps over the target fps")):
            g = GaugeMetricFamily(f"charengine_live_{name}", doc)
            if live[key] is not None:
                g.add_metric([], live[key])
            yield g
        for name, key, doc in (
                ("step_seconds", "step_s", "Diffusion time per step, last minute"),
                ("speech_latency_seconds", "latency_s", "Speech to the frame that plays it, "
                 "last minute"),
                ("frame_drift_seconds", "drift_s", "Frame time minus its slot, last minute")):
            g = GaugeMetricFamily(f"charengine_live_{name}", doc, labels=["quantile"])
            for q, v in live[key].items():
                if q != "last" and v is not None:
                    g.add_metric([q], v)
            yield g
        yield from self.per_session()

    def per_session(self):
        """Each session in progress, labelled with its id: its playback fps, stalls (steps
        that missed their slot) and the time they held playback, step time and speech
        latency."""
        with self.metrics.lock:
            sessions = list(self.metrics.active.values())
        lives = [(s.session_id, s.live()) for s in sessions]
        for name, key, doc in (
                ("playback_fps", "playback_fps", "A session's frames played per second, last 5 s"),
                ("stalls", "stalls", "A session's stalls so far (steps late for their slot)"),
                ("stall_seconds", "stall_s", "Time a session's playback was held by stalls")):
            g = GaugeMetricFamily(f"charengine_session_{name}", doc, labels=["session"])
            for sid, live in lives:
                if live[key] is not None:
                    g.add_metric([sid], live[key])
            yield g
        for name, key, doc in (
                ("step_seconds", "step_s", "A session's diffusion time per step, last minute"),
                ("speech_latency_seconds", "latency_s", "A session's speech to the frame that "
                 "plays it, last minute"),
                ("chunk_latency_seconds", "chunk_latency_s", "A session's steps from their "
                 "speech's take to their first frames, last minute")):
            g = GaugeMetricFamily(f"charengine_session_{name}", doc,
                                  labels=["session", "quantile"])
            for sid, live in lives:
                for q, v in live[key].items():
                    if q != "last" and v is not None:
                        g.add_metric([sid, q], v)
            yield g


class TurnsCollector:
    """The device's steps as counters, read from the worker's turns (runtime/lanes.py) at
    each scrape: every step run, and those run in a batch with other sessions' steps."""

    def __init__(self, turns):
        self.turns = turns

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        yield CounterMetricFamily("charengine_device_steps", "Steps run on the device, every "
                                  "session's", value=self.turns.taken)
        yield CounterMetricFamily("charengine_device_batches", "Batches of more than one "
                                  "session's step run as one (--batch)",
                                  value=self.turns.batches)


class Metrics:
    def __init__(self, target_fps: float = 24.0, interval_s: float = 10.0,
                 window_s: float = LIVE_WINDOW_S,
                 playback_window_s: float = PLAYBACK_WINDOW_S, clock=time.monotonic):
        """`target_fps`: the engine's (its family's) frame rate; `clock` must read what the
        pacer's clock reads (frame times are on it: the monotonic clock when serving)."""
        self.registry = CollectorRegistry()
        self.target_fps, self.interval_s = target_fps, interval_s
        self.below_fps = target_fps * BELOW_TARGET_FRACTION
        self.playback_window_s, self.clock = playback_window_s, clock
        r = self.registry
        self.fps = Gauge("charengine_fps", "Frames played per second over the last full "
                         "interval", registry=r)
        self.drift = Histogram("charengine_frame_drift_seconds", "Every fifth frame's time "
                               "minus its slot on the pacer's clock", registry=r,
                               buckets=DRIFT_BUCKETS)
        self.step = Histogram("charengine_step_seconds", "Diffusion time per AR step",
                              registry=r, buckets=STEP_BUCKETS)
        self.latency = Histogram("charengine_speech_latency_seconds", "Time from speech "
                                 "reaching the worker to the frame that plays it", registry=r,
                                 buckets=LATENCY_BUCKETS)
        self.stalls = Counter("charengine_stalls", "Playback stalls: a step a frame or more "
                              "late for its slot, the last frame held (a barge-in's gap "
                              "not counted)",
                              registry=r)
        self.stall_seconds = Counter("charengine_stall_seconds", "Time playback was held by "
                                     "stalls", registry=r)
        self.queued_steps = Gauge("charengine_queued_steps", "Finished steps waiting to play",
                                  registry=r)
        self.queued_frames = Gauge("charengine_queued_frames", "Frames made and not yet "
                                   "played", registry=r)
        self.started = Counter("charengine_sessions_started", "Sessions started", registry=r)
        self.finished = Counter("charengine_sessions_finished", "Sessions finished",
                                registry=r)
        self.below = Counter("charengine_sessions_below_target", "Sessions whose steady part "
                             f"(from {STEADY_AFTER_S:g} s after their first frame) played below "
                             f"{BELOW_TARGET_FRACTION:.0%} of the engine's fps", registry=r)
        self.active_gauge = Gauge("charengine_sessions_active", "Sessions in progress",
                                  registry=r)
        self.capacity_gauge = Gauge("charengine_sessions_capacity", "Sessions this worker "
                                    "serves at once (--sessions)", registry=r)
        self.capacity_gauge.set(1)
        r.register(LiveCollector(self))
        self.window_s = window_s
        self.lock = threading.Lock()
        self.active: dict[str, SessionMetrics] = {}
        # the session the unlabelled live series and the one-session calls below describe:
        # the last started
        self.current = SessionMetrics(self, "", window_s)

    def session(self, session_id: str = "") -> SessionMetrics:
        """A session starts: its own metrics, which it reports to."""
        child = SessionMetrics(self, session_id, self.window_s)
        self.started.inc()
        with self.lock:
            self.active[session_id] = child
            self.current = child
            self.active_gauge.set(len(self.active))
        return child

    def ended(self, child: SessionMetrics) -> None:
        with self.lock:
            if self.active.get(child.session_id) is child:
                del self.active[child.session_id]
            self.active_gauge.set(len(self.active))

    def set_capacity(self, n: int) -> None:
        self.capacity_gauge.set(n)

    def watch_turns(self, turns) -> None:
        """Report the worker's steps and batches (TurnsCollector) from now on."""
        self.registry.register(TurnsCollector(turns))

    # ---- one session's calls, for a worker of one session (the last started) -----------
    def session_started(self) -> None:
        self.session("")

    def step_done(self, seconds: float, frames: int) -> None:
        self.current.step_done(seconds, frames)

    def frame(self, t: float, slot: float) -> None:
        self.current.frame(t, slot)

    def stall(self, seconds: float) -> None:
        self.current.stall(seconds)

    def speech_latency(self, seconds: float, arrived: float | None = None) -> None:
        self.current.speech_latency(seconds, arrived)

    def chunk_latency(self, seconds: float) -> None:
        self.current.chunk_latency(seconds)

    def queued(self, steps: int, frames: int) -> None:
        self.current.queued(steps, frames)

    def session_finished(self, session_id: str = "") -> float | None:
        return self.current.session_finished(session_id)

    def live(self) -> dict:
        return self.current.live()


    @property
    def sessions_in_progress(self) -> int:
        """Sessions started and not yet finished (what /readyz calls busy)."""
        started = self.registry.get_sample_value("charengine_sessions_started_total") or 0.0
        finished = self.registry.get_sample_value("charengine_sessions_finished_total") or 0.0
        return int(started - finished)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class SessionMetrics:
    """One session's observations: its windows and counts (the live numbers its page is
    pushed, its fps and below-target judgement), feeding the worker's Prometheus series (the
    aggregate ones, and its own, labelled with its id, while it lasts)."""

    def __init__(self, parent: Metrics, session_id: str, window_s: float):
        self.parent, self.session_id = parent, session_id
        self.target_fps, self.interval_s = parent.target_fps, parent.interval_s
        self.below_fps, self.clock = parent.below_fps, parent.clock
        self.playback_window_s = parent.playback_window_s
        self.fps, self.drift, self.step = parent.fps, parent.drift, parent.step
        self.latency, self.stalls, self.stall_seconds = parent.latency, parent.stalls, \
            parent.stall_seconds
        self.queued_steps, self.queued_frames = parent.queued_steps, parent.queued_frames
        self.finished, self.below = parent.finished, parent.below
        self.steps = Window(window_s)  # (end time, diffusion seconds, frames)
        self.frames = Window(window_s)  # (time, drift, 1)
        self.latencies = Window(window_s)  # (time, latency seconds, 1)
        self.chunks = Window(window_s)  # (time, take to first frames, 1)
        self.lock = threading.Lock()
        self._reset()

    def chunk_latency(self, seconds: float) -> None:
        """A step's processing: from its speech's take to its first frames at the pacer."""
        self.chunks.add(self.clock(), seconds)

    def _reset(self) -> None:
        with self.lock:
            self._frame = 0
            self._interval_start: float | None = None
            self._interval_frames = 0
            self._session_start: float | None = None
            self._session_frames = 0
            self._steady_start: float | None = None  # the steady part's first frame
            self._steady_frames = 0
            self._last_t = 0.0
            self._last_step: float | None = None
            self._last_latency: float | None = None
            self._last_drift: float | None = None
            self._stalls = 0
            self._stall_s = 0.0
            self._queued = (0, 0)
        for w in (self.steps, self.frames, self.latencies, self.chunks):
            w.clear()
        self.queued_steps.set(0)
        self.queued_frames.set(0)

    # ---- what a session reports --------------------------------------------------------
    def step_done(self, seconds: float, frames: int) -> None:
        """A step's diffusion took `seconds` and made `frames` frames."""
        self.step.observe(seconds)
        self.steps.add(self.clock(), seconds, frames)
        self._last_step = seconds

    def frame(self, t: float, slot: float) -> None:
        """A frame left the pacer at t (its slot was `slot`)."""
        drift = max(0.0, t - slot)
        with self.lock:
            if self._frame % DRIFT_EVERY == 0:
                self.drift.observe(drift)
            self._frame += 1
            self._last_drift = drift
            if self._session_start is None:
                self._session_start = self._interval_start = t
            self._session_frames += 1
            if self._steady_start is None and t >= self._session_start + STEADY_AFTER_S:
                self._steady_start = t
            if self._steady_start is not None:
                self._steady_frames += 1
            self._interval_frames += 1
            self._last_t = t
            if t - self._interval_start >= self.interval_s - 1e-9:
                self.fps.set((self._interval_frames - 1) / (t - self._interval_start))
                self._interval_start, self._interval_frames = t, 1
        self.frames.add(t, drift)

    def stall(self, seconds: float) -> None:
        """Playback held its last frame for `seconds`: a step missed its slot."""
        self.stalls.inc()
        self.stall_seconds.inc(seconds)
        with self.lock:
            self._stalls += 1
            self._stall_s += seconds

    def speech_latency(self, seconds: float, arrived: float | None = None) -> None:
        """Speech that reached the worker `seconds` ago (at `arrived` on the session's
        clock, for a caller that keeps it) has just played."""
        self.latency.observe(seconds)
        self.latencies.add(self.clock(), seconds)
        self._last_latency = seconds

    def queued(self, steps: int, frames: int) -> None:
        """Finished steps waiting to play, and frames made but not yet played."""
        self.queued_steps.set(steps)
        self.queued_frames.set(frames)
        self._queued = (steps, frames)

    def session_finished(self, session_id: str = "") -> float | None:
        """Returns the session's average fps over its steady part (from STEADY_AFTER_S after
        its first frame: the start's first steps and their first decode left out); None if
        that part lasted under STEADY_MIN_S. Below BELOW_TARGET_FRACTION of the engine's fps,
        the session counts as below target and the log says so."""
        self.finished.inc()
        self.parent.ended(self)
        with self.lock:
            start, frames, last = self._steady_start, self._steady_frames, self._last_t
        if start is None or last - start < STEADY_MIN_S:
            return None
        fps = (frames - 1) / (last - start)
        if fps < self.below_fps:
            self.below.inc()
            log.warning("session %s streamed below target: %.2f fps (target %g)",
                        session_id, fps, self.target_fps)
        return fps

    # ---- what is read ----------------------------------------------------------------
    def live(self) -> dict:
        """The session's live numbers now: fps played (last 5 s) and generated (frames per
        second of diffusion, last minute) against the target, step times (median, p90, and
        each step of the last minute as [seconds ago, seconds]), speech latency, frame drift,
        stalls so far, and the steps and frames queued."""
        now = self.clock()
        steps = self.steps.since(now)
        frames = self.frames.since(now)
        latencies = self.latencies.since(now)
        recent = [t for t, _, _ in frames if t >= now - self.playback_window_s]
        playback = (len(recent) - 1) / (recent[-1] - recent[0]) \
            if len(recent) > 1 and recent[-1] > recent[0] else None
        busy = sum(s for _, s, _ in steps)
        generation = sum(n for _, _, n in steps) / busy if busy > 0 else None
        with self.lock:
            stalls, stall_s, played = self._stalls, self._stall_s, self._session_frames
        return {
            "target_fps": self.target_fps,
            "playback_fps": playback,
            "generation_fps": generation,
            "realtime_factor": generation / self.target_fps if generation else None,
            "step_s": {**quantiles([s for _, s, _ in steps], STEP_QUANTILES),
                       "last": self._last_step},
            "steps": [[round(now - t, 3), round(s, 5)] for t, s, _ in steps],
            "latency_s": {**quantiles([v for _, v, _ in latencies], LATENCY_QUANTILES),
                          "last": self._last_latency},
            "drift_s": {**quantiles([v for _, v, _ in frames], DRIFT_QUANTILES),
                        "last": self._last_drift},
            "chunk_latency_s": quantiles([v for _, v, _ in self.chunks.since(now)],
                                         CHUNK_QUANTILES),
            "stalls": stalls,
            "stall_s": stall_s,
            "frames_played": played,
            "queued_steps": self._queued[0],
            "queued_frames": self._queued[1],
        }

