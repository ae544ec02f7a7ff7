"""Compile a GPU engine's kernels with Triton's cache pointed into the engine: the rank's
weights and tables loaded from the engine being built onto the GPU, as charrun loads them;
the per-shape GEMM plan measured on them; a warm-up session with that plan (session start,
filling, calibration, steady and reset graphs); for rank 0 (the process that runs the side
networks) one call of each side network at every shape a session runs (their kernels: the
decoder's fused norms); for a TP engine, the fused GEMM + all-reduce kernels of every rank.

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
from charengine.assemble import rank_session
from charengine.config import config_from_dict
from charengine.engine_format import ADALN, MANIFEST, SIDE, TRITON_KERNELS, rank_file
from charengine.family import family_of
from charengine.kernel_cache import KernelCache
from charengine.plugins import gemm, quack_gemm
from charengine.target import Target


def gemm_plan(cfg, state: dict, mapping) -> tuple[dict, dict]:
    """Per block linear, the fastest GEMM at the steady shape over the rank's own weights, as
    the engine's switches run it: each backend with the linear's epilogue (plugins/gemm.py)
    timed on the family's GEMM problems. Returns (choices, microseconds of each)."""
    dtype = getattr(torch, cfg.numerics.dtype)
    plan, times = {}, {}
    for kind, prob in family_of(cfg).gemm_problems(cfg, state, mapping).items():
        times[kind] = gemm.time_choices(prob.weights, prob.m, dtype,
                                        cfg.numerics.fast_accum_for(kind)
                                        if prob.fast_accum is None else prob.fast_accum,
                                        gemm.candidates(prob.epilogue), prob.epilogue,
                                        prob.residual, prob.split)
        plan[kind] = gemm.choose(times[kind])
    return plan, times


def compile_exchange(cfg, state: dict) -> None:
    """A TP engine's fused GEMM + all-reduce kernels, for every rank (its index is a
    compile-time constant): one exchange of `tp` ranks' buffers on this GPU, each rank's
    push, then each rank's reduction, at the steady shape."""
    from charengine.plugins import gemm_allreduce as gar

    fused = family_of(cfg).fused_allreduce(cfg)
    if not (cfg.tp > 1 and fused is not None and cfg.numerics.fp8_gemm):
        return
    w_q, w_s = state[f"{fused.linear}.q"], state[f"{fused.linear}.scale"]
    a_q, a_s = fp8.quantize_rows(torch.randn(fused.m, w_q.shape[1], device=w_q.device))
    ranks = gar.Exchange.local(cfg.tp, fused.m, fused.n, w_q.device)
    for x in ranks:
        gar.gemm_push(x, a_q, a_s, w_q, w_s)
    for x in ranks:
        gar.reduce(x, torch.bfloat16)
    torch.cuda.synchronize()


def warm_up_side(cfg, engine: Path) -> None:
    """The engine's side networks on this GPU, as charrun loads them, through the family's
    side warm-up (every shape a session runs them at). For a family whose side networks run
    no Triton kernel (the characters family's) this compiles nothing and costs a few seconds
    of build."""
    fam, dev = family_of(cfg), torch.device("cuda")
    side = fam.load_side(cfg, load_file(str(engine / SIDE), device="cuda"), dev)
    fam.warm_up_side(side, cfg.model, dev)


def bake(engine: Path, rank: int) -> dict:
    manifest = json.loads((engine / MANIFEST).read_text())
    cfg = config_from_dict(manifest["config"])
    # the rank on the build GPU, alone: its all-reduce is compiled by compile_exchange
    mapping = Target.from_dict(manifest["target"]).mapping(rank).slice_alone("cuda")
    t0 = time.perf_counter()
    with KernelCache(engine / TRITON_KERNELS, quack=quack_gemm.available()) as cache:
        state = load_file(str(engine / rank_file(rank)), device="cuda")
        tables = load_file(str(engine / ADALN), device="cuda")
        plan, times = gemm_plan(cfg, state, mapping)
        session = rank_session(cfg, state, mapping, tables=tables, gemm_plan=plan,
                               graphed=True)
        steps = family_of(cfg).warm_up(session)
        if rank == 0:
            warm_up_side(cfg, engine)
        compile_exchange(cfg, state)
    return {"rank": rank, "steps": steps, "seconds": round(time.perf_counter() - t0, 2),
            "gemm_plan": plan, "gemm_us": times,
            "compiled": sorted(cache.compiled), "found": sorted(cache.loaded),
            "quack_compiled": cache.quack_compiled}


if __name__ == "__main__":
    print(json.dumps(bake(Path(sys.argv[1]), int(sys.argv[2]))))
