"""LiveTalk-1.3B's figures against the goals it is held to, gathered from the raw results of
the scripts that measure them (one JSON each, in docs/results/livetalk/): the diffusion and
its attention kernels from scripts/bench_session.py (graphed steady chunks, profiled), the
live latency, first frames and unpaced capacity from scripts/livetalk_latency.py (medians
over its runs), start-up from scripts/bench_startup.py (its `engine` variant), the decoder
alone from scripts/livetalk_decoder.py.

    python scripts/livetalk_goals.py --profile P.json --latency L1.json L2.json L3.json \\
        --startup S.json --decoder D.json --out docs/results/livetalk/goals_livetalk-1.3b_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

# upstream's own loop on one H200 (random weights, 512 x 512), as docs/PERFORMANCE.md quotes it
UPSTREAM = {"diffusion_ms_per_chunk": [314.0, 399.0], "capacity_fps": 24.3,
            "peak_memory_gb": 8.5}
GOALS = {"diffusion_p50_ms": ("<=", 105.0), "attention_tflops": (">=", 650.0),
         "capacity_fps": (">=", 60.0),
         "latency_p50_ms": ("<=", 250.0), "first_frames_s": ("<=", 0.5),
         "ready_s": ("<=", 10.0), "compiles": ("<=", 0), "peak_allocated_mb": ("<", 8500.0),
         "decoder_chunk_ms": ("<=", 90.0)}

# the FP8 attention's kernels in a profile (plugins/kernels/attention.py, attention_pipelined.py)
ATTENTION_KERNELS = ("attention_tma_kernel", "attention_split_kernel", "attention_merge_kernel",
                     "attention_pipelined_kernel")


def met(value: float, goal: tuple[str, float]) -> bool:
    op, bound = goal
    return {"<=": value <= bound, ">=": value >= bound, "<": value < bound}[op]


def profile_figures(prof: dict) -> tuple[float, float, dict, float]:
    """(diffusion p50 ms, kernel ms a chunk, the top kernels' ms, attention TFLOP) from
    bench_session.py's result, or from a profile recorded before that script served both
    families."""
    if "graphed_step_profile" in prof:
        g = prof["graphed_step_profile"]
        return (prof["diffusion_p50_ms"], g["busy_total_ms"], g["top_kernels_ms"],
                prof["step_tflop"]["attention"])
    return (prof["chunk_ms_p50"], prof["kernel_ms_per_chunk"], prof["top_kernels_ms"],
            prof["attention_tflop"])


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", type=Path, required=True)
    ap.add_argument("--latency", type=Path, nargs="+", required=True)
    ap.add_argument("--startup", type=Path, required=True)
    ap.add_argument("--decoder", type=Path, required=True)
    ap.add_argument("--decoder-arm", default="frames_fused")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    prof = json.loads(args.profile.read_text())
    runs = [json.loads(p.read_text()) for p in args.latency]
    start = json.loads(args.startup.read_text())
    # bench_startup.py's result (its `engine` variant), or one recorded before that script
    # served both families (the figures at its top level)
    start = start["variants"]["engine"] if "variants" in start else start
    dec = json.loads(args.decoder.read_text())["arms"][args.decoder_arm]

    def med(key):
        return statistics.median(r[key] for r in runs)

    diffusion_ms, kernel_ms, top, attention_tflop = profile_figures(prof)
    attention_ms = sum(ms for name, ms in top.items() if name.startswith(ATTENTION_KERNELS))
    figures = {
        "diffusion_p50_ms": diffusion_ms,
        "diffusion_kernel_ms": kernel_ms,
        "attention_ms": attention_ms,
        "attention_tflops": attention_tflop / attention_ms * 1e3,
        "capacity_fps": med("capacity_fps"),
        "latency_p50_ms": med("latency_p50_ms"),
        "latency_p90_ms": med("latency_p90_ms"),
        "first_frames_s": med("first_frames_s"),
        "stalls": sum(r["stalls"] for r in runs),
        "ready_s": start["ready_s"],
        "ready_s_runs": start["ready_s_runs"],
        "compiles": start["compiles"],
        "peak_allocated_mb": start["peak_allocated_mb"],
        "decoder_chunk_ms": dec["chunk_ms"],
        "decoder_piece_ms": dec["piece_ms"],
    }
    doc = {"preset": prof["preset"], "gpu": prof["gpu"], "date": prof["date"],
           "sources": {"profile": args.profile.name, "latency": [p.name for p in args.latency],
                       "startup": args.startup.name, "decoder": args.decoder.name},
           "per_run": {"capacity_fps": [r["capacity_fps"] for r in runs],
                       "latency_p50_ms": [r["latency_p50_ms"] for r in runs]},
           **figures, "upstream": UPSTREAM,
           "goals": {k: {"goal": f"{op} {b}", "met": met(figures[k], (op, b))}
                     for k, (op, b) in GOALS.items()}}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    for k, g in doc["goals"].items():
        print(f"{k:20s} {figures[k]:10.2f}  {g['goal']:10s} {'met' if g['met'] else 'NOT met'}")


if __name__ == "__main__":
    main()
