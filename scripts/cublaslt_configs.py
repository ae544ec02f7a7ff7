"""Every configuration cuBLASLt accepts for the FP8 matmul with rowwise (outer-vector) scales
and a bias, at LiveTalk-1.3B's block-linear shapes (M = a chunk's 3,072 tokens), each timed in
a CUDA graph over 12 weights: its heuristic's choice, then its algorithms that take these
scales (the heuristic's own, its custom options, stages and cluster shapes varied, and the
algorithm cuBLASLt lists beside it) as cublasLtMatmulAlgoCheck admits them. The plan's
`cublaslt` choice runs without a workspace; cuBLASLt admits the varied configurations only
with one, so they run over a 64 MiB workspace.

    python scripts/cublaslt_configs.py --out docs/results/livetalk/cublaslt_configs_h200.json
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import time
from pathlib import Path

import torch

from charengine import fp8
from charengine.plugins import cublaslt as lt
from charengine.timing import cuda_ms, median
from charengine.provenance import provenance

SHAPES = {"attn": (1536, 1536), "ffn_down": (1536, 8960), "qkv": (4608, 1536),
          "ffn_up": (8960, 1536)}  # (N, K) of each LiveTalk-1.3B linear kind
TOKENS = 3072
WEIGHTS = 12  # distinct weights a graph walks, so they stream from memory as in a step
WORKSPACE = 64 << 20
ALGOS = (66, 67)  # the algorithms that take outer-vector scales (66: the heuristic's)
CLUSTERS = (0, 2, 3, 4, 5, 6, 7, 8, 9, 10)  # cublasLtClusterShape_t: auto, 1x1 .. 4x4
CAP_CUSTOM_OPTION_MAX, CAP_STAGES_IDS = 7, 13  # cublasLtMatmulAlgoCapAttributes_t
CONFIG = {name: (attr, ct) for name, attr, ct in lt.CONFIG_ATTRS}  # what Matmul.config reads


def cap(lib, algo, attr, n=64, ct=ctypes.c_uint32) -> list[int]:
    buf, written = (ct * n)(), ctypes.c_size_t()
    lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, buf, ctypes.sizeof(buf),
                                          ctypes.byref(written))
    return [buf[i] for i in range(written.value // ctypes.sizeof(ct))]


def configured(lib, algo, custom, stages, cluster):
    """A copy of `algo` with the three attributes set; None where cuBLASLt refuses one."""
    out = lt.Algo()
    ctypes.memmove(ctypes.byref(out), ctypes.byref(algo), ctypes.sizeof(algo))
    for name, value in (("custom", custom), ("stages", stages), ("cluster", cluster)):
        attr, ct = CONFIG[name]
        v = ct(value)
        if lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(out), attr, ctypes.byref(v),
                                                    ctypes.sizeof(v)):
            return None
    return out


def candidates(h, mm, heuristic) -> list:
    """The heuristic's result, then every configuration AlgoCheck admits."""
    lib, (la, lb, lc) = h.lib, mm.layouts
    out = [heuristic]
    for aid in ALGOS:
        algo = lt.Algo()
        if aid == mm.config(heuristic)["id"]:
            ctypes.memmove(ctypes.byref(algo), ctypes.byref(heuristic.algo),
                           ctypes.sizeof(algo))
        elif lib.cublasLtMatmulAlgoInit(h.handle, lt.COMPUTE_32F, lt.R_32F, lt.R_E4M3,
                                        lt.R_E4M3, lt.R_16BF, lt.R_16BF, aid,
                                        ctypes.byref(algo)):
            continue
        customs = range(cap(lib, algo, CAP_CUSTOM_OPTION_MAX, 1, ctypes.c_int32)[0] + 1)
        for custom, stages, cluster in itertools.product(customs,
                                                         cap(lib, algo, CAP_STAGES_IDS) or [0],
                                                         CLUSTERS):
            a = configured(lib, algo, custom, stages, cluster)
            res = lt.Heuristic()
            if a is None or lib.cublasLtMatmulAlgoCheck(h.handle, mm.desc, la, lb, lc, lc,
                                                        ctypes.byref(a), ctypes.byref(res)):
                continue
            res.algo = a
            out.append(res)
    return out


def bench_shape(h, N, K, budget_s: float, dev) -> list[dict]:
    g = torch.Generator(device=dev).manual_seed(0)
    ws = []
    for _ in range(WEIGHTS):
        q, s = fp8.quantize_rows(torch.randn(N, K, device=dev, generator=g) * 0.02)
        ws.append((q, s.float().reshape(N).contiguous()))
    a_q, a_s = fp8.quantize_rows(torch.randn(TOKENS, K, device=dev, generator=g))
    a_s = a_s.float().reshape(TOKENS).contiguous()
    bias = torch.randn(N, device=dev, dtype=torch.bfloat16)
    mm = lt.Matmul(h, TOKENS, N, K, torch.bfloat16, True, False, with_bias=True)
    heuristic = mm.heuristics(a_s, ws[0][1], n=1)[0]
    mm._set(lt.DESC_BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
    d = torch.empty(TOKENS, N, dtype=torch.bfloat16, device=dev)
    out, ref, t0 = [], None, time.time()
    for i, hh in enumerate(candidates(h, mm, heuristic)):
        if time.time() - t0 > budget_s:
            break

        def walk():
            for w_q, w_s in ws:
                mm(a_q, a_s, w_q, w_s, out=d, heuristic=hh, bias=bias)

        try:
            walk()
        except RuntimeError as e:  # admitted by AlgoCheck, refused by the matmul
            print(f"  configuration {i} refused: {e}", flush=True)
            continue
        torch.cuda.synchronize()
        ref = d.float().clone() if ref is None else ref
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            walk()
        us = median([1e3 * t / WEIGHTS for t in cuda_ms(graph.replay, 3, warmup=1,
                                                          device=dev)])
        out.append({"i": i, "heuristic": i == 0, "us": round(us, 2),
                    "max_abs_diff": (d.float() - ref).abs().max().item(),
                    **mm.config(hh)})
    return sorted(out, key=lambda r: r["us"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=55.0, help="timing time per shape")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    h = lt.Handle(dev, WORKSPACE)
    out = {"gpu": torch.cuda.get_device_name(dev), **provenance(),
           "tokens": TOKENS, "shapes": {}}
    for kind, (N, K) in SHAPES.items():
        rows = bench_shape(h, N, K, args.budget_s, dev)
        out["shapes"][kind] = {"n": N, "k": K, "configs": rows}
        base = next(r for r in rows if r["heuristic"])
        tflops = 2 * TOKENS * N * K / 1e6
        print(f"{kind}: {len(rows)} configurations, the heuristic's {base['us']:.2f} us, "
              f"the fastest {rows[0]['us']:.2f} us ({tflops / rows[0]['us']:.0f} TFLOP/s)",
              flush=True)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
