"""A long session, any family, unpaced, as charrun's rank steps it: the engine's config and
kernels with --engine, else a preset's arm (the family's arms: `Family.arm_names`) with
random weights made on the device and, on a GPU with FP8 GEMMs, the GEMM plan charbuild
would measure. Per step: its time, the memory in use, whether the position reset came. The
reset keeps positions bounded, so step time and memory stay flat however long the session.
The steps that fill the cache (and the FP8 calibration) and the first steady one (on a GPU it
captures the graphs, as the engine's warm-up does) are left out of the time figures: the
first timed step is the preset's first steady step plus one, the same for every arm.

--compare A:B (repeatable) steps arms A and B beside it in lockstep on the same inputs and
records each step's relative L2 distance of B's latent from A's (max over the session, its
first and last ten minutes, and per minute): the drift of a design against its reference
over an hour, e.g. the characters family's write-time path against the plain one, both fp32,
and its FP8 cache against a bf16 one.

    python scripts/long_session.py --engine /path/to/h200-livetalk --minutes 30 \\
        --out docs/results/livetalk/livetalk_long_session_livetalk-1.3b.json
    python scripts/long_session.py --preset tiny --minutes 60 --threads 1 \\
        --compare fp32_plain:fp32 --compare bf16_cache:production \\
        --out docs/results/long_session_tiny.json

--tp N --rank R measures TP rank R's slice of an N-way layout alone on the device, its
all-reduce left out (the characters-57b TP-3 slice on one GPU). --steps instead of
--minutes: a short session of that many timed steps (scripts/
bench_waterfall.py runs each of its runs this way, with one GEMM plan for every run,
measured once by --write-gemm-plan):

    python scripts/long_session.py --preset livetalk-1.3b --device cuda \\
        --arm production --write-gemm-plan /tmp/plan.json
    python scripts/long_session.py --preset livetalk-1.3b --device cuda \\
        --arm fp8_kv --steps 24 --run 1 --gemm-plan /tmp/plan.json --out run.json
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
from charengine.family import family, family_of
from charengine.mapping import Mapping
from charengine.timing import Span, median, percentile
from charengine.provenance import provenance

MS_PER_S = 1000.0
MINUTE_S = 60


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def peak_mb(device: torch.device) -> float:
    """The process's peak: GPU memory allocated, or the host's resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux


def measure_gemm_plan(cfg, state, mapping) -> dict:
    """{"plan": kind -> choice, "us": kind -> {choice: microseconds}} as charbuild measures
    it (builder/bake.py)."""
    from charengine.builder.bake import gemm_plan

    plan, times = gemm_plan(cfg, state, mapping)
    return {"plan": plan, "us": times}


def sessions_of(args):
    """({name: session}, the measured arm's config, the preset's, its GEMM plan, device);
    with --write-gemm-plan, the plan written and no sessions."""
    if args.engine is not None:
        from charengine.runtime.engine import Engine
        from charengine.runtime.worker import Worker

        engine = Engine.load(args.engine)
        worker = Worker(engine)
        cfg = worker.session.cfg
        return {"engine": worker.session}, cfg, cfg, engine.gemm_plan(0), worker.device
    base = preset(args.preset, tp=args.tp)
    fam = family_of(base)
    cfg = fam.arm(base, args.arm)
    device = torch.device(args.device)
    # TP rank `--rank` of `--tp` alone on the device, its all-reduce left out (a rank slice)
    mapping = Mapping(args.tp, args.rank, str(device), str(device), alone=args.tp > 1)
    names = dict.fromkeys([args.arm, *(n for pair in args.compare for n in pair)])
    with torch.inference_mode():
        full = fam.bench_weights(base.model, args.seed, device)
        plan = {}
        if args.write_gemm_plan is not None:
            measured = measure_gemm_plan(cfg, fam.rank_state(cfg, full, args.rank), mapping)
            args.write_gemm_plan.parent.mkdir(parents=True, exist_ok=True)
            args.write_gemm_plan.write_text(json.dumps(
                {"preset": cfg.model.name, "arm": args.arm, **measured,
                 **provenance()}, indent=1) + "\n")
            print(json.dumps(measured["plan"]))
            return None, cfg, base, measured["plan"], device
        sessions = {}
        for name in names:
            arm_cfg = fam.arm(base, name)
            state = fam.rank_state(arm_cfg, full, args.rank)
            arm_plan = {}
            if device.type == "cuda" and arm_cfg.numerics.fp8_gemm:
                if args.gemm_plan is not None:
                    arm_plan = json.loads(args.gemm_plan.read_text())["plan"]
                elif not args.no_gemm_plan:
                    arm_plan = measure_gemm_plan(arm_cfg, state, mapping)["plan"]
            if name == args.arm:
                plan = arm_plan
            sessions[name] = rank_session(arm_cfg, state, mapping,
                                          tables=fam.bake_tables(arm_cfg, full),
                                          gemm_plan=arm_plan)
        del full
    return sessions, cfg, base, plan, device


def pair(text: str) -> tuple[str, str]:
    a, sep, b = text.partition(":")
    if not sep or not a or not b:
        raise argparse.ArgumentTypeError(f"{text!r}: give two arms as A:B")
    return a, b


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path)
    ap.add_argument("--preset", default="tiny-livetalk")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--minutes", type=float, default=30.0, help="of video at the model's fps")
    ap.add_argument("--tp", type=int, default=1, help="the layout's TP degree (a rank slice)")
    ap.add_argument("--rank", type=int, default=0, help="the TP rank measured alone")
    ap.add_argument("--steps", type=int, default=None,
                    help="instead of --minutes: this many steps timed after the cache fills")
    ap.add_argument("--arm", default="production",
                    help="without --engine: the arm measured (the family's arm_names; "
                         "production is the preset as it is)")
    ap.add_argument("--compare", type=pair, action="append", default=[], metavar="A:B",
                    help="also step arms A and B in lockstep and record B's distance from A")
    ap.add_argument("--no-gemm-plan", action="store_true",
                    help="torch._scaled_mm for every FP8 linear, not the measured plan")
    ap.add_argument("--gemm-plan", type=Path,
                    help="the GEMM plan from this JSON (--write-gemm-plan's), not measured")
    ap.add_argument("--write-gemm-plan", type=Path,
                    help="only measure the arm's GEMM plan and write it to this JSON")
    ap.add_argument("--threads", type=int, default=None, help="torch's CPU threads")
    ap.add_argument("--run", type=int, default=1, help="the run's number (recorded)")
    ap.add_argument("--gpu-tag", default="", help="the GPU's name in the results (recorded)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.out is None and args.write_gemm_plan is None:
        ap.error("--out is required")
    if args.engine is not None and args.compare:
        ap.error("--compare runs a preset's arms: give --preset, not --engine")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.engine is None:
        known = family_of(preset(args.preset)).arm_names()
        unknown = [a for a in [args.arm, *(n for p in args.compare for n in p)]
                   if a not in known]
        if unknown:
            ap.error(f"unknown arm {unknown[0]!r} of {args.preset}; known: {', '.join(known)}")
    t_start = time.perf_counter()
    sessions, cfg, base, plan, device = sessions_of(args)
    if sessions is None:
        return
    setup_s = time.perf_counter() - t_start
    spec = cfg.model
    fam = family(spec.FAMILY)
    measured = sessions["engine" if args.engine else args.arm]
    first = fam.steady_from(base) + 1
    steps = first + args.steps if args.steps is not None else \
        int(args.minutes * MINUTE_S * spec.fps) // spec.frames_per_latent
    if steps <= first:
        raise SystemExit(f"{steps} steps: none timed (the first timed step is {first})")
    shapes = fam.step_shapes(spec)
    g = torch.Generator().manual_seed(args.seed + 1)  # the inputs' own seed, after the weights'
    per_minute = MINUTE_S * spec.fps // spec.frames_per_latent
    t0 = time.perf_counter()
    ms, mem, resets = [], [], []
    drift = {f"{a}:{b}": [] for a, b in args.compare}

    def rel(a, b) -> float:
        return float((a.float() - b.float()).norm() / a.float().norm())

    with torch.inference_mode():
        reference = torch.randn(shapes.reference, generator=g).to(device)
        prompt = torch.randn(shapes.prompt, generator=g).to(device)
        for s in sessions.values():
            s.start(reference, prompt)
        for k in range(steps):
            noise = torch.randn(shapes.noise_shape, generator=g).to(device)
            feats = torch.randn(shapes.features, generator=g).to(device)
            if measured.rule.resets_at(measured.cache, k):
                resets.append(k)
            with Span(device) as span:
                out = {"measured": measured.step(noise, feats)}
            ms.append(span.ms)
            for name, s in sessions.items():
                if s is not measured:
                    out[name] = s.step(noise, feats)
            out.setdefault(args.arm, out["measured"])
            for a, b in args.compare:
                drift[f"{a}:{b}"].append(rel(out[a], out[b]))
            mem.append(torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda"
                       else rss_mb())
            if not torch.isfinite(out["measured"]).all():
                raise SystemExit(f"step {k}: non-finite latent")
            if args.compare and k % per_minute == 0:
                print(f"step {k}: " + " ".join(f"{n} {max(e[-per_minute:]):.2e}"
                                               for n, e in drift.items())
                      + f" memory {mem[-1]:.1f} MB ({time.perf_counter() - t0:.0f} s)",
                      flush=True)
    steady = ms[first:]
    reset_ms = [ms[c] for c in resets if c >= first]
    tenth = max(len(steady) // 10, 1)
    ten_min = 10 * per_minute
    summary = {
        "preset": spec.name, "family": spec.FAMILY, "layout": f"tp{cfg.tp}",
        "gpu": args.gpu_tag, "device": str(device), "engine": str(args.engine or ""),
        "arm": "engine" if args.engine else args.arm, "run": args.run,
        "steps": steps, "first_timed_step": first, "steady_steps": len(steady),
        "video_minutes": steps * spec.frames_per_latent / spec.fps / MINUTE_S,
        "step_budget_ms": MS_PER_S * spec.frames_per_latent / spec.fps,
        "diffusion_p50_ms": median(steady), "diffusion_p90_ms": percentile(steady, 90),
        "reset_step_p50_ms": median(reset_ms) if reset_ms else None,
        "memory_peak_mb": peak_mb(device),
        "resets": len(resets),
        "step_ms_first_tenth_p50": median(steady[:tenth]),
        "step_ms_last_tenth_p50": median(steady[-tenth:]),
        "memory_mb_first_tenth_max": max(mem[first:first + tenth]),
        "memory_mb_last_tenth_max": max(mem[-tenth:]),
        "drift": {n: {"max": max(e[first:]), "first_10min_max": max(e[first:ten_min] or [0.0]),
                      "last_10min_max": max(e[-ten_min:]),
                      "per_minute_max": [max(e[max(i, first): i + per_minute] or [0.0])
                                         for i in range(0, steps, per_minute)]}
                  for n, e in drift.items()},
        "switches": dataclasses.asdict(cfg.switches),
        "numerics": dataclasses.asdict(cfg.numerics),
        "gemm_plan": {k: str(v) for k, v in plan.items()},
        "setup_s": setup_s, "wall_s": time.perf_counter() - t0,
        **provenance(), "torch": torch.__version__,
        "step_ms": ms, "memory_mb": mem,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary) + "\n")
    print(json.dumps({k: v for k, v in summary.items()
                      if k not in ("step_ms", "memory_mb", "switches", "numerics")}
                     | {"drift": {n: {k: v for k, v in d.items() if k != "per_minute_max"}
                                  for n, d in summary["drift"].items()}}, indent=1))


if __name__ == "__main__":
    main()
