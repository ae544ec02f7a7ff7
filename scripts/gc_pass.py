"""How long one full pass of Python's cyclic garbage collector holds a serving process: the
engine's worker loaded as charrun --serve loads it, then `gc.collect()` timed --runs times as
start-up leaves the process, and again after charengine.runtime.garbage.freeze_start_up()
(what charrun does once ready). Every thread of the process, a live session's pacer
included, waits for the pass; the collector runs one on its own schedule.

    python scripts/gc_pass.py --engine /tmp/tl
"""

from __future__ import annotations

import argparse
import gc
import json
import time

from charengine.runtime.engine import Engine
from charengine.runtime.garbage import freeze_start_up
from charengine.runtime.worker import Worker
from charengine.timing import median


def passes(runs: int) -> list[float]:
    """Milliseconds of each of `runs` full collections."""
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        gc.collect()
        out.append(1e3 * (time.perf_counter() - t0))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)
    worker = Worker(Engine.load(args.engine))
    tracked = len(gc.get_objects())
    before = passes(args.runs)
    freeze_start_up()
    after = passes(args.runs)
    print(json.dumps({"engine": worker.target.name, "objects_tracked": tracked,
                      "objects_frozen": gc.get_freeze_count(),
                      "full_pass_ms": {"as_started": round(median(before), 1),
                                       "frozen": round(median(after), 2)},
                      "runs_ms": {"as_started": [round(x, 1) for x in before],
                                  "frozen": [round(x, 2) for x in after]}}))


if __name__ == "__main__":
    main()
