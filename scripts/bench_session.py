"""Session benchmark on one GPU: one TP rank's slice (the all-reduce left out), a
live-length session with the window full and resets included, per-step CUDA-event timings,
a torch.profiler breakdown laid out like paper Table 2, and the GEMM and attention floors
measured alone in the same process.

With --engine, the rank is loaded as charrun loads it (runtime/worker.py: the engine's
weights, tables, GEMM plan and compiled kernels, the warm-up that captures the step graphs):
the headline numbers. Without, the rank of --preset/--arm is assembled in memory from random
weights made on the device (charengine/assemble.py, the same assembly) with the GEMM plan
charbuild would measure (builder/bake.py), for the switch arms.

    charbuild --target h100-tp3 --ranks 0 --out engines/h100-tp3-r0
    python scripts/bench_session.py --engine engines/h100-tp3-r0 --rank 0
    python scripts/bench_session.py --preset characters-57b --tp 3 --arm production
    python scripts/bench_session.py --preset tiny --device cpu --steps 100 --exclude 20

Writes one JSON per run (docs/results/bench_<preset>_<layout>_<gpu>_<arm>_<run>.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from charengine.assemble import rank_session
from charengine.characters.cache import KVCache
from charengine.characters.model import CharacterDiT, bake_adaln
from charengine.characters.spec import RankShape
from charengine.characters.step import ar_step
from charengine.stepping import Session
from charengine.characters.weights import random_rank_state
from charengine.config import EngineConfig, preset
from charengine.characters.config import LINEARS, Switches
from charengine.engine_format import this_machine
from charengine.mapping import Mapping
from charengine.timing import Mark
from charengine.plugins import gemm
from charengine.plugins.attention import AttentionTiles

DENSE_FP8_PEAK_TFLOPS = 1979.0  # H100/H200 SXM datasheet, dense
COMPONENTS = ("fp8_gemm", "gemm", "act_quant", "cache_upkeep", "pre_attention", "attention",
              "adaln")


def arm_switches(arm: str) -> Switches:
    if arm == "production":
        return Switches()
    return Switches.cumulative(arm)


def arm_config(arm: str, preset_name: str, tp: int) -> EngineConfig:
    """The arm's config. The switch arms (the waterfall's bars) hold the FP8 GEMMs at
    promoted sums, as every arm was measured before fast accumulation became the default
    (ddafc98, 2026-11-30); "production" is the preset as shipped, fast accumulation included, so the
    waterfall's last bar adds it."""
    cfg = preset(preset_name, tp=tp, switches=arm_switches(arm))
    if arm != "production":
        cfg = cfg.replace(numerics=dataclasses.replace(cfg.numerics, fast_accum=False))
    return cfg


def parse_switches(text: str) -> dict[str, bool]:
    """'gemm_residual=1,fused_residual=0' -> {"gemm_residual": True, "fused_residual": False}."""
    known = {f.name for f in dataclasses.fields(Switches)}
    out = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in known or value not in ("0", "1"):
            raise SystemExit(f"--switches: {item!r} is not NAME=0|1 with NAME among "
                             f"{', '.join(sorted(known))}")
        out[name] = value == "1"
    return out


def step_flops(cfg: EngineConfig, shape: RankShape) -> tuple[float, float]:
    """(GEMM, attention) FLOP of one AR step on this rank."""
    spec, T = cfg.model, cfg.model.tokens_per_frame
    calls = spec.n_blocks * cfg.schedule.passes
    gemm = 2 * T * spec.dim * (shape.in_proj_rows(spec) + shape.out_proj_cols(spec)) * calls
    slots = spec.global_tokens + cfg.cache.window * T
    attn = 4 * T * slots * shape.attn_width(spec) * calls
    return gemm, attn


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


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def floors(model: CharacterDiT, cache: KVCache, device, plan: dict, reps: int = 5) -> dict:
    """The step's FP8 GEMMs alone (its own weights, pre-quantized activations, the same
    kernels) and its attention alone (the same kernel, FP8 or the bf16 SDPA backend, over
    caches of the step's shape rotated past L2), each captured as one CUDA graph of a step's
    calls."""
    from charengine import fp8

    spec, cfg = model.spec, model.cfg
    T = spec.tokens_per_frame
    g = torch.Generator(device=device).manual_seed(0)
    a_in = fp8.quantize_rows(torch.randn(T, spec.dim, device=device, generator=g))
    a_out = fp8.quantize_rows(torch.randn(T, model.A + model.rank.mlp, device=device, generator=g))
    q = torch.randn(model.rank.heads, T, spec.head_dim, device=device, generator=g).to(model.dtype)
    kernel = model.ops.attention.kernel
    fp8_attention = kernel is not None and cache.fp8_kv
    n = min(8, cache.bp)
    if fp8_attention:  # the step's kernel over FP8 caches of the step's shape
        q8, qs = fp8.quantize_rows(q)
        kv = [(cache.k8[i], cache.v8[i], cache.scale[i, 0], cache.scale[i, 1]) for i in range(n)]
    else:
        kv = [(cache.k[i], cache.v[i]) for i in range(n)]

    def gemms():
        for _ in range(cfg.schedule.passes):
            for b in range(spec.n_blocks):
                for (aq, a_s), w in ((a_in, "w_in"), (a_out, "w_out")):
                    mm = gemm.select(plan.get(w))
                    mm(aq, a_s, model.w[f"blocks.{b}.{w}.q"], model.w[f"blocks.{b}.{w}.scale"],
                         model.dtype, cfg.numerics.fast_accum_for(w))

    def attention():
        for i in range(cfg.schedule.passes * spec.n_blocks):
            if fp8_attention:
                kernel(q8, qs, *kv[i % n], model.dtype)
            else:
                k, v = kv[i % n]
                torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None])

    out = {}
    for name, fn in (("fp8_gemm", gemms), ("attention", attention)):
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            graph.replay()
            marks = [Mark(graph.replay, device) for _ in range(reps)]
            torch.cuda.synchronize()
        else:
            marks = [Mark(fn, device) for _ in range(reps)]
        times = [m.ms for m in marks]
        out[f"{name}_ms"] = statistics.median(times)
    return out


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
    """Eager steps under torch.profiler with the model's regions labelled; GPU time per
    step for each component, the rest as "other"; and (on the GPU) the kernels launched per
    step for each."""
    from torch.profiler import ProfilerActivity, profile

    model = session.model
    model.annotate = True
    saved = session.step_fn
    session.step_fn = ar_step
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


# kernel name -> component, first match wins (pre-attention before attention)
KERNEL_KINDS = (("nvjet", "fp8_gemm"), ("Memset", "fp8_gemm_memset"), ("gemm", "fp8_gemm"),
                ("pre_attention", "pre_attention"), ("attention", "attention"),
                ("swiglu", "act_quant"), ("norm_modulate", "act_quant"),
                ("act_quant", "act_quant"), ("delta_rotation", "delta_rotation"))


def kernel_kind(name: str) -> str:
    return next((kind for key, kind in KERNEL_KINDS if key in name), "other")


def profile_graphed(session: Session, steps: int, inputs) -> dict:
    """Graph-replayed steps under torch.profiler: per step, the GPU time of each kind of
    kernel (by name) at the clock the step really runs at, and the idle time between kernels,
    charged to the kernel that follows the gap (what each kernel boundary costs)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.autograd import DeviceType

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            session.step(*inputs())
        torch.cuda.synchronize()
    ev = sorted((e.start_ns(), e.end_ns(), e.name()) for e in prof.profiler.kineto_results.events()
                if e.device_type() == DeviceType.CUDA)
    busy, gap, count = {}, {}, {}
    end = ev[0][0] if ev else 0
    for start, stop, name in ev:
        kind = kernel_kind(name)
        busy[kind] = busy.get(kind, 0) + (stop - start)
        gap[kind] = gap.get(kind, 0) + max(0, start - end)
        count[kind] = count.get(kind, 0) + 1
        end = max(end, stop)
    ms = 1e-6 / steps
    return {"span_ms": (end - ev[0][0]) * ms if ev else 0.0,
            "busy_ms": {k: v * ms for k, v in busy.items()},
            "gap_before_ms": {k: v * ms for k, v in gap.items()},
            "kernels": {k: v / steps for k, v in count.items()},
            "busy_total_ms": sum(busy.values()) * ms, "gap_total_ms": sum(gap.values()) * ms}


def engine_session(path: Path, rank: int, engine_kernels: bool = True):
    """TP rank `rank` of the engine at `path` as charrun loads it: runtime/worker.py's Worker
    over the rank's slice (weights, tables, GEMM plan and compiled kernels, warmed up with its
    graphs captured). Returns (session, config, GEMM plan)."""
    from charengine.runtime.engine import Engine
    from charengine.runtime.worker import Worker

    engine = Engine.load(path, ranks=[rank])
    worker = Worker(engine, rank_slice=rank, engine_kernels=engine_kernels)
    print(f"engine {path}: rank {rank} ready in {sum(worker.startup[k] for k in ('load_s', 'warm_up_s')):.1f} s, "
          f"{worker.compiles} compiled, GEMM plan {engine.gemm_plan(rank)}")
    return worker.session, engine.config, engine.gemm_plan(rank)


def memory_session(args, device):
    """The arm's rank assembled in memory (charengine/assemble.py) from random weights made
    on the device, with the GEMM plan charbuild would measure on a GPU (builder/bake.py), or
    the one --gemm-in/--gemm-out name. Returns (session, config, GEMM plan)."""
    cfg = arm_config(args.arm or "production", args.preset, args.tp)
    if args.fast_accum is not None:
        linears = () if args.fast_accum == "none" else tuple(args.fast_accum.split(","))
        cfg = cfg.replace(numerics=dataclasses.replace(
            cfg.numerics, fast_accum=bool(linears), fast_accum_linears=linears or LINEARS))
    if args.switches:
        cfg = cfg.replace(switches=dataclasses.replace(cfg.switches,
                                                       **parse_switches(args.switches)))
    spec = cfg.model
    shape = RankShape.of(spec, args.tp, args.rank)
    mapping = Mapping(args.tp, args.rank, str(device), str(device), alone=True)
    with torch.inference_mode():
        state, adaln_w = random_rank_state(spec, shape, args.seed, device,
                                           getattr(torch, cfg.numerics.dtype),
                                           keep_adaln_weights=not cfg.switches.baked_adaln)
        tables = bake_adaln(cfg, adaln_w)
        del adaln_w
        plan = {k: c for k, c in (("w_in", args.gemm_in), ("w_out", args.gemm_out)) if c}
        if device.type == "cuda" and not plan:
            from charengine.builder.bake import gemm_plan

            plan, _ = gemm_plan(cfg, state, mapping)
        tiles = AttentionTiles.parse(args.attention_tiles) if args.attention_tiles else None
        session = rank_session(cfg, state, mapping, tables=tables, gemm_plan=plan,
                               graphed=device.type == "cuda" and not args.no_graphs,
                               attention_tiles=tiles)
    return session, cfg, plan


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, default=None,
                    help="an engine directory: its rank --rank loaded as charrun loads it")
    ap.add_argument("--preset", default="characters-57b")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--arm", default=None, help="the switch arm (default: production)",
                    choices=["production", "baseline", *Switches.ORDER])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--exclude", type=int, default=60, help="first steps left out of steady state")
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--profile-graph-steps", type=int, default=3,
                    help="graph-replayed steps profiled for kernel time and gaps (GPU only)")
    ap.add_argument("--no-graphs", action="store_true", help="eager steps (no CUDA graphs)")
    ap.add_argument("--switches", default=None, metavar="NAME=0|1,...",
                    help="switches set on top of the arm's, e.g. gemm_residual=1")
    ap.add_argument("--fast-accum", default=None, metavar="LINEARS",
                    help="FP8 fast accumulation on these block linears (w_in,w_out; w_in; "
                         "none: every partial sum promoted); default: the preset's numerics")
    ap.add_argument("--attention-tiles", default=None,
                    help="FP8 attention kernel tiles, e.g. 128,128,8,3,bf16,tma")
    ap.add_argument("--gemm-in", default=None, metavar="CHOICE",
                    help="the input projection's GEMM, as an engine's plan records it "
                         "(scaled_mm, triton, triton:<GemmTiles spec>)")
    ap.add_argument("--gemm-out", default=None, metavar="CHOICE",
                    help="the output projection's GEMM (as --gemm-in)")
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
        device = session.cache.step.device
    else:
        args.arm = args.arm or "production"
        session, cfg, plan = memory_session(args, device)
    model, cache = session.model, session.cache
    spec, shape = cfg.model, model.rank
    graphed = device.type == "cuda" and not args.no_graphs
    build_s = time.perf_counter() - t0

    g = torch.Generator(device=device).manual_seed(args.seed + 1)
    lat = (spec.latent_channels, spec.latent_h, spec.latent_w)

    def inputs():
        return (torch.randn(lat, device=device, generator=g),
                torch.randn(spec.audio_tokens, spec.audio_dim, device=device, generator=g))

    backends = None
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backends = sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], set_priority=True)
        backends.__enter__()

    with torch.inference_mode():
        ref = torch.randn(lat, device=device, generator=g)
        prompt = torch.randn(spec.prompt_tokens, spec.text_dim, device=device, generator=g)
        t1 = time.perf_counter()
        session.start(ref, prompt)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start_s = time.perf_counter() - t1
        marks, host = [], []
        sync_checked = False
        clocks = ClockSampler(device.index or 0) if device.type == "cuda" else None
        if clocks is not None:
            clocks.__enter__()
        for k in range(args.steps):
            steady = graphed and k > cfg.cache.calibration_steps + 1
            if steady and not sync_checked:
                torch.cuda.set_sync_debug_mode("error")
                sync_checked = True
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
        graphed_profile = profile_graphed(session, args.profile_graph_steps, inputs) \
            if graphed and args.profile_graph_steps else None
        fl = floors(model, cache, device, plan)
    if backends is not None:
        backends.__exit__(None, None, None)

    P = cfg.cache.reset_period
    steady = range(args.exclude, args.steps)
    resets = [diffusion[k] for k in range(cfg.cache.calibration_steps + 2, args.steps) if k % P == 0]
    d_st, p_st = [diffusion[k] for k in steady], [period[k] for k in steady]
    gemm_f, attn_f = step_flops(cfg, shape)
    d50 = pct(d_st, 50)
    frames = cfg.model.frames_per_latent
    result = {
        "preset": args.preset, "layout": f"tp{args.tp}-rank{args.rank}" if args.tp > 1 else "tp1",
        "gpu": args.gpu_tag, "arm": args.arm + args.tag, "run": args.run,
        "attention_tiles": args.attention_tiles, "gemm_plan": plan,
        "switches": cfg.switches.__dict__, "numerics": cfg.numerics.__dict__,
        "graphs": graphed, "steps": args.steps, "exclude": args.exclude,
        "diffusion_p50_ms": d50, "diffusion_p90_ms": pct(d_st, 90),
        "period_p50_ms": pct(p_st, 50), "period_p90_ms": pct(p_st, 90),
        "reset_step_ms": statistics.median(resets) if resets else None,
        "capacity_fps": 1000 * frames / pct(p_st, 50),
        "sustained_fps": 1000 * frames * len(p_st) / sum(p_st),
        "host_step_p50_ms": 1e3 * pct([host[k] for k in steady], 50),
        "tflops_per_gpu": (gemm_f + attn_f) / (d50 / 1e3) / 1e12,
        "pct_dense_fp8_peak": 100 * (gemm_f + attn_f) / (d50 / 1e3) / 1e12 / DENSE_FP8_PEAK_TFLOPS,
        "step_tflop": {"gemm": gemm_f / 1e12, "attention": attn_f / 1e12},
        "components_ms": comps, "kernels_per_step": kernels,
        "graphed_step_profile": graphed_profile, "floors_ms": fl,
        "step_over_floor": d50 / (fl["fp8_gemm_ms"] + fl["attention_ms"]),
        "build_s": build_s, "session_start_s": start_s,
        "sync_debug_mode_checked": sync_checked,
        "clocks_during_steps": clocks.summary if clocks is not None else None,
        "machine": this_machine(), "date": time.strftime("%Y-%m-%d"),
        "diffusion_ms": diffusion, "period_ms": period,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"bench_{args.preset}_{result['layout']}_{args.gpu_tag}_{result['arm']}_{args.run}.json"
    (args.out / name).write_text(json.dumps(result, indent=1) + "\n")
    keys = ("diffusion_p50_ms", "diffusion_p90_ms", "period_p50_ms", "period_p90_ms",
            "reset_step_ms", "capacity_fps", "sustained_fps", "tflops_per_gpu",
            "pct_dense_fp8_peak", "step_over_floor")
    print(f"{args.arm} run {args.run}: " + ", ".join(
        f"{k}={result[k]:.2f}" for k in keys if result[k] is not None))
    print("components (ms/step): " + ", ".join(f"{k}={v:.2f}" for k, v in comps.items()))
    if kernels:
        print("kernels per step: " + ", ".join(f"{k}={v:.0f}" for k, v in kernels.items()))
    print("floors (ms/step): " + ", ".join(f"{k}={v:.2f}" for k, v in fl.items()))
    if graphed_profile:
        gp = graphed_profile
        print(f"graphed step: span {gp['span_ms']:.2f} ms, kernels {gp['busy_total_ms']:.2f}, "
              f"gaps {gp['gap_total_ms']:.2f}; per kind (busy / gaps before / count): " + ", ".join(
                  f"{k}={gp['busy_ms'][k]:.2f}/{gp['gap_before_ms'][k]:.2f}/{gp['kernels'][k]:.0f}"
                  for k in gp["busy_ms"]))
    if result["clocks_during_steps"]:
        print("clocks during the steps: " + ", ".join(
            f"{k}={v:.2f}" for k, v in result["clocks_during_steps"].items()))


if __name__ == "__main__":
    main()
