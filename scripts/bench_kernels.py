"""Microbenchmarks of a preset's kernels on one GPU, any family: each candidate as one CUDA
graph of `--calls` calls over distinct buffers (rotated past L2, as a step sees them), timed
`--reps` times, the median per call reported with its error against the plain reference
(and attention beside cuDNN's bf16 attention, GEMMs beside cuBLASLt). The family's sections
and their shapes come from scripts/kernels_<family>.py (the characters family's at a TP
rank slice: --tp; LiveTalk's at its steady chunk), the timing from scripts/kernel_timing.py.

    python scripts/bench_kernels.py --preset characters-57b --tp 3
    python scripts/bench_kernels.py --preset livetalk-1.3b --only pre_attention gemm
    python scripts/bench_kernels.py --preset livetalk-1.3b --only cross_attention

Writes docs/results/kernels_<preset>_tp<N>_<gpu>.json (--out: a folder, or a .json file).
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path

import torch

from charengine.config import preset
from charengine.engine_format import this_machine
from charengine.family import family_of
from charengine.provenance import provenance


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="characters-57b")
    ap.add_argument("--tp", type=int, default=None,
                    help="the layout's TP degree (default: the family's: 3 for the "
                         "characters family, 1 for LiveTalk)")
    ap.add_argument("--calls", type=int, default=None, help="calls per graph (default: the "
                                                            "family's)")
    ap.add_argument("--reps", type=int, default=None, help="timed replays (default: the "
                                                           "family's)")
    ap.add_argument("--only", nargs="*", default=None,
                    help="sections, by name (default: every section of the family's)")
    ap.add_argument("--gemm-libs", default="",
                    help="the characters family's GEMM candidates (default: every backend; "
                         "quack where installed)")
    ap.add_argument("--gpu-tag", default="h200")
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    args = ap.parse_args()
    fam = family_of(preset(args.preset))
    cases = importlib.import_module(f"kernels_{fam.name}")
    defaults = cases.DEFAULTS
    args.tp = args.tp or defaults["tp"]
    args.calls = args.calls or defaults["calls"]
    args.reps = args.reps or defaults["reps"]
    cfg = preset(args.preset, tp=args.tp)
    only = args.only or list(cases.SECTIONS)
    unknown = [s for s in only if s not in cases.SECTIONS]
    if unknown:
        ap.error(f"unknown sections {unknown} of the {fam.name} family; known: "
                 f"{', '.join(cases.SECTIONS)}")
    dev = torch.device("cuda")
    result = {"preset": args.preset, "family": fam.name, "tp": args.tp,
              "machine": this_machine(), **provenance(),
              "calls": args.calls, "reps": args.reps}
    with torch.inference_mode():
        parts = cases.sections(cfg, args, dev)
        for name in only:
            t0 = time.perf_counter()
            result[name] = parts[name]()
            print(f"== {name} ({time.perf_counter() - t0:.0f} s)")
            print(json.dumps(result[name], indent=1), flush=True)
    path = args.out if args.out.suffix == ".json" else \
        args.out / f"kernels_{args.preset}_tp{args.tp}_{args.gpu_tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
