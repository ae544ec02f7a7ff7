"""What the kernel benchmarks (scripts/bench_kernels.py) share: a kernel's time as one CUDA
graph of many calls over distinct buffers, errors against a reference, and the attention
kernel's tiles at any family's shape beside cuDNN's bf16 attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from charengine import fp8
from charengine.plugins import attention
from charengine.timing import cuda_ms, median, wall_ms


def graph_time_us(fn, calls: int, reps: int) -> float:
    """Median microseconds per call of fn(i), i = 0..calls-1, replayed as one CUDA graph."""
    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    return median([ms * 1e3 / calls for ms in cuda_ms(g.replay, reps, warmup=1)])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def scale_bias(a: torch.Tensor, ref: torch.Tensor) -> float:
    """The least-squares factor between a and ref, minus one: whether an error shrinks or
    grows the output systematically rather than adding noise."""
    a, ref = a.float().flatten(), ref.float().flatten()
    return (torch.dot(a, ref) / torch.dot(ref, ref) - 1).item()


def fp8_code_diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    """How far apart two e4m3 tensors are, in codes (adjacent values differ by one code)."""
    d = (a.view(torch.uint8).int() - b.view(torch.uint8).int()).abs()
    return {"max_codes": int(d.max()), "frac_differ": float((d > 0).float().mean())}


def timed(out, key, fn, calls, reps, check=None):
    """out[key] = {"us": ...} plus check()'s entries; an error is reported, not fatal."""
    try:
        extra = check() if check is not None else {}
        out[key] = {"us": graph_time_us(fn, calls, reps), **extra}
    except Exception as e:
        out[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}


def rowwise_weights(n: int, N: int, K: int, dev, g, spread: float = 1.0):
    """n FP8 weights [N, K] of normal values times `spread`, with their per-row scales [N]."""
    ws = [fp8.quantize_rows(torch.randn(N, K, device=dev, generator=g) * spread)
          for _ in range(n)]
    return [(q, s[:, 0].contiguous()) for q, s in ws]


def bench_attention(H, T, S, D, calls, reps, dev, extra=()):
    """The attention kernel's candidate tiles (and `extra` AttentionTiles, V transposed) at
    H heads, T queries, S keys of head dim D, beside cuDNN's bf16 attention."""
    g = torch.Generator(device=dev).manual_seed(0)
    n = 8  # distinct caches, 8 x 2 x H x S x D bytes: past L2
    q = torch.randn(H, T, D, device=dev, generator=g).to(torch.bfloat16)
    q8, qs = fp8.quantize_rows(q)
    ks = torch.rand(H, 1, 1, device=dev, generator=g) * 0.01 + 0.005
    vs = torch.rand(H, 1, 1, device=dev, generator=g) * 0.01 + 0.005
    k8 = [fp8.quantize(torch.randn(H, S, D, device=dev, generator=g) * 2, 1.0) for _ in range(n)]
    v8 = [fp8.quantize(torch.randn(H, S, D, device=dev, generator=g) * 2, 1.0) for _ in range(n)]
    pad = -S % 16  # a [H, D, S] store needs 16-byte rows for TMA: slots padded to 16
    vt = [torch.nn.functional.pad(v.transpose(1, 2), (0, pad)).contiguous()[..., :S].transpose(1, 2)
          for v in v8]
    flop = 4 * H * T * S * D
    out = {}
    ref = attention.reference(q8, qs, k8[0], v8[0], ks, vs, torch.bfloat16)
    vmax = (v8[0].float().abs().amax() * vs.max()).item()
    kb = [fp8.dequantize(k, ks, torch.bfloat16) for k in k8]
    vb = [fp8.dequantize(v, vs, torch.bfloat16) for v in v8]
    qb = fp8.dequantize(q8, qs, torch.bfloat16)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        us = graph_time_us(lambda i: F.scaled_dot_product_attention(
            qb[None], kb[i % n][None], vb[i % n][None]), calls, reps)
    out["cudnn_bf16"] = {"us": us, "tflops": flop / us / 1e6}
    T_ = attention.AttentionTiles
    candidates = [(T_(bm, bn, w, st, True, tma), "v_transposed")
                  for bm, bn, w, st in ((64, 128, 4, 3), (64, 128, 4, 4), (64, 128, 4, 2),
                                        (64, 256, 4, 3), (64, 256, 8, 3), (64, 128, 8, 3),
                                        (128, 128, 8, 3), (64, 64, 4, 3))
                  for tma in (True, False)]
    # the softmax in fewer instructions (AttentionTiles.fma) at the fastest tiles
    candidates += [(T_(bm, bn, w, st, True, True, True), "v_transposed")
                   for bm, bn, w, st in ((64, 128, 4, 3), (64, 128, 4, 4), (64, 256, 8, 3),
                                         (128, 128, 8, 3))]
    candidates += [(t, "v_transposed") for t in extra]
    candidates += [(T_(128, 64, 8, 3, False, False), "v_rows"),
                   (T_(128, 128, 8, 3, False, True), "v_rows"),
                   (T_(64, 128, 4, 3, True, False), "v_rows")]
    for t, layout in candidates:
        vv = vt if layout == "v_transposed" else v8
        key = f"triton_m{t.block_m}_n{t.block_n}_w{t.warps}_s{t.stages}_" \
              f"{'pfp8' if t.p_fp8 else 'pbf16'}_{layout}{'_tma' if t.tma else ''}" \
              f"{'_fma' if t.fma else ''}" \
              f"{f'_split{t.split_ctas_per_sm}' if t.split_ctas_per_sm else ''}" \
              f"{'_pipelined' if t.pipelined else ''}"
        try:
            o = attention.triton_attention(q8, qs, k8[0], vv[0], ks, vs, torch.bfloat16, t)
            us = graph_time_us(lambda i: attention.triton_attention(
                q8, qs, k8[i % n], vv[i % n], ks, vs, torch.bfloat16, t), calls, reps)
        except Exception as e:  # a tile that does not compile or fit is reported, not fatal
            out[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            continue
        out[key] = {"us": us, "tflops": flop / us / 1e6, "rel_err": rel(o, ref),
                    "max_abs_err_over_vmax": ((o.float() - ref.float()).abs().max() / vmax).item()}
    return out


def eager_time_ms(fn, reps: int) -> float:
    """Median wall milliseconds of fn() run eagerly, synchronized (host launches included:
    the calibration runs outside the graphs, once per session)."""
    return median(wall_ms(fn, reps, warmup=1, device="cuda"))
