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
import ctypes
import json
import random
import statistics
import time
from pathlib import Path

import torch

from charengine import fp8
from charengine.config import RankShape, preset
from charengine.engine_format import this_machine

# cublasLt.h / library_types.h / cublas_api.h (CUDA 13)
R_32F, R_16BF, R_E4M3, COMPUTE_32F = 0, 14, 28, 68
DESC_TRANSA, DESC_TRANSB, DESC_A_SCALE, DESC_B_SCALE, DESC_FAST_ACCUM = 3, 4, 17, 18, 25
DESC_A_SCALE_MODE, DESC_B_SCALE_MODE, SCALE_OUTER_VEC_32F = 31, 32, 3
PREF_MAX_WORKSPACE = 1
CONFIG_ATTRS = (("id", 0, ctypes.c_int32), ("tile", 1, ctypes.c_uint32),
                ("splitk", 2, ctypes.c_int32), ("stages", 6, ctypes.c_uint32),
                ("cluster", 8, ctypes.c_uint16))


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def cublaslt() -> ctypes.CDLL:
    """The libcublasLt that torch has loaded (a rowwise _scaled_mm loads it)."""
    z = torch.zeros(16, 16, device="cuda").to(fp8.FP8)
    one = torch.ones((), device="cuda")
    torch._scaled_mm(z, z.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    with open("/proc/self/maps") as f:
        for line in f:
            if "libcublasLt" in line:
                return ctypes.CDLL(line.split()[-1])
    raise RuntimeError("libcublasLt is not loaded")


class LtGemm:
    """D [M, N] bf16 row-major = (a [M, K] * sa [M]) (w [N, K] * sw [N])^T (+ beta C), as
    cuBLASLt's column-major D^T = op(W) A^T with outer-vector scales."""

    def __init__(self, lt, handle, M, N, K, fast: bool, beta: float = 0.0,
                 workspace: int = 32 << 20):
        self.lt, self.handle, self.M, self.N = lt, handle, M, N
        self.desc = ctypes.c_void_p()
        self.ok(lt.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, R_32F))
        for attr, value, ct in ((DESC_TRANSA, 1, ctypes.c_int32), (DESC_TRANSB, 0, ctypes.c_int32),
                                (DESC_A_SCALE_MODE, SCALE_OUTER_VEC_32F, ctypes.c_int32),
                                (DESC_B_SCALE_MODE, SCALE_OUTER_VEC_32F, ctypes.c_int32),
                                (DESC_FAST_ACCUM, int(fast), ctypes.c_int8)):
            self.set(attr, value, ct)
        self.a = self.layout(R_E4M3, K, N, K)
        self.b = self.layout(R_E4M3, K, M, K)
        self.c = self.layout(R_16BF, N, M, N)
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(beta)
        self.ws = torch.empty(workspace, dtype=torch.uint8, device="cuda")
        self.pref = ctypes.c_void_p()
        self.ok(lt.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)))
        size = ctypes.c_uint64(workspace)
        self.ok(lt.cublasLtMatmulPreferenceSetAttribute(self.pref, PREF_MAX_WORKSPACE,
                                                        ctypes.byref(size), 8))

    @staticmethod
    def ok(status):
        if status != 0:
            raise RuntimeError(f"cuBLASLt status {status}")

    def set(self, attr, value, ct):
        v = ct(value)
        self.ok(self.lt.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v),
                                                       ctypes.sizeof(v)))

    def layout(self, dtype, rows, cols, ld):
        out = ctypes.c_void_p()
        self.ok(self.lt.cublasLtMatrixLayoutCreate(ctypes.byref(out), dtype, ctypes.c_uint64(rows),
                                                   ctypes.c_uint64(cols), ctypes.c_int64(ld)))
        return out

    def scales(self, sa, sw):
        self.set(DESC_A_SCALE, sw.data_ptr(), ctypes.c_void_p)  # cuBLASLt's A is the weight
        self.set(DESC_B_SCALE, sa.data_ptr(), ctypes.c_void_p)

    def heuristics(self, sa, sw, n: int = 64) -> list[Heuristic]:
        self.scales(sa, sw)
        res, count = (Heuristic * n)(), ctypes.c_int()
        self.ok(self.lt.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a, self.b,
                                                       self.c, self.c, self.pref, n, res,
                                                       ctypes.byref(count)))
        return [res[i] for i in range(count.value) if res[i].state == 0]

    def __call__(self, a, sa, w, sw, h: Heuristic, out=None):
        self.scales(sa, sw)
        d = out if out is not None else torch.empty(self.M, self.N, dtype=torch.bfloat16,
                                                    device="cuda")
        p = ctypes.c_void_p
        self.ok(self.lt.cublasLtMatmul(
            self.handle, self.desc, ctypes.byref(self.alpha), p(w.data_ptr()), self.a,
            p(a.data_ptr()), self.b, ctypes.byref(self.beta), p(d.data_ptr()), self.c,
            p(d.data_ptr()), self.c, ctypes.byref(h.algo), p(self.ws.data_ptr()),
            ctypes.c_size_t(self.ws.numel()), p(torch.cuda.current_stream().cuda_stream)))
        return d

    def config(self, h: Heuristic) -> dict:
        out = {}
        for name, attr, ct in CONFIG_ATTRS:
            v, n = ct(), ctypes.c_size_t()
            self.lt.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(h.algo), attr,
                                                         ctypes.byref(v), ctypes.sizeof(v),
                                                         ctypes.byref(n))
            out[name] = v.value
        return {**out, "workspace": h.workspace, "waves": round(h.waves, 2)}


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
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graphs[k].replay()
            b.record()
            b.synchronize()
            times[k].append(a.elapsed_time(b))
    return {k: {"ms": statistics.median(v), "runs": [round(t, 2) for t in v]}
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
    lt = cublaslt()
    handle = ctypes.c_void_p()
    LtGemm.ok(lt.cublasLtCreate(ctypes.byref(handle)))
    g = torch.Generator(device="cuda").manual_seed(0)
    result = {"preset": args.preset, "tp": args.tp, "machine": this_machine(),
              "date": time.strftime("%Y-%m-%d"), "per_shape": {}}
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
        lts = {(k, fast): LtGemm(lt, handle, T, N, K, fast)
               for k, (N, K) in shapes.items() for fast in (False, True)}
        best = {key: g_.heuristics(act1[key[0]][1], weights[0][key[0]][1])
                for key, g_ in lts.items()}
        for (k, fast), hs in best.items():  # every algorithm the heuristic offers
            gm, rows = lts[k, fast], []
            for h in hs:
                graph = capture(lambda: [gm(*act1[k], *wb[k], h) for wb in weights[:40]])
                per = time_graphs({"x": graph}, args.reps)["x"]["ms"] * 1e3 / 40
                rows.append({"us": per, **gm.config(h)})
            result["per_shape"][f"{k}{'_fast' if fast else ''}"] = {"algorithms": len(hs),
                                                                    "timed": rows}
        # the residual in the output projection's epilogue: D = h + A B, in place
        gm = LtGemm(lt, handle, T, *shapes["w_out"], False, beta=1.0)
        h0 = gm.heuristics(act1["w_out"][1], weights[0]["w_out"][1])[0]
        resid = [torch.randn(T, spec.dim, device="cuda", generator=g).bfloat16() for _ in range(8)]
        plain = best["w_out", False][0]
        graphs = {
            "w_out": capture(lambda: [lts["w_out", False](*act1["w_out"], *wb["w_out"], plain)
                                       for wb in weights[:40]]),
            "w_out_plus_residual": capture(lambda: [
                gm(*act1["w_out"], *wb["w_out"], h0, out=resid[i % 8])
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
                                lts[k, fast](a1, sa1, w, sw, best[k, fast][0])
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
