"""Where a step's time goes, any family, on one device: one TP rank's slice (the all-reduce
left out), a live-length session with the cache full and resets included, per-step timings
(CUDA events on a GPU), the step's FLOPs against the dense peaks, a profile of the graphed
steady steps with each kernel's time grouped as the family groups them (`kernel_groups`),
where the family's model labels its regions a profile of eager steps laid out like the
paper's Table 2, the first steps of new sessions (--fill-sessions), where a family has
them (scripts/floors_<family>.py) the step's GEMMs and attention timed alone, and where a
family has a batched step (--batches 2,4,8) a batch of that many sessions' steady steps as
charrun --batch runs one (stepping.Together: the staging copies and, on a GPU, the batch
size's graph), with a session-chunk's share of it.

With --engine, the rank is loaded as charrun loads it (runtime/worker.py: the engine's
weights, tables, GEMM plan and compiled kernels, the warm-up that captures the step
graphs): the headline numbers. Without, the rank of --preset and --arm (the family's arms)
is assembled in memory from random weights made on the device (`bench_rank`, the same
assembly) with the GEMM plan charbuild would measure (builder/bake.py).

    charbuild --target h100-tp3 --ranks 0 --out engines/h100-tp3-r0
    python scripts/bench_session.py --engine engines/h100-tp3-r0 --rank 0
    python scripts/bench_session.py --preset characters-57b --tp 3 --arm production
    python scripts/bench_session.py --preset livetalk-1.3b --steps 40 --exclude 10 \
        --profile-graph-steps 6 --fill-sessions 3
    python scripts/bench_session.py --engine /tmp/lt --steps 40 --batches 2,4,8
    python scripts/bench_session.py --preset tiny --device cpu --steps 100 --exclude 20

Writes one JSON per run (docs/results/session_<preset>_<layout>_<gpu>_<arm>_<run>.json).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from charengine.assemble import rank_session
from charengine.config import preset
from charengine.engine_format import this_machine
from charengine.family import family_of
from charengine.mapping import Mapping
from charengine.stepping import Session, Together
from charengine.timing import Mark, Span, median, percentile
from charengine.provenance import provenance

# dense tensor-core peaks of an H100/H200 SXM (TFLOP/s)
DENSE_TFLOPS = {"bf16": 989.0, "fp8": 1979.0}
# the regions a family's model labels when asked (model.annotate): the characters family's
COMPONENTS = ("fp8_gemm", "gemm", "act_quant", "cache_upkeep", "pre_attention", "attention",
              "adaln")
TOP_KERNELS = 25


def parse_switches(cfg, text: str) -> dict[str, bool]:
    """'gemm_residual=1,fused_residual=0' -> {"gemm_residual": True, ...}, names of cfg's
    switches."""
    known = {f.name for f in dataclasses.fields(cfg.switches)}
    out = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in known or value not in ("0", "1"):
            raise SystemExit(f"--switches: {item!r} is not NAME=0|1 with NAME among "
                             f"{', '.join(sorted(known))}")
        out[name] = value == "1"
    return out


class ClockSampler:
    """nvidia-smi sampling the GPU's SM clock, power and active clock-limit reasons every
    `period_ms` while the steps run (H100/H200 hold 700 W: a sustained FP8 load runs at the
    power cap, below the boost clock). Nothing is sampled without nvidia-smi."""

    POWER_CAP = 0x4  # clocks_event_reasons bit: software power cap

    def __init__(self, index: int, period_ms: int = 200):
        self.cmd = ["nvidia-smi", "-i", str(index), "--format=csv,noheader,nounits",
                    "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active",
                    f"-lms={period_ms}"]
        self.proc = None

    def __enter__(self):
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)
        except FileNotFoundError:
            self.proc = None
        return self

    def __exit__(self, *exc):
        if self.proc is None:
            self.summary = None
            return
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=10)
        rows = []
        for line in out.splitlines():
            try:
                clock, power, reasons = (x.strip() for x in line.split(","))
                rows.append((float(clock), float(power), int(reasons, 16)))
            except ValueError:
                continue
        busy = [r for r in rows if r[1] > 300]  # samples under load, not idle gaps
        self.summary = None if not busy else {
            "samples": len(busy),
            "sm_clock_mhz_median": statistics.median(r[0] for r in busy),
            "sm_clock_mhz_min": min(r[0] for r in busy),
            "power_w_median": statistics.median(r[1] for r in busy),
            "power_capped_fraction": sum(bool(r[2] & self.POWER_CAP) for r in busy) / len(busy),
        }


def attribute(prof, device) -> tuple[dict, dict]:
    """GPU time (us) and kernel count per component. On the GPU each kernel goes to the innermost labelled
    range around the host call that launched it (matched by correlation id), so kernels
    launched outside aten (Triton) count too, and the gaps between kernels do not. On the
    CPU, each op's self time goes to the innermost label around it."""
    import bisect

    per = {c: 0.0 for c in COMPONENTS + ("other",)}
    count = dict.fromkeys(per, 0)
    if device.type != "cuda":
        for ev in prof.events():
            if ev.name in COMPONENTS or not ev.self_cpu_time_total:
                continue
            label, p = "other", ev.cpu_parent
            while p is not None and label == "other":
                label = p.name if p.name in COMPONENTS else label
                p = p.cpu_parent
            per[label] += ev.self_cpu_time_total
        return per, {}
    from torch.autograd import DeviceType

    events = prof.profiler.kineto_results.events()
    on_gpu = [e for e in events if e.device_type() == DeviceType.CUDA]
    on_cpu = [e for e in events if e.device_type() == DeviceType.CPU]
    ranges = sorted((e.start_ns(), e.end_ns(), e.name()) for e in on_cpu if e.name() in COMPONENTS)
    if not ranges:
        raise RuntimeError("no labelled ranges in the profiler trace")
    starts = [r[0] for r in ranges]
    # Launch calls (cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync, ...) share their
    # kernel's correlation id; CPU ops carry ids of another space, so only launches count.
    launch = {e.correlation_id(): e.start_ns() for e in on_cpu
              if e.name().startswith("cu") and e.name() not in COMPONENTS}
    for e in on_gpu:
        if e.name() in COMPONENTS:  # the labels' own GPU-side spans
            continue
        t = launch.get(e.correlation_id())
        label = "other"
        if t is not None:
            i = bisect.bisect_right(starts, t)
            inside = [r for r in ranges[max(0, i - 4):i] if r[0] <= t <= r[1]]
            if inside:
                label = min(inside, key=lambda r: r[1] - r[0])[2]
        per[label] += e.duration_ns() / 1e3
        count[label] += 1
    return per, count


def profile_components(session: Session, steps: int, inputs, device) -> tuple[dict, dict]:
    """Eager steps under torch.profiler with the model's regions labelled; time per step for
    each component, the rest as "other"; and (on the GPU) the kernels launched per step for
    each. Nothing where the family's model labels no regions."""
    from torch.profiler import ProfilerActivity, profile

    model = session.model
    if not hasattr(model, "annotate"):
        return {}, {}
    model.annotate = True
    saved = session.step_fn
    session.step_fn = session.graph_step or saved  # eager: the labels are host-side ranges
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            session.step(*inputs())
        if device.type == "cuda":
            torch.cuda.synchronize()
    session.step_fn = saved
    model.annotate = False
    per, count = attribute(prof, device)
    comps = {k: v / 1e3 / steps for k, v in per.items() if v}
    comps["total"] = sum(v for v in comps.values())
    kernels = {k: n / steps for k, n in count.items() if n}
    if kernels:
        kernels["total"] = sum(kernels.values())
    return comps, kernels


def profile_graphed(session: Session, steps: int, inputs, groups) -> dict:
    """Graph-replayed steps under torch.profiler: per step, the GPU time of each group of
    kernels (`groups`: the family's name fragments) at the clock the step really runs at,
    the idle time between kernels charged to the kernel that follows the gap (what each
    kernel boundary costs), and the kernels that take the most."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def group(name: str) -> str:
        return next((g for key, g in groups if key.lower() in name.lower()), "other")

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            session.step(*inputs())
        torch.cuda.synchronize()
    ev = sorted((e.start_ns(), e.end_ns(), e.name()) for e in prof.profiler.kineto_results.events()
                if e.device_type() == DeviceType.CUDA)
    busy, gap, count = {}, {}, {}
    by_name = collections.Counter()
    end = ev[0][0] if ev else 0
    for start, stop, name in ev:
        kind = group(name)
        busy[kind] = busy.get(kind, 0) + (stop - start)
        gap[kind] = gap.get(kind, 0) + max(0, start - end)
        count[kind] = count.get(kind, 0) + 1
        by_name[name] += stop - start
        end = max(end, stop)
    ms = 1e-6 / steps
    return {"span_ms": (end - ev[0][0]) * ms if ev else 0.0,
            "busy_ms": {k: v * ms for k, v in busy.items()},
            "gap_before_ms": {k: v * ms for k, v in gap.items()},
            "kernels": {k: v / steps for k, v in count.items()},
            "busy_total_ms": sum(busy.values()) * ms, "gap_total_ms": sum(gap.values()) * ms,
            "top_kernels_ms": {k: v * ms for k, v in by_name.most_common(TOP_KERNELS)}}


def fill_steps(session, shapes, inputs, steady: int, sessions: int, device) -> list[dict]:
    """Steps 0 .. steady of `sessions` new sessions, each timed: what a session's first
    steps (the cache filling, the calibration, the first steady one) cost, per step, as a
    live session steps them."""
    times = [[] for _ in range(steady + 1)]
    for _ in range(sessions):
        session.start(torch.randn(shapes.reference, device=device),
                      torch.randn(shapes.prompt, device=device))
        for k in range(steady + 1):
            x = inputs()
            with Span(device) as sp:
                session.step(*x)
            times[k].append(sp.ms)
    return [{"step": k, "ms": ms, "ms_p50": median(ms)} for k, ms in enumerate(times)]


def batched_steps(session: Session, shapes, inputs, sizes: list[int], graphed: bool,
                  runs: int, device) -> list[dict] | None:
    """The family's batched step at each size in `sizes` (2 or more), as charrun --batch runs
    it (stepping.Together over staging caches, a graph per size on a GPU), each place of the
    batch staged from `session` at a steady step: the batch's time with its staging copies
    (medians of `runs`), a session-chunk's share of it, and the copies timed alone. None
    where the family has no batched step."""
    if session.batch_step is None or not sizes:
        return None
    for _ in range(session.rule.warm_up_limit):  # to a step that joins a batch
        if session.batch_kind() is not None:
            break
        session.step(*inputs())
    together = Together(session, max(sizes))
    if graphed:
        together.capture(session, shapes)
    out = []
    for n in sizes:
        total, copies = [], []
        for _ in range(runs):
            xs = [inputs() for _ in range(n)]
            with Span(device) as sp:
                together.stage([session] * n)
            copies.append(sp.ms)
            with Span(device) as sp:
                together.rehearse(session, [x[0] for x in xs], [x[1] for x in xs])
            total.append(sp.ms)
        out.append({"sessions": n, "batch_ms_p50": median(total),
                    "session_chunk_ms_p50": median(total) / n,
                    "staging_copies_ms_p50": median(copies), "batch_ms": total,
                    "graphed": n in together.graphs})
    return out


def engine_session(path: Path, rank: int, engine_kernels: bool = True):
    """TP rank `rank` of the engine at `path` as charrun loads it: runtime/worker.py's Worker
    (over the rank's slice on a TP engine: weights, tables, GEMM plan and compiled kernels,
    warmed up with its graphs captured). Returns (session, config, GEMM plan)."""
    from charengine.runtime.engine import Engine
    from charengine.runtime.worker import Worker

    engine = Engine.load(path, ranks=[rank] if engine_tp(path) > 1 else None)
    worker = Worker(engine, rank_slice=rank if engine.config.tp > 1 else None,
                    engine_kernels=engine_kernels)
    print(f"engine {path}: rank {rank} ready in "
          f"{sum(worker.startup[k] for k in ('load_s', 'warm_up_s')):.1f} s, "
          f"{worker.compiles} compiled, GEMM plan {engine.gemm_plan(rank)}")
    return worker.session, engine.config, engine.gemm_plan(rank)


def engine_tp(path: Path) -> int:
    return json.loads((path / "manifest.json").read_text())["tp"]


def memory_session(args, device):
    """The arm's rank assembled in memory (charengine/assemble.py) from random weights made
    on the device (`bench_rank`), with the GEMM plan charbuild would measure on a GPU, or
    the one --gemm names. Returns (session, config, GEMM plan)."""
    base = preset(args.preset, tp=args.tp)
    fam = family_of(base)
    cfg = fam.arm(base, args.arm)
    if args.fast_accum is not None:
        linears = () if args.fast_accum == "none" else tuple(args.fast_accum.split(","))
        cfg = cfg.replace(numerics=dataclasses.replace(
            cfg.numerics, fast_accum=bool(linears), fast_accum_linears=linears or None))
    if args.switches:
        cfg = cfg.replace(switches=dataclasses.replace(cfg.switches,
                                                       **parse_switches(cfg, args.switches)))
    mapping = Mapping(args.tp, args.rank, str(device), str(device), alone=True)
    with torch.inference_mode():
        state, tables = fam.bench_rank(cfg, args.seed, device, args.rank)
        plan = dict(item.split("=", 1) for item in args.gemm.split(",")) if args.gemm else {}
        if device.type == "cuda" and not plan and cfg.numerics.fp8_gemm:
            from charengine.builder.bake import gemm_plan

            plan, _ = gemm_plan(cfg, state, mapping)
        extra = {}
        if args.attention_tiles:
            from charengine.plugins.attention import AttentionTiles

            extra["attention_tiles"] = AttentionTiles.parse(args.attention_tiles)
        session = rank_session(cfg, state, mapping, tables=tables, gemm_plan=plan,
                               graphed=device.type == "cuda" and not args.no_graphs, **extra)
        if device.type == "cuda" and not args.no_graphs:
            fam.warm_up(session)  # its graphs captured and uploaded, as charrun's warm-up
    return session, cfg, plan


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, default=None,
                    help="an engine directory from charbuild (a TP engine's rank files: "
                         "--ranks R); the rank measured is --rank")
    ap.add_argument("--preset", default="characters-57b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--arm", default=None, help="the family's arm (default: production)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--exclude", type=int, default=None,
                    help="first steps left out of the steady figures (default: the family's "
                         "first steady step and one more)")
    ap.add_argument("--profile-steps", type=int, default=2,
                    help="eager steps profiled by region (where the family's model labels them)")
    ap.add_argument("--profile-graph-steps", type=int, default=3,
                    help="graph-replayed steps profiled by kernel (on a GPU)")
    ap.add_argument("--fill-sessions", type=int, default=0,
                    help="new sessions whose first steps are timed")
    ap.add_argument("--no-graphs", action="store_true", help="eager steps (no CUDA graphs)")
    ap.add_argument("--batches", default="", metavar="N,...",
                    help="batch sizes (2 or more) of the family's batched step to time")
    ap.add_argument("--batch-runs", type=int, default=10,
                    help="batches timed at each size (medians)")
    ap.add_argument("--switches", default=None, metavar="NAME=0|1,...",
                    help="switches of the arm turned on or off")
    ap.add_argument("--fast-accum", default=None, metavar="LINEARS",
                    help="FP8 GEMMs without promoted sums on these linears (none: on none)")
    ap.add_argument("--attention-tiles", default=None,
                    help="the attention kernel's tiles (plugins/attention.AttentionTiles.parse)")
    ap.add_argument("--gemm", default=None, metavar="KIND=CHOICE,...",
                    help="a GEMM choice (plugins/gemm.py) per linear kind, as an engine's "
                         "plan gives them (default: the plan charbuild would measure)")
    ap.add_argument("--tag", default="", help="suffix of the result file's arm name")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gpu-tag", default="h200")
    ap.add_argument("--run", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    args = ap.parse_args()

    device = torch.device(args.device)
    t0 = time.perf_counter()
    if args.engine is not None:
        session, cfg, plan = engine_session(args.engine, args.rank, engine_kernels=True)
        args.preset, args.tp, args.arm = cfg.model.name, cfg.tp, args.arm or "engine"
        device = session.device
    else:
        args.arm = args.arm or "production"
        session, cfg, plan = memory_session(args, device)
    fam = family_of(cfg)
    spec = cfg.model
    graphed = device.type == "cuda" and not args.no_graphs
    build_s = time.perf_counter() - t0
    steady_from = fam.steady_from(cfg)
    exclude = steady_from + 1 if args.exclude is None else args.exclude
    shapes = fam.step_shapes(spec)
    g = torch.Generator(device=device).manual_seed(args.seed + 1)

    def inputs():
        """A step's noise and audio features, on the device before the step is timed."""
        return (torch.randn(shapes.noise_shape, device=device, generator=g),
                torch.randn(shapes.features, device=device, generator=g))

    backends = None
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backends = sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], set_priority=True)
        backends.__enter__()

    with torch.inference_mode():
        ref = torch.randn(shapes.reference, device=device, generator=g)
        prompt = torch.randn(shapes.prompt, device=device, generator=g)
        t1 = time.perf_counter()
        session.start(ref, prompt)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start_s = time.perf_counter() - t1
        marks, host, resets = [], [], []
        sync_checked = False
        clocks = ClockSampler(device.index or 0) if device.type == "cuda" else None
        if clocks is not None:
            clocks.__enter__()
        for k in range(args.steps):
            if graphed and k > steady_from and not sync_checked:
                torch.cuda.set_sync_debug_mode("error")  # no host sync inside a steady step
                sync_checked = True
            if session.rule.resets_at(session.cache, k):
                resets.append(k)
            x = inputs()
            h0 = time.perf_counter()
            marks.append(Mark(lambda: session.step(*x), device))
            host.append(time.perf_counter() - h0)
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            clocks.__exit__(None, None, None)
        diffusion = [m.ms for m in marks]
        period = [diffusion[0]] + [marks[k].since(marks[k - 1]) for k in range(1, len(marks))]
        comps, kernels = profile_components(session, args.profile_steps, inputs, device) \
            if args.profile_steps else ({}, {})
        graphed_profile = profile_graphed(session, args.profile_graph_steps, inputs,
                                          fam.kernel_groups()) \
            if graphed and args.profile_graph_steps else None
        fill = fill_steps(session, shapes, inputs, steady_from, args.fill_sessions, device) \
            if args.fill_sessions else None
        try:
            floors_mod = importlib.import_module(f"floors_{fam.name}")
        except ModuleNotFoundError:
            floors_mod = None
        measured = floors_mod.measured_floors(session, device, plan) if floors_mod else None
        sizes = [int(x) for x in args.batches.split(",") if x]
        if any(n < 2 for n in sizes):
            raise SystemExit("--batches: sizes of 2 or more (a batch of one is the step)")
        batched = batched_steps(session, shapes, inputs, sizes, graphed, args.batch_runs,
                                device)
    if backends is not None:
        backends.__exit__(None, None, None)

    steady = range(exclude, args.steps)
    reset_ms = [diffusion[k] for k in resets if k >= exclude]
    d_st, p_st = [diffusion[k] for k in steady], [period[k] for k in steady]
    flops = fam.step_flops(cfg, args.rank)
    d50 = percentile(d_st, 50)
    frames = spec.frames_per_latent
    gemm_peak = DENSE_TFLOPS["fp8" if cfg.numerics.fp8_gemm else "bf16"]
    attn_peak = DENSE_TFLOPS["fp8" if cfg.numerics.fp8_attention else "bf16"]
    floors = {"gemm_ms": flops["gemm"] / gemm_peak / 1e9,
              "attention_ms": flops["attention"] / attn_peak / 1e9}
    result = {
        "preset": args.preset, "family": fam.name,
        "layout": f"tp{args.tp}-rank{args.rank}" if args.tp > 1 else "tp1",
        "gpu": args.gpu_tag, "arm": args.arm + args.tag, "run": args.run,
        "attention_tiles": args.attention_tiles, "gemm_plan": plan,
        "switches": dataclasses.asdict(cfg.switches),
        "numerics": dataclasses.asdict(cfg.numerics),
        "graphs": graphed, "steps": args.steps, "exclude": exclude,
        "diffusion_p50_ms": d50, "diffusion_p90_ms": percentile(d_st, 90),
        "period_p50_ms": percentile(p_st, 50), "period_p90_ms": percentile(p_st, 90),
        "reset_step_ms": statistics.median(reset_ms) if reset_ms else None,
        "capacity_fps": 1000 * frames / percentile(p_st, 50),
        "sustained_fps": 1000 * frames * len(p_st) / sum(p_st),
        "host_step_p50_ms": 1e3 * percentile([host[k] for k in steady], 50),
        "step_tflop": {k: v / 1e12 for k, v in flops.items()},
        "tflops": sum(flops.values()) / (d50 / 1e3) / 1e12,
        "floors_at_dense_peak_ms": floors,
        "step_over_dense_floor": d50 / sum(floors.values()),
        "components_ms": comps, "kernels_per_step": kernels,
        "graphed_step_profile": graphed_profile, "fill_steps": fill,
        "floors_ms": measured, "batched": batched,
        "step_over_floor": d50 / (measured["fp8_gemm_ms"] + measured["attention_ms"])
        if measured else None,
        "build_s": build_s, "session_start_s": start_s,
        "sync_debug_mode_checked": sync_checked,
        "clocks_during_steps": clocks.summary if clocks is not None else None,
        "machine": this_machine(), **provenance(),
        "diffusion_ms": diffusion, "period_ms": period,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = (f"session_{args.preset}_{result['layout']}_{args.gpu_tag}_{result['arm']}_"
            f"{args.run}.json")
    (args.out / name).write_text(json.dumps(result, indent=1) + "\n")
    keys = ("diffusion_p50_ms", "diffusion_p90_ms", "period_p50_ms", "period_p90_ms",
            "reset_step_ms", "capacity_fps", "sustained_fps", "tflops",
            "step_over_dense_floor", "step_over_floor")
    print(f"{args.arm} run {args.run}: " + ", ".join(
        f"{k}={result[k]:.2f}" for k in keys if result[k] is not None))
    if comps:
        print("components (ms/step): " + ", ".join(f"{k}={v:.2f}" for k, v in comps.items()))
    if kernels:
        print("kernels per step: " + ", ".join(f"{k}={v:.0f}" for k, v in kernels.items()))
    for b in batched or ():
        print(f"batch of {b['sessions']}: {b['batch_ms_p50']:.2f} ms, "
              f"{b['session_chunk_ms_p50']:.2f} ms a session's step (alone {d50:.2f}), "
              f"staging copies {b['staging_copies_ms_p50']:.2f} ms")
    print("floors at the dense peaks (ms/step): " + ", ".join(
        f"{k}={v:.2f}" for k, v in floors.items()))
    if measured:
        print("floors measured (ms/step): " + ", ".join(
            f"{k}={v:.2f}" for k, v in measured.items()))
    if graphed_profile:
        gp = graphed_profile
        print(f"graphed step: span {gp['span_ms']:.2f} ms, kernels {gp['busy_total_ms']:.2f}, "
              f"gaps {gp['gap_total_ms']:.2f}; per group (busy / gaps before / count): "
              + ", ".join(f"{k}={gp['busy_ms'][k]:.2f}/{gp['gap_before_ms'][k]:.2f}/"
                          f"{gp['kernels'][k]:.0f}" for k in gp["busy_ms"]))
    for f in fill or ():
        print(f"step {f['step']} of a new session: {f['ms_p50']:.1f} ms (runs "
              f"{', '.join(f'{x:.1f}' for x in f['ms'])})")
    if result["clocks_during_steps"]:
        print("clocks during the steps: " + ", ".join(
            f"{k}={v:.2f}" for k, v in result["clocks_during_steps"].items()))


if __name__ == "__main__":
    main()
