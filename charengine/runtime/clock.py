"""The clock the pacer plays on: what time it is, and a wait until a time or until what the
waiter waits for is ready. `MonotonicClock` is the machine's monotonic clock; the pacer
takes any object with these two methods, so a test can drive its schedule by hand and check
its frames' times exactly."""

from __future__ import annotations

import threading
import time
from typing import Callable, Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    def wait_until(self, cv: threading.Condition, ready: Callable[[], bool],
                   deadline: float | None) -> bool: ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()

    def wait_until(self, cv: threading.Condition, ready: Callable[[], bool],
                   deadline: float | None) -> bool:
        """With `cv` held: wait until ready() (True) or the clock reaches `deadline` (False;
        None waits for ready() alone). Whoever makes ready() true notifies `cv`."""
        while not ready():
            if deadline is None:
                cv.wait()
                continue
            left = deadline - self.now()
            if left <= 0:
                return False
            cv.wait(left)
        return True
