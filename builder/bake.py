"""Compile a GPU engine's kernels with Triton's cache pointed into the engine: the rank's
weights and tables loaded from the engine being built onto the GPU, as charrun loads them;
the per-shape GEMM plan measured on them; a warm-up session with that plan (session start,
filling, calibration, steady and reset graphs); for a TP engine, the fused GEMM +
all-reduce kernels of every rank.

Run by build() in a fresh process (`python -m charengine.builder.bake DIR RANK`), so that
nothing compiled earlier in the builder's process hides a kernel from the engine's cache.
Prints one JSON line: warm-up steps, kernels compiled and kernels found already there."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from charengine import fp8
from charengine.config import RankShape, config_from_dict
from charengine.engine_format import ADALN, MANIFEST, TRITON_KERNELS, rank_file
from charengine.graphs import GraphedStep
from charengine.kernel_cache import KernelCache
from charengine.plugins import fp8_gemm, gemm_residual, quack_gemm
from charengine.rank import make_session
from charengine.warmup import warm_up


def gemm_candidates(cfg, kind: str, split: int, h: torch.Tensor):
    """The choices timed for block linear `kind`, and a function giving each one's op (with
    fp8.scaled_mm's signature) as the model will run it: with gemm_swiglu the input
    projection's SwiGLU epilogue after `split` plain columns (QuACK only); with gemm_residual
    the output projection adding `h` in its epilogue (cuBLASLt or QuACK); else the plain GEMM
    (cuBLASLt, Triton, QuACK). QuACK where it is installed."""
    quack = tuple(f"quack:{t}" for t in quack_gemm.CANDIDATES) if quack_gemm.available() \
        else ()
    sw = cfg.switches
    if kind == "w_in" and sw.gemm_swiglu:
        if not quack:
            raise ValueError("gemm_swiglu needs quack-kernels on the build GPU")

        def swiglu(c):
            f = quack_gemm.select_swiglu("cuda", c)
            return lambda a_q, a_s, w_q, w_s, dt, fast: f(a_q, a_s, w_q, w_s, dt, fast, split)
        return quack, swiglu
    if kind == "w_out" and sw.gemm_residual and sw.baked_adaln:
        def residual(c):
            f = gemm_residual.select("cuda", c)
            return lambda a_q, a_s, w_q, w_s, dt, fast: f(a_q, a_s, w_q, w_s, h, dt, fast)
        return ("scaled_mm",) + quack, residual
    return fp8_gemm.CHOICES + quack, fp8_gemm.op


def gemm_plan(cfg, state: dict, rank: int) -> tuple[dict, dict]:
    """Per block linear, the fastest GEMM at the steady shape over the rank's own weights, as
    the engine's switches run it (`gemm_candidates`): (choices, microseconds of each)."""
    spec = cfg.model
    if not cfg.numerics.fp8_gemm:
        return {}, {}
    T, dtype = spec.tokens_per_frame, getattr(torch, cfg.numerics.dtype)
    split = 3 * RankShape.of(spec, cfg.tp, rank).attn_width(spec)
    h = torch.randn(T, spec.dim, device="cuda").to(dtype)
    plan, times = {}, {}
    for kind in ("w_in", "w_out"):
        weights = [(state[f"blocks.{i}.{kind}.q"], state[f"blocks.{i}.{kind}.scale"])
                   for i in range(spec.n_blocks)]
        choices, gemm_for = gemm_candidates(cfg, kind, split, h)
        times[kind] = fp8_gemm.time_choices(weights, T, dtype, cfg.numerics.fast_accum_for(kind),
                                            choices=choices, gemm_for=gemm_for)
        plan[kind] = fp8_gemm.choose(times[kind])
    return plan, times


def compile_exchange(cfg, state: dict) -> None:
    """A TP engine's fused GEMM + all-reduce kernels, for every rank (its index is a
    compile-time constant): one exchange of `tp` ranks' buffers on this GPU, each rank's
    push, then each rank's reduction, at the steady shape."""
    from charengine.plugins import gemm_allreduce as gar

    spec = cfg.model
    if not (cfg.tp > 1 and cfg.switches.fused_gemm_allreduce and cfg.numerics.fp8_gemm):
        return
    w_q, w_s = state["blocks.0.w_out.q"], state["blocks.0.w_out.scale"]
    a_q, a_s = fp8.quantize_rows(torch.randn(spec.tokens_per_frame, w_q.shape[1],
                                             device=w_q.device))
    ranks = gar.Exchange.local(cfg.tp, spec.tokens_per_frame, spec.dim, w_q.device)
    for x in ranks:
        gar.gemm_push(x, a_q, a_s, w_q, w_s)
    for x in ranks:
        gar.reduce(x, torch.bfloat16)
    torch.cuda.synchronize()


def bake(engine: Path, rank: int) -> dict:
    cfg = config_from_dict(json.loads((engine / MANIFEST).read_text())["config"])
    t0 = time.perf_counter()
    with KernelCache(engine / TRITON_KERNELS, quack=quack_gemm.available()) as cache:
        state = load_file(str(engine / rank_file(rank)), device="cuda")
        tables = load_file(str(engine / ADALN), device="cuda")
        plan, times = gemm_plan(cfg, state, rank)
        session = make_session(cfg, state, rank, device="cuda", step_fn=GraphedStep(),
                               adaln_tables=(tables["adaln_table"], tables["final_table"]),
                               gemm_plan=plan)
        steps = warm_up(session)
        compile_exchange(cfg, state)
    return {"rank": rank, "steps": steps, "seconds": round(time.perf_counter() - t0, 2),
            "gemm_plan": plan, "gemm_us": times,
            "compiled": sorted(cache.compiled), "found": sorted(cache.loaded),
            "quack_compiled": cache.quack_compiled}


if __name__ == "__main__":
    print(json.dumps(bake(Path(sys.argv[1]), int(sys.argv[2]))))
