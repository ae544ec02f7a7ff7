"""The paper's Figure 2 waterfall on our engine: every cumulative arm, several runs each, in
random order, each run a fresh process (scripts/bench_session.py). Writes the per-run JSON
files, a summary JSON of medians and a PNG waterfall.

    python scripts/bench_waterfall.py --runs 3 --steps 300

`--summarize-only` rebuilds the summary and the plot from the JSON already in --out; `--tail`
plots tagged runs (`bench_session.py --tag`, e.g. later sessions' configurations) as the last
bars, each with its label, instead of the production arm.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from charengine.characters.config import Switches

# The cumulative switch arms in Figure 2's order; the fused all-reduce, the last switch, is
# not a bar (bench_session.py --arm fused_gemm_allreduce runs it)
ARMS = ["baseline", *(a for a in Switches.ORDER if a != "fused_gemm_allreduce")]
LABELS = {"baseline": "Baseline", "baked_adaln": "+AdaLN", "rope_at_write": "+RoPE@write",
          "ring_cache": "+Ring cache", "fp8_kv": "+FP8 KV", "conditioning_cache": "+Cond. cache",
          "fused_pre_attention": "+Fused pre-attn.", "fused_act_quant": "+Fused act. quant",
          "fp8_attention_kernel": "+FP8 attention", "fused_delta_rotation": "+Fused delta rot.",
          "fused_residual": "+Fused residual", "fused_calibration": "+Fused calib.",
          "production": "+Fast accum. = production"}


def plot(summary: dict, path: Path, title: str, tail: dict | None = None) -> None:
    """The bars: ARMS where measured, then production, or instead `tail` ({arm: label})."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {**LABELS, **(tail or {})}
    arms = [a for a in ARMS + (list(tail) if tail else ["production"]) if a in summary]
    vals = [summary[a]["diffusion_p50_ms"] for a in arms]
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(arms) + 1.5))
    y = range(len(arms))[::-1]
    ax.barh(list(y), vals, color="#4a7ab5")
    for yi, a, v in zip(y, arms, vals):
        prev = summary[arms[arms.index(a) - 1]]["diffusion_p50_ms"] if arms.index(a) else None
        note = f"{v:.1f}" + (f" ({v - prev:+.1f})" if prev is not None else "")
        ax.text(v + 1, yi, note, va="center", fontsize=9)
    ax.set_yticks(list(y), [labels[a] for a in arms])
    ax.axvline(1000 * 4 / 24, color="k", ls="--", lw=1, label="24 fps budget")
    ax.set_xlabel("diffusion p50 per AR step (ms)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--arms", default=",".join(ARMS + ["production"]),
                    help="the switch arms run with promoted FP8 sums; production, the last, "
                         "adds fast accumulation (bench_session.arm_config)")
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    ap.add_argument("--seed", type=int, default=0, help="order shuffle seed")
    ap.add_argument("--first-run", type=int, default=1)
    ap.add_argument("--summarize-only", action="store_true",
                    help="no runs: the summary and plot from the JSON in --out")
    ap.add_argument("--tail", default="", metavar="ARM=LABEL,...",
                    help="tagged arms plotted last, e.g. 'production-s8-quack=+QuACK GEMMs'")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="passed to bench_session.py")
    args = ap.parse_args()
    tail = dict(item.split("=", 1) for item in args.tail.split(",") if item)
    if args.summarize_only:
        summarize(args.out, tail)
        return
    arms = args.arms.split(",")
    jobs = [(a, r) for r in range(args.first_run, args.first_run + args.runs) for a in arms]
    random.Random(args.seed).shuffle(jobs)
    here = Path(__file__).resolve().parent
    for arm, run in jobs:
        t0 = time.time()
        cmd = [sys.executable, str(here / "bench_session.py"), "--arm", arm, "--run", str(run),
               "--out", str(args.out), *[x for x in args.rest if x != "--"]]
        r = subprocess.run(cmd, capture_output=True, text=True)
        print(f"[{time.time() - t0:5.1f} s] {arm} {run}: "
              + (r.stdout.strip().splitlines()[0] if r.returncode == 0 else r.stderr[-2000:]),
              flush=True)
    summarize(args.out, tail)


def summarize(out: Path, tail: dict | None = None) -> dict:
    groups: dict[tuple, list] = {}
    for f in sorted(out.glob("bench_*.json")):
        d = json.loads(f.read_text())
        groups.setdefault((d["preset"], d["layout"], d["gpu"], d["arm"]), []).append(d)
    table = {}
    for (pre, layout, gpu, arm), runs in groups.items():
        med = {k: statistics.median(r[k] for r in runs if r.get(k) is not None)
               for k in ("diffusion_p50_ms", "diffusion_p90_ms", "period_p50_ms", "period_p90_ms",
                         "reset_step_ms", "capacity_fps", "sustained_fps", "tflops_per_gpu",
                         "pct_dense_fp8_peak", "step_over_floor")
               if any(r.get(k) is not None for r in runs)}
        med["runs"] = len(runs)
        med["diffusion_p50_ms_all"] = [r["diffusion_p50_ms"] for r in runs]
        comps = {}
        for r in runs:
            for c, v in r["components_ms"].items():
                comps.setdefault(c, []).append(v)
        med["components_ms"] = {c: statistics.median(v) for c, v in comps.items()}
        med["floors_ms"] = {c: statistics.median(r["floors_ms"][c] for r in runs)
                            for c in runs[0]["floors_ms"]}
        table.setdefault(f"{pre}_{layout}_{gpu}", {})[arm] = med
    for key, summary in table.items():
        (out / f"summary_{key}.json").write_text(json.dumps(summary, indent=1) + "\n")
        if sum(a in summary for a in ARMS) >= 2:
            try:
                plot(summary, out / f"waterfall_{key}.png", key, tail)
            except ImportError:
                print("matplotlib missing: no plot")
        for arm in ARMS + ["production"]:
            if arm in summary:
                s = summary[arm]
                print(f"{key} {arm:>20}: diffusion p50 {s['diffusion_p50_ms']:.1f} ms "
                      f"(runs {', '.join(f'{x:.1f}' for x in s['diffusion_p50_ms_all'])}), period p50 "
                      f"{s['period_p50_ms']:.1f}, reset {s.get('reset_step_ms', float('nan')):.1f}")
    return table


if __name__ == "__main__":
    main()
