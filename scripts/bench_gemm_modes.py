"""What else cuBLASLt offers for the rank slice's FP8 GEMMs, through its C API (ctypes, the
library torch loads): how many algorithms its heuristic returns for the rowwise-scaled shapes
(M = tokens per frame), each one timed; the output projection with the residual added in
its epilogue (D = C + A B, beta = 1); and the step's 480 GEMMs as one CUDA graph, rowwise
against tensorwise scales (the row and column scales left to the consumers), torch against
the direct call, with and without fast accumulation. GPU only.

    python scripts/bench_gemm_modes.py --preset characters-57b --tp 3

Writes docs/results/gemm_modes_<preset>_tp<N>_<gpu>.json.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from charengine import fp8
from charengine.characters.spec import RankShape
from charengine.config import preset
from charengine.engine_format import this_machine
from charengine.plugins.cublaslt import Handle, Matmul
from charengine.plugins.gemm_residual import WORKSPACE_BYTES
from charengine.timing import Span, median
from charengine.provenance import provenance


def capture(fn) -> torch.cuda.CUDAGraph:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return g


def time_graphs(graphs: dict, reps: int) -> dict:
    """Each graph `reps` times, the order shuffled each round; median ms and the runs."""
    times = {k: [] for k in graphs}
    for r in range(reps):
        order = list(graphs)
        random.Random(r).shuffle(order)
        for k in order:
            with Span("cuda") as span:
                graphs[k].replay()
            times[k].append(span.ms)
    return {k: {"ms": median(v), "runs": [round(t, 2) for t in v]}
            for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="characters-57b")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--gpu-tag", default="h200")
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    args = ap.parse_args()
    cfg = preset(args.preset, tp=args.tp)
    spec, shape = cfg.model, RankShape.of(cfg.model, args.tp, 0)
    T, passes, blocks = spec.tokens_per_frame, cfg.schedule.passes, spec.n_blocks
    shapes = {"w_in": (shape.in_proj_rows(spec), spec.dim),
              "w_out": (spec.dim, shape.out_proj_cols(spec))}
    handle = Handle(torch.device("cuda"), WORKSPACE_BYTES)
    g = torch.Generator(device="cuda").manual_seed(0)
    result = {"preset": args.preset, "tp": args.tp, "machine": this_machine(),
              **provenance(), "per_shape": {}}
    with torch.inference_mode():
        act = {k: fp8.quantize_rows(torch.randn(T, K, device="cuda", generator=g))
               for k, (_, K) in shapes.items()}
        act1 = {k: (q, s[:, 0].contiguous()) for k, (q, s) in act.items()}
        weights = []  # every block's own, so the step's graph streams them as a step does
        for _ in range(blocks):
            wb = {}
            for k, (N, K) in shapes.items():
                q, s = fp8.quantize_rows(torch.randn(N, K, device="cuda", generator=g,
                                                     dtype=torch.bfloat16))
                wb[k] = (q, s[:, 0].float().contiguous())
            weights.append(wb)
        lts = {(k, fast): Matmul(handle, T, N, K, torch.bfloat16, fast, False)
               for k, (N, K) in shapes.items() for fast in (False, True)}
        best = {key: g_.heuristics(act1[key[0]][1], weights[0][key[0]][1], 64)
                for key, g_ in lts.items()}
        for (k, fast), hs in best.items():  # every algorithm the heuristic offers
            gm, rows = lts[k, fast], []
            for h in hs:
                graph = capture(lambda: [gm(*act1[k], *wb[k], heuristic=h)
                                         for wb in weights[:40]])
                per = time_graphs({"x": graph}, args.reps)["x"]["ms"] * 1e3 / 40
                rows.append({"us": per, **gm.config(h)})
            result["per_shape"][f"{k}{'_fast' if fast else ''}"] = {"algorithms": len(hs),
                                                                    "timed": rows}
        # the residual in the output projection's epilogue: D = h + A B, in place
        gm = Matmul(handle, T, *shapes["w_out"], torch.bfloat16, False, True)
        resid = [torch.randn(T, spec.dim, device="cuda", generator=g).bfloat16() for _ in range(8)]
        plain = best["w_out", False][0]
        graphs = {
            "w_out": capture(lambda: [lts["w_out", False](*act1["w_out"], *wb["w_out"],
                                                          heuristic=plain)
                                       for wb in weights[:40]]),
            "w_out_plus_residual": capture(lambda: [
                gm(*act1["w_out"], *wb["w_out"], resid[i % 8], out=resid[i % 8])
                for i, wb in enumerate(weights[:40])])}
        result["residual_in_epilogue_us"] = {k: v["ms"] * 1e3 / 40 for k, v in
                                             time_graphs(graphs, args.reps).items()}

        one = torch.ones((), device="cuda")

        def step(mode, fast):
            def run():
                for _ in range(passes):
                    for wb in weights:
                        for k in shapes:
                            (a, sa), (a1, sa1), (w, sw) = act[k], act1[k], wb[k]
                            if mode == "rowwise":
                                fp8.scaled_mm(a, sa, w, sw, torch.bfloat16, fast)
                            elif mode == "tensorwise":
                                torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one,
                                                 out_dtype=torch.bfloat16, use_fast_accum=fast)
                            else:
                                lts[k, fast](a1, sa1, w, sw)
            return run

        graphs = {f"{m}{'_fast' if f else ''}": capture(step(m, f))
                  for m in ("rowwise", "tensorwise", "cublaslt_direct") for f in (False, True)}
        result["step_gemms_ms"] = time_graphs(graphs, args.reps)
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gemm_modes_{args.preset}_tp{args.tp}_{args.gpu_tag}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
