"""A LiveTalk session, unpaced, as charrun's rank runs it (the engine's config and kernels
where --engine is given, else a preset's arm with random weights made on the device and, on
a GPU, the GEMM plan charbuild would measure): per chunk its GPU (or CPU) time, the memory in
use and the positions the chunk's frames sit at. The position reset keeps positions bounded,
so step time and memory stay flat however long the session. The chunks that fill the cache
(and the FP8 calibration) and the first steady chunk (on a GPU it runs eagerly and captures
the graphs, as the engine's warm-up does) are left out of the step-time figures.

    python scripts/livetalk_long_session.py --preset tiny-livetalk --minutes 30 \\
        --out docs/results/livetalk/livetalk_long_session_tiny-livetalk.json
    python scripts/livetalk_long_session.py --engine /path/to/h200-livetalk --minutes 5 \\
        --out docs/results/livetalk/livetalk_long_session_livetalk-1.3b.json

--arm is one of spec.ARMS or of spec.waterfall_arms(), --chunks a short session of that many
timed chunks (scripts/livetalk_waterfall.py runs each of its runs this way, with one GEMM
plan for every run, measured once by --write-gemm-plan):

    python scripts/livetalk_long_session.py --preset livetalk-1.3b --device cuda \\
        --arm production --write-gemm-plan /tmp/plan.json
    python scripts/livetalk_long_session.py --preset livetalk-1.3b --device cuda \\
        --arm fp8_kv --chunks 24 --run 1 --gemm-plan /tmp/plan.json \\
        --out docs/results/livetalk/bench_livetalk-1.3b_tp1_h200_fp8_kv_1.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import time
from pathlib import Path

import torch

from charengine.assemble import rank_session
from charengine.config import preset
from charengine.family import family
from charengine.livetalk.spec import ARMS, arm_config, waterfall_arms, waterfall_config
from charengine.livetalk.weights import device_random_weights
from charengine.mapping import Mapping
from charengine.timing import Span, median

MS_PER_S = 1000.0


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def peak_mb(device: torch.device) -> float:
    """The process's peak: GPU memory allocated, or the host's resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile, nearest rank."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def all_arms() -> tuple[str, ...]:
    return tuple(dict.fromkeys(ARMS + waterfall_arms()))


def arm_cfg(cfg, arm: str):
    """cfg as `arm` runs it: a benchmark arm of spec.ARMS or a waterfall arm."""
    return arm_config(cfg, arm) if arm in ARMS else waterfall_config(cfg, arm)


def first_timed(cfg) -> int:
    """The first chunk timed: the one after the first with the cache's steady shape (the
    window full, the FP8 calibration done), which on a GPU runs eagerly and captures the
    graphs; the same chunk for every arm."""
    spec = cfg.model
    return max(spec.sink_chunks + spec.window_chunks - 1, cfg.cache.calibration_chunks) + 1


def measure_gemm_plan(cfg, state, mapping) -> dict:
    """{"plan": kind -> choice, "us": kind -> {choice: microseconds}} as charbuild measures
    it (builder/bake.py)."""
    from charengine.builder.bake import gemm_plan

    plan, times = gemm_plan(cfg, state, mapping)
    return {"plan": plan, "us": times}


def load(args):
    """(session, config, GEMM plan, device); with --write-gemm-plan, the plan written and no
    session."""
    if args.engine is not None:
        from charengine.runtime.engine import Engine
        from charengine.runtime.worker import Worker

        engine = Engine.load(args.engine)
        worker = Worker(engine)
        return worker.session, worker.session.cfg, engine.gemm_plan(0), worker.device
    cfg = arm_cfg(preset(args.preset), args.arm)
    fam = family(cfg.family)
    device = torch.device(args.device)
    mapping = Mapping.single(args.device)
    with torch.inference_mode():
        full = device_random_weights(cfg.model, args.seed, device)
        state = fam.rank_state(cfg, full)
        tables = fam.bake_tables(cfg, full)
        del full
        plan = {}
        if args.write_gemm_plan is not None:
            measured = measure_gemm_plan(cfg, state, mapping)
            args.write_gemm_plan.parent.mkdir(parents=True, exist_ok=True)
            args.write_gemm_plan.write_text(json.dumps(
                {"preset": cfg.model.name, "arm": args.arm, **measured,
                 "date": time.strftime("%Y-%m-%d")}, indent=1) + "\n")
            print(json.dumps(measured["plan"]))
            return None, cfg, measured["plan"], device
        if device.type == "cuda" and cfg.numerics.fp8_gemm:
            if args.gemm_plan is not None:
                plan = json.loads(args.gemm_plan.read_text())["plan"]
            elif not args.no_gemm_plan:
                plan = measure_gemm_plan(cfg, state, mapping)["plan"]
        session = rank_session(cfg, state, mapping, tables=tables, gemm_plan=plan)
    return session, cfg, plan, device


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path)
    ap.add_argument("--preset", default="tiny-livetalk")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--minutes", type=float, default=30.0, help="of video at the model's fps")
    ap.add_argument("--chunks", type=int, default=None,
                    help="instead of --minutes: this many chunks timed after the cache fills")
    ap.add_argument("--arm", choices=all_arms(), default="preset",
                    help="without --engine: the preset's switches and numerics (preset), the "
                         "plain path in bf16 (plain), every switch with bf16 GEMMs and cache "
                         "(bf16), or a waterfall arm (spec.waterfall_arms: every switch up "
                         "to that one; production is the preset)")
    ap.add_argument("--no-gemm-plan", action="store_true",
                    help="torch._scaled_mm for every FP8 linear, not the measured plan")
    ap.add_argument("--gemm-plan", type=Path,
                    help="the GEMM plan from this JSON (--write-gemm-plan's), not measured")
    ap.add_argument("--write-gemm-plan", type=Path,
                    help="only measure the arm's GEMM plan and write it to this JSON")
    ap.add_argument("--run", type=int, default=1, help="the run's number (recorded)")
    ap.add_argument("--gpu-tag", default="", help="the GPU's name in the results (recorded)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.out is None and args.write_gemm_plan is None:
        ap.error("--out is required")
    t_start = time.perf_counter()
    session, cfg, plan, device = load(args)
    if session is None:
        return
    setup_s = time.perf_counter() - t_start
    spec = cfg.model
    fam = family(spec.FAMILY)
    first = first_timed(cfg)
    chunks = first + args.chunks if args.chunks is not None else \
        int(args.minutes * 60 * spec.fps) // spec.frames_per_latent
    if chunks <= first:
        raise SystemExit(f"{chunks} chunks: none timed (the first timed chunk is {first})")
    shapes = fam.step_shapes(spec)
    g = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    ms, mem, pos = [], [], set()
    with torch.inference_mode():
        session.start(torch.randn(shapes.reference, generator=g).to(device),
                      torch.randn(shapes.prompt, generator=g).to(device))
        for _ in range(chunks):
            noise = torch.randn(shapes.noise_shape, generator=g).to(device)
            feats = torch.randn(shapes.features, generator=g).to(device)
            with Span(device) as s:
                out = session.step(noise, feats)
            ms.append(s.ms)
            mem.append(torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda"
                       else rss_mb())
            pos.update(session.cache.positions.tolist())
            if not torch.isfinite(out).all():
                raise SystemExit(f"chunk {len(ms) - 1}: non-finite latent")
    steady = ms[first:]
    resets = [c for c in range(chunks) if session.cache.is_reset(c)]
    reset_ms = [ms[c] for c in resets if c >= first]
    tenth = max(len(steady) // 10, 1)
    summary = {
        "preset": spec.name, "layout": f"tp{cfg.tp}", "gpu": args.gpu_tag,
        "device": str(device), "engine": str(args.engine or ""),
        "arm": "engine" if args.engine else args.arm, "run": args.run,
        "chunks": chunks, "first_timed_chunk": first, "steady_chunks": len(steady),
        "latent_frames": chunks * spec.chunk_frames,
        "video_minutes": chunks * spec.frames_per_latent / spec.fps / 60,
        "chunk_budget_ms": MS_PER_S * spec.frames_per_latent / spec.fps,
        "diffusion_p50_ms": median(steady), "diffusion_p90_ms": pct(steady, 90),
        "reset_chunk_p50_ms": median(reset_ms) if reset_ms else None,
        "memory_peak_mb": peak_mb(device),
        "resets": len(resets),
        "positions": [min(pos), max(pos)],
        "step_ms_first_tenth_p50": median(steady[:tenth]),
        "step_ms_last_tenth_p50": median(steady[-tenth:]),
        "memory_mb_first_tenth_max": max(mem[first:first + tenth]),
        "memory_mb_last_tenth_max": max(mem[-tenth:]),
        "switches": dataclasses.asdict(cfg.switches),
        "numerics": dataclasses.asdict(cfg.numerics),
        "gemm_plan": {k: str(v) for k, v in plan.items()},
        "setup_s": setup_s, "wall_s": time.perf_counter() - t0,
        "date": time.strftime("%Y-%m-%d"),
        "step_ms": ms, "memory_mb": mem,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary) + "\n")
    print(json.dumps({k: v for k, v in summary.items()
                      if k not in ("step_ms", "memory_mb", "switches", "numerics")}, indent=1))


if __name__ == "__main__":
    main()
