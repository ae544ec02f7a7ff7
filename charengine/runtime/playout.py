"""The playout schedule shared by the pacer and the playback simulator (paper Appendix B).

Steps of `frames_per_step` frames play at `fps`. Playback starts when step 0 is ready; each
later step has a slot right after the previous one. A step that misses its slot stalls
playback: the last frame is held, and that step and every later slot shift by the delay.
Nothing is ever dropped. With slack s, step k may start generating once step k-1 is done and
step k-s has started playing (s=1: generate while the previous step plays; s=2: one finished
step also waits in the queue).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Playout:
    fps: float = 24.0
    frames_per_step: int = 4
    next_slot: float | None = None  # when the next step should start playing
    stalls: list[tuple[float, float]] = field(default_factory=list)  # (time, length)

    @property
    def step_s(self) -> float:
        return self.frames_per_step / self.fps

    def restart_at(self, t: float) -> None:
        """Frames dropped (a barge-in) give back their slots: the next step may start at t."""
        self.next_slot = t

    def start(self, ready: float, frames: int | None = None) -> float:
        """A step that is ready at `ready` starts playing at the returned time; `frames`
        (default frames_per_step) is how many frames it plays."""
        if self.next_slot is None:
            begin = ready
        elif ready > self.next_slot:
            self.stalls.append((self.next_slot, ready - self.next_slot))
            begin = ready
        else:
            begin = self.next_slot
        self.next_slot = begin + (self.step_s if frames is None else frames / self.fps)
        return begin


@dataclass
class SimResult:
    slack: int
    steps: int
    duration_s: float
    stalls: list[tuple[float, float]]

    @property
    def stalls_per_minute(self) -> float:
        return 60.0 * len(self.stalls) / self.duration_s

    @property
    def mean_stall_ms(self) -> float:
        return 1e3 * sum(s for _, s in self.stalls) / len(self.stalls) if self.stalls else 0.0

    def summary(self) -> dict:
        return {"slack": self.slack, "steps": self.steps, "duration_s": self.duration_s,
                "stalls": len(self.stalls), "stalls_per_minute": self.stalls_per_minute,
                "mean_stall_ms": self.mean_stall_ms,
                "max_stall_ms": 1e3 * max((s for _, s in self.stalls), default=0.0)}


def simulate(periods_s: list[float], slack: int, fps: float = 24.0,
             frames_per_step: int = 4) -> SimResult:
    """Replay unpaced step periods through one generation stage and the player."""
    if slack < 1:
        raise ValueError("slack must be at least 1")
    play = Playout(fps, frames_per_step)
    gen_end, play_start = [], []
    for k, period in enumerate(periods_s):
        start = gen_end[-1] if k else 0.0
        if k >= slack:
            start = max(start, play_start[k - slack])
        gen_end.append(start + period)
        play_start.append(play.start(gen_end[-1]))
    end = play_start[-1] + play.step_s
    return SimResult(slack, len(periods_s), end - play_start[0], play.stalls)


def paper_periods(steps: int, step_ms: float = 161.0, reset_ms: float = 263.0,
                  reset_period: int = 42) -> list[float]:
    """The paper's production figures: 161 ms steps and a 263 ms reset every 42 steps."""
    return [(reset_ms if k and k % reset_period == 0 else step_ms) / 1e3 for k in range(steps)]


def periods_from_bench(path: Path) -> list[float]:
    """Step periods (s) from a scripts/bench_session.py JSON, steady state only."""
    d = json.loads(Path(path).read_text())
    return [p / 1e3 for p in d["period_ms"][d["exclude"]:]]
