"""A clock that moves only when the test moves it, for the pacer (runtime/clock.py's
protocol): advance(dt) lets the pacer's thread do everything that falls due up to the new
time, at each thing's own time, and returns once that thread waits again for a later time
or for work. So a test reads each frame's time exactly, whatever the machine's load."""

from __future__ import annotations

import threading

SETTLE_S = 30.0  # real seconds the pacer's thread may take to reach its next wait


class ManualClock:
    def __init__(self, start: float = 0.0):
        self.t = start
        self.cv: threading.Condition | None = None  # the waiting thread's condition
        self.bound = threading.Event()
        self.waiter = None  # (ready, deadline) while the pacer's thread waits

    def now(self) -> float:
        return self.t

    def wait_until(self, cv, ready, deadline) -> bool:
        self.cv = cv
        self.bound.set()
        while not ready():
            if deadline is not None and self.t >= deadline:
                return False
            self.waiter = (ready, deadline)
            cv.notify_all()  # advance() waits for this
            cv.wait()
            self.waiter = None
        return True

    def _settled(self) -> bool:
        """The pacer's thread waits, and nothing it waits for has come."""
        if self.waiter is None:
            return False
        ready, deadline = self.waiter
        return not ready() and (deadline is None or deadline > self.t)

    def advance(self, dt: float) -> None:
        target = self.t + dt
        assert self.bound.wait(SETTLE_S), "the pacer never waited"
        with self.cv:
            while True:
                assert self.cv.wait_for(self._settled, SETTLE_S), "the pacer did not settle"
                deadline = self.waiter[1]
                if deadline is None or deadline > target:
                    self.t = target
                    return
                self.t = deadline
                self.cv.notify_all()
