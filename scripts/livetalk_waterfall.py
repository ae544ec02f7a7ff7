"""The LiveTalk family's waterfall: the plain path (every switch off, bf16, no FP8), then each
switch of LiveTalkSwitches.ORDER on in turn (FP8 GEMMs right before the FP8 cache, FP8
attention with it; spec.waterfall_arms), the preset last (production, with fast
accumulation); several runs per arm in random order, each run a fresh process
(scripts/livetalk_long_session.py: random weights made on the device, then a short session
whose chunks after the cache fills and the graphs are captured are timed). On a GPU every FP8
run takes one GEMM plan, measured as charbuild measures it on the production arm in a process
of its own before the runs (gemm_plan_<preset>_tp1_<gpu>.json beside the results; a later
call reuses it). Writes the per-run JSON, a summary JSON of medians per arm in order and a
PNG waterfall.

    python scripts/livetalk_waterfall.py --preset livetalk-1.3b --device cuda --runs 2

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

from charengine.livetalk.spec import (LiveTalkSwitches, WATERFALL_FP8_GEMM,
                                      WATERFALL_PLAIN, WATERFALL_PRODUCTION, waterfall_arms)

LAYOUT = "tp1"  # LiveTalk runs on one GPU
GOAL_MS = {"livetalk-1.3b": 105.0}  # diffusion per chunk: LiveTalk's goal
LABELS = {WATERFALL_PLAIN: "Plain (bf16)", "baked_adaln": "+AdaLN tables",
          "text_kv_once": "+Text K/V once", "ring_cache": "+Ring cache (graphs)",
          "rope_tables": "+RoPE tables", "position_reset": "+Position reset",
          WATERFALL_FP8_GEMM: "+FP8 GEMMs", "fp8_kv": "+FP8 KV + attention",
          "fused_qkv": "+Fused QKV", "fused_act_quant": "+Fused act. quant",
          "gemm_bias": "+Bias in GEMM", "fused_pre_attention": "+Fused pre-attn.",
          "fused_residual": "+Fused residual", "fused_gelu_quant": "+Fused GELU quant",
          "fused_q_norm": "+Fused q norm", "skip_commit_tail": "+Skip commit tail",
          "graph_fill_chunks": "+Graphed fill chunks", "shared_kv_stores": "+Shared K/V stores",
          "fused_wide_pre_attention": "+Fused bf16 pre-attn.",
          "fused_calibration": "+Fused calibration",
          "fused_delta_rotation": "+Fused delta rotation",
          "split_attention": "+Split attention grid",
          "pipelined_attention": "+Pipelined attention",
          "fp8_cross_attention": "+FP8 cross-attention",
          "patch_gemm": "+Patch embedding GEMM",
          WATERFALL_PRODUCTION: "+Fast accum. = production"}
STATS = ("diffusion_p50_ms", "diffusion_p90_ms", "reset_chunk_p50_ms", "memory_peak_mb",
         "setup_s", "wall_s")


def label(arm: str) -> str:
    """The bar's label; a switch added to ORDER since reads as its name."""
    return LABELS.get(arm, f"+{arm}")


def run_path(out: Path, preset: str, gpu: str, arm: str, run: int) -> Path:
    return out / f"bench_{preset}_{LAYOUT}_{gpu}_{arm}_{run}.json"


def key(preset: str, gpu: str) -> str:
    return f"{preset}_{LAYOUT}_{gpu}"


def plot(summary: dict, path: Path, title: str) -> None:
    """Horizontal bars of each arm's diffusion p50 in order, each with its change from the
    bar above; the real-time budget of a chunk and the preset's goal as lines."""
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
    budget = summary["chunk_budget_ms"]
    ax.axvline(budget, color="k", ls="--", lw=1, label=f"real time ({budget:.0f} ms a chunk)")
    if summary.get("goal_ms"):
        ax.axvline(summary["goal_ms"], color="#c0392b", ls=":", lw=1.5,
                   label=f"goal ({summary['goal_ms']:.0f} ms)")
    ax.set_xlabel("diffusion p50 per chunk (ms)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summarize(out: Path, preset: str, gpu: str) -> dict:
    """The medians over runs of each arm found in `out`, in waterfall order; the summary JSON
    and (with matplotlib) the PNG beside the runs."""
    order = waterfall_arms()
    runs: dict[str, list] = {}
    for f in sorted(out.glob(f"bench_{preset}_{LAYOUT}_{gpu}_*.json")):
        d = json.loads(f.read_text())
        if d.get("preset") == preset and d.get("gpu") == gpu and d.get("arm") in order:
            runs.setdefault(d["arm"], []).append(d)
    if not runs:
        raise SystemExit(f"no runs of {key(preset, gpu)} in {out}")
    arms = {}
    for arm in (a for a in order if a in runs):
        rs = sorted(runs[arm], key=lambda r: r["run"])
        med = {k: statistics.median(r[k] for r in rs if r.get(k) is not None)
               for k in STATS if any(r.get(k) is not None for r in rs)}
        med["runs"] = len(rs)
        med["diffusion_p50_ms_all"] = [r["diffusion_p50_ms"] for r in rs]
        med["steady_chunks"] = rs[0]["steady_chunks"]
        med["switches_on"] = [n for n in LiveTalkSwitches.ORDER if rs[0]["switches"].get(n)]
        med["numerics"] = rs[0]["numerics"]
        med["gemm_plan"] = rs[0].get("gemm_plan", {})
        arms[arm] = med
    any_run = next(iter(runs.values()))[0]
    summary = {"preset": preset, "layout": LAYOUT, "gpu": gpu,
               "date": time.strftime("%Y-%m-%d"),
               "chunk_budget_ms": any_run["chunk_budget_ms"], "goal_ms": GOAL_MS.get(preset),
               "order": list(arms), "arms": arms}
    path = out / f"summary_{key(preset, gpu)}.json"
    path.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {path}")
    for arm, s in arms.items():
        print(f"{arm:>20}: diffusion p50 {s['diffusion_p50_ms']:8.1f} ms "
              f"(runs {', '.join(f'{x:.1f}' for x in s['diffusion_p50_ms_all'])}), "
              f"p90 {s['diffusion_p90_ms']:.1f}, peak {s['memory_peak_mb']:.0f} MB")
    if len(arms) >= 2:
        try:
            png = out / f"waterfall_{key(preset, gpu)}.png"
            plot(summary, png, key(preset, gpu))
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
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--first-run", type=int, default=1,
                    help="the first run's number (a later call adds runs beside earlier ones)")
    ap.add_argument("--chunks", type=int, default=24, help="steady chunks timed per run")
    ap.add_argument("--arms", default="",
                    help="a subset of the arms, comma-separated (default: all, in order)")
    ap.add_argument("--skip-existing", action="store_true",
                    help="leave out the (arm, run) pairs whose JSON is already in --out")
    ap.add_argument("--no-gemm-plan", action="store_true",
                    help="torch._scaled_mm for every FP8 linear, no plan measured")
    ap.add_argument("--seed", type=int, default=0, help="the order shuffle's seed")
    ap.add_argument("--out", type=Path, default=Path("docs/results/livetalk"))
    ap.add_argument("--summarize-only", action="store_true",
                    help="no runs: the summary and plot from the JSON in --out")
    args = ap.parse_args()
    if args.summarize_only:
        summarize(args.out, args.preset, args.gpu_tag)
        return
    order = waterfall_arms()
    arms = args.arms.split(",") if args.arms else list(order)
    unknown = [a for a in arms if a not in order]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; known: {', '.join(order)}")
    jobs = [(a, r) for r in range(args.first_run, args.first_run + args.runs) for a in arms]
    random.Random(args.seed).shuffle(jobs)
    if args.skip_existing:
        jobs = [(a, r) for a, r in jobs
                if not run_path(args.out, args.preset, args.gpu_tag, a, r).exists()]
    worker = Path(__file__).resolve().parent / "livetalk_long_session.py"
    common = ["--preset", args.preset, "--device", args.device]
    args.out.mkdir(parents=True, exist_ok=True)
    t_all, failed = time.perf_counter(), []
    if args.no_gemm_plan:
        common.append("--no-gemm-plan")
    elif args.device.startswith("cuda"):
        plan = args.out / f"gemm_plan_{key(args.preset, args.gpu_tag)}.json"
        if not plan.exists():
            r = subprocess.run([sys.executable, str(worker), *common, "--arm",
                                WATERFALL_PRODUCTION, "--write-gemm-plan", str(plan)],
                               capture_output=True, text=True)
            if r.returncode:
                raise SystemExit(f"the GEMM plan: failed\n{r.stderr[-2000:]}")
            print(f"[{time.perf_counter() - t_all:5.1f} s] GEMM plan {r.stdout.strip()}",
                  flush=True)
        common += ["--gemm-plan", str(plan)]
    for i, (arm, run) in enumerate(jobs):
        path = run_path(args.out, args.preset, args.gpu_tag, arm, run)
        cmd = [sys.executable, str(worker), *common,
               "--arm", arm, "--chunks", str(args.chunks), "--run", str(run),
               "--gpu-tag", args.gpu_tag, "--out", str(path)]
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
    summarize(args.out, args.preset, args.gpu_tag)
    if failed:
        raise SystemExit(f"{len(failed)} runs failed: {failed}")


if __name__ == "__main__":
    main()
