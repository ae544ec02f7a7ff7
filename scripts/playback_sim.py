"""Playback simulator (paper Appendix B): replay a session's step periods through one
generation stage and a 24 fps player, and count stalls for each slack.

    python scripts/playback_sim.py                      # the paper's 161 / 263 ms figures
    python scripts/playback_sim.py --bench docs/results/bench_....json
    python scripts/playback_sim.py --periods-ms 150,150,300 --repeat 100
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from charengine.runtime.playout import paper_periods, periods_from_bench, simulate


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", type=Path, help="a bench_session.py JSON")
    ap.add_argument("--periods-ms", help="comma-separated step periods")
    ap.add_argument("--repeat", type=int, default=1, help="repeat the given periods")
    ap.add_argument("--minutes", type=float, default=5.0, help="session length for the paper figures")
    ap.add_argument("--slack", default="1,2", help="comma-separated slacks")
    args = ap.parse_args()
    if args.bench:
        periods = periods_from_bench(args.bench) * args.repeat
    elif args.periods_ms:
        periods = [float(x) / 1e3 for x in args.periods_ms.split(",")] * args.repeat
    else:
        periods = paper_periods(int(args.minutes * 60 * 6))
    for s in (int(x) for x in args.slack.split(",")):
        print(json.dumps(simulate(periods, s).summary()))


if __name__ == "__main__":
    main()
