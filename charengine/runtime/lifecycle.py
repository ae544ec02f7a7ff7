"""How a serving charrun (--serve, --livekit) stops and keeps itself able to take a session.

SIGTERM drains within --grace-period: the worker reads "draining" at once and takes no new
session; the session in progress goes on until it ends by itself or until END_RESERVE_S (half
of a grace period under twice that) before the grace period is over, when charrun ends it
cleanly (the peer told), stops the ranks and exits 0. SIGINT, or a second signal, ends the
session at once. Should ending it take longer than the grace period (a rank that hangs),
charrun gives up: one line, and exit GIVE_UP_EXIT at once (the TP ranks leave by themselves
once rank 0 is gone).

A TP engine's ranks that died (while idle, or taking a session down with them) are started
afresh while the worker is idle, so it reads ready again, or failed where they cannot start.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

from .probes import Readiness

log = logging.getLogger("charengine.worker")

GRACE_PERIOD_S = 30.0  # --grace-period's default (Kubernetes' terminationGracePeriodSeconds)
END_RESERVE_S = 5.0  # of the grace period, kept for ending the session and stopping the ranks
DRAIN_POLL_S = 0.1  # how often the drain looks whether the session in progress has ended
GIVE_UP_EXIT = 1
RANK_POLL_S = 0.1  # how often an idle TP worker's ranks are looked at
RANK_RETRY_S = 10.0  # after ranks that could not start, the wait before the next try


# what stops a render or a server: Ctrl-C, `docker stop` and `timeout`, a closed terminal
# (SIGHUP: as SIGTERM)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def signals_held():
    """SIGINT and SIGTERM held pending in this thread, and for good in the threads it starts
    meanwhile; on leaving, this thread takes what came (its handler runs then). For work that
    an exception raised in the middle would break without saying so."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class Drain:
    """SIGTERM's drain and its deadlines on the monotonic clock. begin() starts it (once; the
    grace period runs from then); end_now() asks for the session to end at once."""

    def __init__(self, grace_s: float = GRACE_PERIOD_S,
                 clock: Callable[[], float] = time.monotonic):
        self.grace_s, self.clock = grace_s, clock
        self.reserve_s = min(END_RESERVE_S, grace_s / 2)
        self.t0: float | None = None
        self.signame = ""
        self.now = False
        self.timer: threading.Timer | None = None

    @property
    def begun(self) -> bool:
        return self.t0 is not None

    def begin(self, signame: str, now: bool = False) -> bool:
        """The first signal: the grace period starts (and, past it, the give-up). Returns False
        for a later one, which ends the session at once."""
        if self.begun:
            self.now = True
            return False
        self.t0, self.signame, self.now = self.clock(), signame, now
        self.timer = threading.Timer(self.grace_s, self._give_up)
        self.timer.daemon = True
        self.timer.start()
        return True

    def end_now(self) -> None:
        self.now = True

    def session_left_s(self) -> float:
        """How long the session in progress may still go on."""
        if self.t0 is None:
            return float("inf")
        if self.now:
            return 0.0
        return max(0.0, self.t0 + self.grace_s - self.reserve_s - self.clock())

    async def until_sessions_end(self, busy: Callable[[], bool]) -> None:
        """Wait while a session is in progress and may still go on."""
        while busy() and self.session_left_s() > 0:
            await asyncio.sleep(min(DRAIN_POLL_S, self.session_left_s()))

    def finish(self) -> None:
        """Everything stopped within the grace period: no give-up."""
        if self.timer is not None:
            self.timer.cancel()

    def _give_up(self) -> None:
        print(f"charrun: {self.signame}: the drain did not end within --grace-period "
              f"{self.grace_s:g} s; stopping at once", file=sys.stderr, flush=True)
        os._exit(GIVE_UP_EXIT)


async def keep_ranks(worker, readiness: Readiness, lock: asyncio.Lock, busy: Callable[[], bool],
                     drain: Drain) -> None:
    """While idle (no session, `lock` free), a TP worker (runtime/distributed.py) whose ranks
    are not running starts them afresh: loading meanwhile, then ready, or failed with the cause
    (tried again after RANK_RETRY_S). A worker in this process has no ranks: nothing to do."""
    from .distributed import RankFailure

    if not hasattr(worker, "ensure_ranks"):
        return
    loop = asyncio.get_running_loop()
    failed = False
    while not drain.begun:
        await asyncio.sleep(RANK_RETRY_S if failed else RANK_POLL_S)
        if drain.begun or busy() or lock.locked():
            continue
        if worker.alive():
            if failed:  # a session started them meanwhile
                readiness.ready(healthy=worker.alive)
                failed = False
            continue
        async with lock:
            if drain.begun or busy() or worker.alive():
                continue
            log.warning("%s; starting the TP ranks afresh", worker.deaths())
            readiness.loading("starting the TP ranks afresh (a rank died)")
            start = loop.run_in_executor(None, worker.ensure_ranks)
            try:
                await asyncio.shield(start)
            except asyncio.CancelledError:  # stopping: the start ends before the worker closes
                await asyncio.wait([start])
                raise
            except RankFailure as e:
                readiness.failed(f"{e}; trying again in {RANK_RETRY_S:g} s")
                failed = True
                continue
            readiness.ready(healthy=worker.alive)
            log.info("the TP ranks are running again")
            failed = False
