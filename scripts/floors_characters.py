"""The characters family's step floors for scripts/bench_session.py, measured in the same
process: the step's FP8 GEMMs alone and its attention alone, each as one CUDA graph of a
step's calls (the family's model and cache laid open: its weights by name, its attention
kernel, its FP8 caches)."""

from __future__ import annotations

import statistics

import torch

from charengine.plugins import gemm
from charengine.timing import Mark


def measured_floors(session, device, plan: dict, reps: int = 5) -> dict:
    """The step's FP8 GEMMs alone (its own weights, pre-quantized activations, the same
    kernels) and its attention alone (the same kernel, FP8 or the bf16 SDPA backend, over
    caches of the step's shape rotated past L2), each captured as one CUDA graph of a step's
    calls."""
    from charengine import fp8

    model, cache = session.model, session.cache
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
