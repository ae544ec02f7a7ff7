"""Which of a set of processes are still running: a zombie has exited, whether or not its
parent (or, once orphaned, the init of the machine the suite runs on) has reaped it yet."""
from __future__ import annotations

import psutil


def still_running(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait up to `timeout` s for `procs` to exit; those that have not, zombies left out."""
    _, alive = psutil.wait_procs(procs, timeout=max(0.0, timeout))
    out = []
    for p in alive:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out
