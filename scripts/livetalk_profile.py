"""Where a steady LiveTalk chunk's GPU time goes: the chunk as charrun's rank runs it (CUDA
graphs replayed), a preset with random weights and an arm as scripts/long_session.py
takes them, profiled over several chunks with the window full; each kernel's time per chunk,
grouped (GEMMs, attention, quantization, norms and the rest), beside the chunk's GEMM and
attention floors at the GPU's dense peaks. Each timed chunk's inputs are drawn and on the
device before its timing starts, as long_session.py times a chunk (drawn inside
it, their host-side draw left the GPU idle for about 4 ms of each chunk's figure:
docs/PERFORMANCE_LOG.md).

    python scripts/livetalk_profile.py --preset livetalk-1.3b --arm preset \\
        --out docs/results/livetalk/profile_livetalk-1.3b_preset.json

`--fill-sessions N` also times a session's first chunks (those that fill the cache, the
calibration's and the first steady one) over N new sessions after the warm-up, as a live
session steps them, and profiles each of them once: `fill_chunks` in the JSON.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from charengine.assemble import rank_session
from charengine.config import preset
from charengine.family import family
from charengine.livetalk.rank import kinds
from charengine.livetalk.spec import arm_config
from charengine.mapping import Mapping
from charengine.runtime.engine import Engine
from charengine.timing import Span, median

# kernel name fragment -> group (the first match wins)
GROUPS = (("pre_attention", "pre-attention"), ("attention_tma_kernel", "fp8 attention"),
          ("attention_kernel", "fp8 attention"), ("attention_split", "fp8 attention"),
          ("attention_merge", "fp8 attention"), ("attention_pipelined", "fp8 attention"),
          ("flash", "sdpa attention"), ("fmha", "sdpa attention"), ("cudnn", "sdpa attention"),
          ("nvjet", "gemm"), ("gemm", "gemm"), ("sm90_xmma", "gemm"), ("cutlass", "gemm"),
          ("quant", "quantization"), ("norm", "norms"), ("index", "cache write"),
          ("elementwise", "elementwise"), ("reduce", "reductions"), ("cat", "copies"),
          ("copy", "copies"))
DENSE_TFLOPS = {"bf16": 989.0, "fp8": 1979.0}  # H100/H200 SXM dense tensor-core peaks


def group(name: str) -> str:
    low = name.lower()
    return next((g for key, g in GROUPS if key in low), "other")


def chunk_flop(cfg) -> dict[str, float]:
    """A steady chunk's GEMM and self-attention FLOP (passes + the commit pass)."""
    spec = cfg.model
    T, d, f, L = spec.chunk_tokens, spec.dim, spec.ffn_dim, spec.n_blocks
    forwards = cfg.schedule.passes + 1
    gemm = 2 * T * L * (4 * d * d + 2 * d * d + 2 * d * f) * forwards
    S = spec.cache_frames * spec.frame_tokens
    attn = 4 * T * S * spec.head_dim * spec.n_heads * L * forwards
    return {"gemm_tflop": gemm / 1e12, "attention_tflop": attn / 1e12}


def kernel_ms(prof, chunks: int, calls: bool = False) -> collections.Counter:
    """Each CUDA kernel's time per chunk (ms) in a profile of `chunks` chunks; with calls,
    its launches per chunk instead."""
    kernels = collections.Counter()
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0)
        if t and e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.key] += (e.count if calls else t / 1e3) / chunks
    return kernels


def grouped(kernels: collections.Counter) -> dict[str, float]:
    groups = collections.Counter()
    for name, t in kernels.items():
        groups[group(name)] += t
    return dict(groups.most_common())


def first_chunks(session, shapes, step, inputs, steady: int, sessions: int, dev
                 ) -> list[dict]:
    """Chunks 0 .. steady of `sessions` new sessions, each timed on the device; then one more
    session with each of those chunks profiled alone. Per chunk: its times, their median,
    its kernels' time and their groups."""
    times = [[] for _ in range(steady + 1)]
    profs = []
    for s in range(sessions + 1):
        session.start(torch.randn(shapes.reference, device=dev),
                      torch.randn(shapes.prompt, device=dev))
        for c in range(steady + 1):
            if s < sessions:
                ins = inputs()
                with Span(dev) as sp:
                    step(ins)
                times[c].append(sp.ms)
            else:
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    step()
                    torch.cuda.synchronize()
                profs.append(prof)
    out = []
    for c, (ms, prof) in enumerate(zip(times, profs)):
        kernels = kernel_ms(prof, 1)
        out.append({"chunk": c, "ms": ms, "ms_p50": median(ms),
                    "kernel_ms": sum(kernels.values()), "groups_ms": grouped(kernels),
                    "top_kernels_ms": dict(kernels.most_common(8))})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="livetalk-1.3b")
    ap.add_argument("--arm", choices=("preset", "bf16"), default="preset")
    ap.add_argument("--chunks", type=int, default=6, help="profiled steady chunks")
    ap.add_argument("--off", nargs="*", default=[], metavar="SWITCH",
                    help="switches of the arm turned off")
    ap.add_argument("--on", nargs="*", default=[], metavar="SWITCH",
                    help="switches of the arm turned on")
    ap.add_argument("--fill-sessions", type=int, default=0,
                    help="new sessions whose first chunks are timed and profiled")
    ap.add_argument("--gemm", default=None, metavar="CHOICE",
                    help="a GEMM choice (plugins/gemm.py) for every linear kind, as an engine's "
                         "plan gives them (default: scaled_mm)")
    ap.add_argument("--engine", type=Path, default=None,
                    help="an engine directory from charbuild: its rank-0 GEMM plan, the GEMMs "
                         "charrun runs (instead of --gemm)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.engine is not None and args.gemm is not None:
        ap.error("give --engine (its GEMM plan) or --gemm, not both")
    cfg = preset(args.preset)
    fam = family(cfg.family)
    cfg = arm_config(cfg, args.arm)
    cfg = cfg.replace(switches=dataclasses.replace(cfg.switches, **{n: False for n in args.off},
                                                   **{n: True for n in args.on}))
    dev = torch.device("cuda")
    full = fam.random_weights(cfg.model, args.seed)
    plan = {kind: args.gemm for kind in kinds(cfg)} if args.gemm else None
    if args.engine is not None:
        plan = Engine.load(args.engine).gemm_plan(0)
    session = rank_session(cfg, fam.rank_state(cfg, full), Mapping.single("cuda"),
                           tables=fam.bake_tables(cfg, full), gemm_plan=plan)
    fam.warm_up(session)
    spec, shapes = cfg.model, fam.step_shapes(cfg.model)
    g = torch.Generator().manual_seed(args.seed)

    def inputs():
        """A chunk's noise and audio features, on the device before the chunk is timed (as
        long_session.py times it): their host-side draw is not diffusion."""
        return (torch.randn(shapes.noise_shape, generator=g).to(dev),
                torch.randn(shapes.features, generator=g).to(dev))

    def step(ins=None):
        return session.step(*(ins or inputs()))

    with torch.inference_mode():
        session.start(torch.randn(shapes.reference, generator=g).to(dev),
                      torch.randn(shapes.prompt, generator=g).to(dev))
        for _ in range(spec.sink_chunks + spec.window_chunks + 2):  # fill, calibrate, capture
            step()
        ms = []
        for _ in range(args.chunks):
            ins = inputs()
            with Span(dev) as s:
                step(ins)
            ms.append(s.ms)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.chunks):
                step()
            torch.cuda.synchronize()
        fill = first_chunks(session, shapes, step, inputs, fam.steady_from(cfg),
                            args.fill_sessions, dev) \
            if args.fill_sessions else None
    kernels = kernel_ms(prof, args.chunks)
    calls = kernel_ms(prof, args.chunks, calls=True)
    groups = grouped(kernels)
    flop = chunk_flop(cfg)
    precision = "fp8" if cfg.numerics.fp8_gemm else "bf16"
    floors = {"gemm_floor_ms": flop["gemm_tflop"] / DENSE_TFLOPS[precision] * 1e3,
              "attention_floor_ms": flop["attention_tflop"] / DENSE_TFLOPS[
                  "fp8" if cfg.switches.fp8_kv else "bf16"] * 1e3}
    summary = {"preset": spec.name, "arm": args.arm, "off": args.off, "on": args.on,
               "gemm": args.gemm, "gemm_plan": plan,
               "gpu": torch.cuda.get_device_name(dev),
               "date": time.strftime("%Y-%m-%d"), "chunk_ms_p50": median(ms), "chunk_ms": ms,
               "kernel_ms_per_chunk": sum(kernels.values()), **flop, **floors,
               "groups_ms": groups,
               "top_kernels_ms": dict(kernels.most_common(25)),
               "kernel_calls_per_chunk": sum(calls.values()),
               "top_kernels_calls": {k: calls[k] for k in dict(kernels.most_common(25))}}
    if fill is not None:
        summary["fill_chunks"] = fill
    print(json.dumps({k: v for k, v in summary.items()
                      if k not in ("top_kernels_ms", "fill_chunks")}, indent=1))
    for c in fill or ():
        print(f"chunk {c['chunk']}: {c['ms_p50']:.1f} ms (runs {c['ms']}), kernels "
              f"{c['kernel_ms']:.1f} ms: " + ", ".join(f"{g} {t:.1f}"
                                                       for g, t in c["groups_ms"].items()))
    for name, t in kernels.most_common(25):
        print(f"{t:8.2f} ms  {group(name):15s} {name[:110]}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
