"""The waterfall (the paper's Figure 2), any family: the family's waterfall arms
(`Family.waterfall`: the plain path, each optimization on in turn, the config as it is last),
several runs per arm in random order, each run a fresh process (scripts/long_session.py:
random weights made on the device, a short session whose steps after the cache fills and the
graphs are captured are timed; --tp/--rank: one TP rank's slice alone). On a GPU every FP8
run takes one GEMM plan, measured as charbuild measures it on the production arm in a process
of its own before the runs (gemm_plan_<preset>_<layout>_<gpu>.json beside the results; a
later call reuses it). Writes the per-run JSON, a summary JSON of medians per arm in order
and a PNG waterfall.

    python scripts/bench_waterfall.py --preset livetalk-1.3b --runs 2 --out docs/results/livetalk
    python scripts/bench_waterfall.py --preset characters-57b --tp 3 --rank 0 --runs 3 \\
        --steps 240 --out docs/results
    python scripts/bench_waterfall.py --preset tiny --device cpu --gpu-tag cpu --steps 24

`--summarize-only` rebuilds the summary and the plot from the JSON already in --out.
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

from charengine.config import preset
from charengine.family import family_of
from charengine.provenance import provenance

PRODUCTION = "production"  # every family's last arm: the config as it is
GOAL_MS = {"livetalk-1.3b": 105.0}  # diffusion per step: the preset's goal, drawn on the plot
STATS = ("diffusion_p50_ms", "diffusion_p90_ms", "reset_step_p50_ms", "memory_peak_mb",
         "setup_s", "wall_s")


def layout(tp: int, rank: int) -> str:
    return f"tp{tp}-rank{rank}" if tp > 1 else "tp1"


def run_path(out: Path, key: str, arm: str, run: int) -> Path:
    return out / f"bench_{key}_{arm}_{run}.json"


def plot(summary: dict, path: Path, title: str, label) -> None:
    """Horizontal bars of each arm's diffusion p50 in order, each with its change from the
    bar above; the real-time budget of a step and the preset's goal as lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(summary["arms"])
    vals = [summary["arms"][a]["diffusion_p50_ms"] for a in arms]
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(arms) + 1.5))
    y = range(len(arms))[::-1]
    ax.barh(list(y), vals, color="#4a7ab5")
    for i, (yi, v) in enumerate(zip(y, vals)):
        note = f"{v:.1f}" + (f" ({v - vals[i - 1]:+.1f})" if i else "")
        ax.text(v + max(vals) / 100, yi, note, va="center", fontsize=9)
    ax.set_yticks(list(y), [label(a) for a in arms])
    budget = summary["step_budget_ms"]
    ax.axvline(budget, color="k", ls="--", lw=1, label=f"real time ({budget:.0f} ms a step)")
    if summary.get("goal_ms"):
        ax.axvline(summary["goal_ms"], color="#c0392b", ls=":", lw=1.5,
                   label=f"goal ({summary['goal_ms']:.0f} ms)")
    ax.set_xlabel("diffusion p50 per step (ms)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summarize(out: Path, preset_name: str, key: str) -> dict:
    """The medians over runs of each arm found in `out`, in waterfall order; the summary JSON
    and (with matplotlib) the PNG beside the runs."""
    fam = family_of(preset(preset_name))
    order = fam.waterfall()
    switch_order = fam.config_types["switches"].ORDER
    runs: dict[str, list] = {}
    for f in sorted(out.glob(f"bench_{key}_*.json")):
        d = json.loads(f.read_text())
        if d.get("preset") == preset_name and d.get("arm") in order:
            runs.setdefault(d["arm"], []).append(d)
    if not runs:
        raise SystemExit(f"no runs of {key} in {out}")
    arms = {}
    for arm in (a for a in order if a in runs):
        rs = sorted(runs[arm], key=lambda r: r["run"])
        med = {k: statistics.median(r[k] for r in rs if r.get(k) is not None)
               for k in STATS if any(r.get(k) is not None for r in rs)}
        med["runs"] = len(rs)
        med["diffusion_p50_ms_all"] = [r["diffusion_p50_ms"] for r in rs]
        med["steady_steps"] = rs[0]["steady_steps"]
        med["switches_on"] = [n for n in switch_order if rs[0]["switches"].get(n)]
        med["numerics"] = rs[0]["numerics"]
        med["gemm_plan"] = rs[0].get("gemm_plan", {})
        arms[arm] = med
    any_run = next(iter(runs.values()))[0]
    summary = {"preset": preset_name, "family": fam.name, "layout": any_run["layout"],
               "gpu": any_run["gpu"], **provenance(),
               "step_budget_ms": any_run["step_budget_ms"], "goal_ms": GOAL_MS.get(preset_name),
               "order": list(arms), "arms": arms}
    path = out / f"summary_{key}.json"
    path.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {path}")
    for arm, s in arms.items():
        print(f"{arm:>25}: diffusion p50 {s['diffusion_p50_ms']:8.1f} ms "
              f"(runs {', '.join(f'{x:.1f}' for x in s['diffusion_p50_ms_all'])}), "
              f"p90 {s['diffusion_p90_ms']:.1f}, peak {s['memory_peak_mb']:.0f} MB")
    if len(arms) >= 2:
        try:
            png = out / f"waterfall_{key}.png"
            plot(summary, png, key, fam.arm_label)
            print(f"wrote {png}")
        except ImportError:
            print("matplotlib missing: no plot")
    return summary


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="livetalk-1.3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gpu-tag", default="h200")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--first-run", type=int, default=1,
                    help="the first run's number (a later call adds runs beside earlier ones)")
    ap.add_argument("--steps", type=int, default=24, help="steady steps timed per run")
    ap.add_argument("--arms", default="",
                    help="a subset of the arms, comma-separated (default: all, in order)")
    ap.add_argument("--skip-existing", action="store_true",
                    help="leave out the (arm, run) pairs whose JSON is already in --out")
    ap.add_argument("--no-gemm-plan", action="store_true",
                    help="torch._scaled_mm for every FP8 linear, no plan measured")
    ap.add_argument("--seed", type=int, default=0, help="the order shuffle's seed")
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    ap.add_argument("--summarize-only", action="store_true",
                    help="no runs: the summary and plot from the JSON in --out")
    args = ap.parse_args()
    key = f"{args.preset}_{layout(args.tp, args.rank)}_{args.gpu_tag}"
    if args.summarize_only:
        summarize(args.out, args.preset, key)
        return
    order = family_of(preset(args.preset)).waterfall()
    arms = args.arms.split(",") if args.arms else list(order)
    unknown = [a for a in arms if a not in order]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; known: {', '.join(order)}")
    jobs = [(a, r) for r in range(args.first_run, args.first_run + args.runs) for a in arms]
    random.Random(args.seed).shuffle(jobs)
    if args.skip_existing:
        jobs = [(a, r) for a, r in jobs if not run_path(args.out, key, a, r).exists()]
    worker = Path(__file__).resolve().parent / "long_session.py"
    common = ["--preset", args.preset, "--device", args.device, "--tp", str(args.tp),
              "--rank", str(args.rank)]
    args.out.mkdir(parents=True, exist_ok=True)
    t_all, failed = time.perf_counter(), []
    if args.no_gemm_plan:
        common.append("--no-gemm-plan")
    elif args.device.startswith("cuda"):
        plan = args.out / f"gemm_plan_{key}.json"
        if not plan.exists():
            r = subprocess.run([sys.executable, str(worker), *common, "--arm", PRODUCTION,
                                "--write-gemm-plan", str(plan)], capture_output=True, text=True)
            if r.returncode:
                raise SystemExit(f"the GEMM plan: failed\n{r.stderr[-2000:]}")
            print(f"[{time.perf_counter() - t_all:5.1f} s] GEMM plan {r.stdout.strip()}",
                  flush=True)
        common += ["--gemm-plan", str(plan)]
    for i, (arm, run) in enumerate(jobs):
        path = run_path(args.out, key, arm, run)
        cmd = [sys.executable, str(worker), *common, "--arm", arm, "--steps", str(args.steps),
               "--run", str(run), "--gpu-tag", args.gpu_tag, "--out", str(path)]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        head = f"[{wall:5.1f} s, {time.perf_counter() - t_all:6.1f} s in all, " \
               f"{i + 1}/{len(jobs)}] {arm} {run}"
        if r.returncode:
            failed.append((arm, run))
            print(f"{head}: failed\n{r.stderr[-2000:]}", flush=True)
            continue
        d = json.loads(path.read_text())
        print(f"{head}: diffusion p50 {d['diffusion_p50_ms']:.1f} ms, p90 "
              f"{d['diffusion_p90_ms']:.1f}, peak {d['memory_peak_mb']:.0f} MB "
              f"(setup {d['setup_s']:.1f} s, session {d['wall_s']:.1f} s)", flush=True)
    summarize(args.out, args.preset, key)
    if failed:
        raise SystemExit(f"{len(failed)} runs failed: {failed}")


if __name__ == "__main__":
    main()
