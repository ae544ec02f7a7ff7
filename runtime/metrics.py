"""Prometheus metrics of a worker (prometheus-client), on its own registry: the fps played per
10 s interval, every fifth frame's drift from its slot, step times, sessions started,
finished and below target. A session that streams below target is logged."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

log = logging.getLogger("charengine.worker")


class Metrics:
    def __init__(self, target_fps: float = 24.0, interval_s: float = 10.0,
                 below_fps: float = 23.5):
        self.registry = CollectorRegistry()
        self.target_fps, self.interval_s, self.below_fps = target_fps, interval_s, below_fps
        self.fps = Gauge("charengine_fps", "Frames played per second over the last full "
                         "interval", registry=self.registry)
        self.drift = Histogram("charengine_frame_drift_seconds", "Every fifth frame's time "
                               "minus its slot on the pacer's clock", registry=self.registry,
                               buckets=(0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0))
        self.step = Histogram("charengine_step_seconds", "Diffusion time per AR step",
                              registry=self.registry,
                              buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.1667, 0.2, 0.3, 0.5, 1.0))
        self.started = Counter("charengine_sessions_started", "Sessions started",
                               registry=self.registry)
        self.finished = Counter("charengine_sessions_finished", "Sessions finished",
                                registry=self.registry)
        self.below = Counter("charengine_sessions_below_target", "Sessions that streamed below "
                             "target fps on average", registry=self.registry)
        self._frame = 0
        self._interval_start: float | None = None
        self._interval_frames = 0
        self._session_start: float | None = None
        self._session_frames = 0
        self._last_t = 0.0

    def session_started(self) -> None:
        self.started.inc()
        self._session_start = self._interval_start = None
        self._session_frames = self._interval_frames = self._frame = 0

    def frame(self, t: float, slot: float) -> None:
        """A frame left the pacer at t (its slot was `slot`)."""
        if self._frame % 5 == 0:
            self.drift.observe(max(0.0, t - slot))
        self._frame += 1
        if self._session_start is None:
            self._session_start = self._interval_start = t
        self._session_frames += 1
        self._interval_frames += 1
        self._last_t = t
        if t - self._interval_start >= self.interval_s - 1e-9:
            self.fps.set((self._interval_frames - 1) / (t - self._interval_start))
            self._interval_start, self._interval_frames = t, 1

    def session_finished(self, session_id: str = "") -> float | None:
        """Returns the session's average fps (None if it played under a second)."""
        self.finished.inc()
        if self._session_start is None or self._last_t - self._session_start < 1.0:
            return None
        fps = (self._session_frames - 1) / (self._last_t - self._session_start)
        if fps < self.below_fps:
            self.below.inc()
            log.warning("session %s streamed below target: %.2f fps (target %.1f)",
                        session_id, fps, self.target_fps)
        return fps

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
