"""Barge-in latency on a live session: the time from the interrupt to the last voiced frame
leaving the pacer (paper §7.2: 0.78 s median, because 3-5 voiced latents were in flight), and
how long the picture holds before listening frames flow again.

    python scripts/bench_bargein.py --engine engines/cpu-tiny --trials 10
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from charengine.runtime.engine import Engine
from charengine.runtime.live import LiveSession, wait_until
from charengine.runtime.worker import Worker


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, default=Path("engines/cpu-tiny"))
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--slack", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    worker = Worker(Engine.load(args.engine))
    spec = worker.spec
    rng = random.Random(args.seed)
    last_voiced, resume = [], []
    for trial in range(args.trials):
        log = []
        s = LiveSession(worker, lambda f, a, t, v: log.append((t, v)), slack=args.slack, seed=trial)
        s.start(torch.rand(3, spec.out_h, spec.out_w))
        s.say(torch.randn(spec.side.sample_rate * 10) * 0.1)
        wait_until(lambda: sum(v for _, v in log) >= 24, 30)
        time.sleep(rng.uniform(0, 4 / 24))  # interrupt at a random phase of the step
        t_int = s.interrupt()
        wait_until(lambda: any(t > t_int and not v for t, v in log), 30)
        s.stop()
        last_voiced.append(max(0.0, max(t for t, v in log if v) - t_int))
        resume.append(min(t for t, v in log if t > t_int) - t_int)
    result = {"trials": args.trials, "slack": args.slack,
              "interrupt_to_last_voiced_frame_s": {"median": statistics.median(last_voiced),
                                                   "max": max(last_voiced)},
              "interrupt_to_first_listening_frame_s": {"median": statistics.median(resume),
                                                       "max": max(resume)}}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
