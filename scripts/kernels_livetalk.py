"""The LiveTalk family's kernels for scripts/bench_kernels.py at its steady-chunk shapes: the
FP8 attention's tiles over the sink and window as the cache lays them out (values stored
[head_dim, slots]), the cross-attention's shape (the chunk's queries over the prompt's keys:
SDPA's backends in bf16 and the FP8 kernel's tiles), each fused epilogue against the unfused
ops it replaces (the gated residual + the cross-attention's layer norm + quantize, the gated
residual + audio + AdaLN + quantize, GELU + quantize, the q RMS norm), the fused
pre-attention over its tile sizes, and each FP8 GEMM shape through `torch._scaled_mm` and
through cuBLASLt with no workspace (`cublaslt`), with the memsets each call adds to a CUDA
graph."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from charengine import fp8
from charengine.ops import gated_residual, gelu_tanh, modulate, rms_norm_width
from charengine.plugins import act_quant, gemm, pre_attention_width, rms_norm
from charengine.plugins.attention import SPLIT_TILES, AttentionTiles
from charengine.rope import cos_sin
from kernel_timing import bench_attention, graph_time_us

# tiles tried beyond kernel_timing.bench_attention's list: 128-query tiles suit 3,072 queries per head
EXTRA_TILES = tuple(AttentionTiles(bm, bn, w, st, True, True, True)
                    for bm, bn, w, st in ((128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2),
                                          (128, 128, 8, 4), (128, 256, 8, 2), (64, 64, 4, 4),
                                          (64, 128, 4, 5), (64, 256, 4, 2), (128, 64, 8, 4))) \
    + (SPLIT_TILES,) \
    + tuple(AttentionTiles(64, bn, 4, st, split_ctas_per_sm=sp, pipelined=True)
            for bn, st, sp in ((128, 3, 2), (128, 3, 0), (64, 6, 2), (64, 4, 3)))
GELU_WARPS = (4, 8, 32)  # beside the kernel's default (16)
NORM_WARPS = (1, 2, 4, 8)
ACT_WARPS = (1, 2, 4)  # act_quant's one-pass row kernel
# the pre-attention's tiles tried (tokens per query/key program, tokens per value program,
# warps: pre_attention_width.RowTiles)
PRE_ROWS = tuple((t, v, w) for t in (2, 4, 8) for v in (32, 64) for w in (2, 4, 8))
SECTIONS = ("attention", "cross_attention", "epilogues", "pre_attention", "gemm")
DEFAULTS = {"tp": 1, "calls": 20, "reps": 5}
GEMM_CALLS = 20  # GEMMs per graph (each over one of BUFFERS weights, its own bias added)
BUFFERS = 4  # distinct inputs per graph, so that repeated calls do not all hit L2


def bench_epilogues(spec, calls: int, reps: int, dev) -> dict:
    T, d, f, eps = spec.chunk_tokens, spec.dim, spec.ffn_dim, spec.norm_eps
    g = torch.Generator(device=dev).manual_seed(0)

    def rows(n, width, spread=3.0):
        return [(torch.randn(n, width, device=dev, generator=g) * spread).to(torch.bfloat16)
                for _ in range(BUFFERS)]

    def vec(around=0.0):
        return (torch.randn(d, device=dev, generator=g) * 0.3 + around).to(torch.bfloat16)

    h, o, hid = rows(T, d), rows(T, d), rows(T, f)
    add = rows(spec.chunk_frames, d, 1.0)
    gate, shift, scale, w, b = vec(), vec(), vec(), vec(1.0), vec()
    pairs = {
        "residual_layer_norm_quant": (
            lambda i: fp8.quantize_rows(F.layer_norm(gated_residual(h[i % 4], gate, o[i % 4]),
                                                     (d,), w, b, eps)),
            lambda i: act_quant.triton_residual_layer_norm_quant(h[i % 4], o[i % 4], gate, w, b,
                                                                 eps)),
        "residual_add_norm_modulate_quant": (
            lambda i: act_quant.triton_norm_modulate_quant(
                add[i % 4].repeat_interleave(spec.frame_tokens, dim=0)
                + gated_residual(h[i % 4], gate, o[i % 4]), shift, scale, eps),
            lambda i: act_quant.triton_residual_add_norm_modulate_quant(
                h[i % 4], o[i % 4], gate, add[i % 4], shift, scale, eps)),
        "gelu_quant": (lambda i: act_quant.triton_act_quant(gelu_tanh(hid[i % 4])),
                       lambda i: act_quant.triton_gelu_quant(hid[i % 4])),
        "rms_norm_width": (lambda i: rms_norm_width(h[i % 4], w, eps),
                           lambda i: rms_norm.triton_rms_norm_width(h[i % 4], w, eps)),
        "norm_modulate_quant": (lambda i: fp8.quantize_rows(modulate(h[i % 4], shift, scale, eps)),
                                lambda i: act_quant.triton_norm_modulate_quant(h[i % 4], shift,
                                                                               scale, eps)),
    }
    out = {}
    for name, (unfused, fused) in pairs.items():
        a, bb = graph_time_us(unfused, calls, reps), graph_time_us(fused, calls, reps)
        out[name] = {"unfused_us": a, "fused_us": bb, "saved_us": a - bb}
        print(f"{name:34s} unfused {a:8.1f} us  fused {bb:8.1f} us", flush=True)
    for warps in GELU_WARPS:  # the GELU kernel's row over other warp counts
        us = graph_time_us(lambda i: act_quant.triton_gelu_quant(hid[i % 4], warps), calls, reps)
        out["gelu_quant"][f"fused_us_w{warps}"] = us
        print(f"gelu_quant at {warps:2d} warps             {us:8.1f} us", flush=True)
    for warps in NORM_WARPS:  # the AdaLN kernel's row over other warp counts
        us = graph_time_us(lambda i: act_quant.triton_residual_norm_modulate_quant(
            h[i % 4], o[i % 4], gate, shift, scale, eps, warps), calls, reps)
        out[f"residual_norm_modulate_quant_w{warps}"] = {"fused_us": us}
        print(f"residual_norm_modulate_quant at {warps} warps {us:8.1f} us", flush=True)
    for warps in ACT_WARPS:  # the attention output's quantization, its row in registers
        us = graph_time_us(lambda i: act_quant.triton_act_quant(h[i % 4], warps=warps), calls,
                           reps)
        out[f"act_quant_w{warps}"] = {"fused_us": us}
        print(f"act_quant at {warps} warps               {us:8.1f} us", flush=True)
    return out


def bench_pre_attention(spec, calls: int, reps: int, dev) -> dict:
    """The fused pre-attention into the FP8 cache at a steady chunk's shape over PRE_ROWS,
    each with how its queries, keys and values differ from the reference's."""
    H, T, D, eps = spec.n_heads, spec.chunk_tokens, spec.head_dim, spec.norm_eps
    S = spec.cache_frames * spec.frame_tokens
    g = torch.Generator(device=dev).manual_seed(0)
    ys = [(torch.randn(T, 3 * H * D, device=dev, generator=g) * 3).to(torch.bfloat16)
          for _ in range(BUFFERS)]
    qkv = [tuple(t.unflatten(1, (H, D)) for t in y.split(H * D, -1)) for y in ys]
    qn, kn = ((torch.rand(H * D, device=dev, generator=g) + 0.5).to(torch.bfloat16)
              for _ in range(2))
    cos, sin = cos_sin(torch.rand(T, D // 2, device=dev, generator=g) * 6)
    idx = S - T + torch.arange(T, device=dev)
    ks = torch.rand(H, 1, 1, device=dev, generator=g) * 0.01 + 0.01
    vs = torch.rand(H, 1, 1, device=dev, generator=g) * 0.01 + 0.01

    def stores():
        return (torch.zeros(H, S, D, dtype=fp8.FP8, device=dev),
                torch.zeros(H, D, S, dtype=fp8.FP8, device=dev).transpose(1, 2))

    ref_k, ref_v = stores()
    ref_q, _ = pre_attention_width.reference(*qkv[0], qn, kn, eps, cos, sin, ref_k, ref_v, ks,
                                             vs, idx)

    def codes(a, b):
        """The share of e4m3 values not equal to the reference's, and whether every one is
        within one code of it."""
        x, y = a.float(), b.float()
        near = bool(((x - y).abs() <= torch.maximum(x.abs(), y.abs()) * 2.0 ** -3 + 2.0 ** -9)
                    .all())
        return {"differ": float((a.view(torch.uint8) != b.view(torch.uint8)).float().mean()),
                "within_one_code": near}

    out = {}
    for t, v, w in PRE_ROWS:
        name, tiles = f"rows_t{t}_v{v}_w{w}", pre_attention_width.RowTiles(t, v, w)
        k8, v8 = stores()
        try:
            q8, _ = pre_attention_width.triton_pre_attention_width(
                *qkv[0], qn, kn, eps, cos, sin, k8, v8, ks, vs, idx, tiles)
            out[name] = {"q_codes": codes(q8, ref_q), "k_codes": codes(k8, ref_k),
                         "v_codes": codes(v8, ref_v)}
            out[name]["us"] = graph_time_us(
                lambda i: pre_attention_width.triton_pre_attention_width(
                    *qkv[i % BUFFERS], qn, kn, eps, cos, sin, k8, v8, ks, vs, idx, tiles),
                calls, reps)
            print(f"pre_attention {name:22s} {out[name]['us']:8.1f} us  q {out[name]['q_codes']} "
                  f"k {out[name]['k_codes']} v {out[name]['v_codes']}", flush=True)
        except Exception as e:  # a tile that does not compile is reported, not fatal
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(f"pre_attention {name:22s} {out[name]['error'][:100]}", flush=True)
    return out


def bench_cross_attention(spec, calls: int, reps: int, dev) -> dict:
    """The cross-attention's shape (the chunk's queries over the prompt's keys): SDPA in
    bf16 through each backend that takes it, the queries laid out as the model passes them
    (heads of a token's row, [T, H, D] transposed), and the FP8 kernel's tiles (queries and
    the text's keys and values in e4m3, as bench_attention lays them out)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    H, T, S, D = spec.n_heads, spec.chunk_tokens, spec.prompt_tokens, spec.head_dim
    g = torch.Generator(device=dev).manual_seed(0)
    q = [torch.randn(T, H, D, device=dev, generator=g).to(torch.bfloat16).transpose(0, 1)[None]
         for _ in range(BUFFERS)]
    k, v = (torch.randn(spec.n_blocks, H, S, D, device=dev, generator=g).to(torch.bfloat16)
            for _ in range(2))
    out = {}
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION):
        name = f"sdpa_bf16_{backend.name.lower()}"
        try:
            with sdpa_kernel([backend]):
                us = graph_time_us(lambda i: F.scaled_dot_product_attention(
                    q[i % BUFFERS], k[i % spec.n_blocks][None], v[i % spec.n_blocks][None]),
                    calls, reps)
            out[name] = {"us": us, "tflops": 4 * H * T * S * D / us / 1e6}
            print(f"cross {name:40s} {us:8.1f} us", flush=True)
        except RuntimeError as e:  # a backend that does not take the shape
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(f"cross {name:40s} {out[name]['error'][:80]}", flush=True)
    fp8_tiles = bench_attention(H, T, S, D, calls, reps, dev, EXTRA_TILES)
    for name, r in sorted(fp8_tiles.items(), key=lambda kv: kv[1].get("us", 1e30))[:6]:
        print(f"cross {name:40s} " + (f"{r['us']:8.1f} us" if "us" in r
                                      else r["error"][:80]), flush=True)
    return out | fp8_tiles  # bench_attention's names: its cudnn_bf16 and triton_* tiles


def gemm_shapes(spec) -> dict[str, tuple[int, int]]:
    """Each linear kind's (N, K) with fused q, k, v (livetalk/rank.py's FUSED_KINDS)."""
    d, f = spec.dim, spec.ffn_dim
    return {"qkv": (3 * d, d), "attn": (d, d), "ffn_up": (f, d), "ffn_down": (d, f)}


def bench_gemm(spec, reps: int, dev) -> dict:
    """Each FP8 GEMM shape of a chunk, bias in the epilogue as the model adds it, through
    `torch._scaled_mm` (cuBLASLt with torch's workspace) and the `cublaslt` choice (no
    workspace): microseconds per call in a CUDA graph of GEMM_CALLS calls, and the memsets
    and kernels a call adds to the graph (a profile of one replay)."""
    from torch.profiler import ProfilerActivity, profile

    T = spec.chunk_tokens
    g = torch.Generator(device=dev).manual_seed(0)
    out = {}
    for kind, (N, K) in gemm_shapes(spec).items():
        aq, a_s = fp8.quantize_rows(torch.randn(T, K, device=dev, generator=g))
        ws = [fp8.quantize_rows(torch.randn(N, K, device=dev, generator=g) * 0.05)
              for _ in range(BUFFERS)]
        ws = [(q, s.reshape(-1).contiguous()) for q, s in ws]
        b = torch.randn(N, device=dev, generator=g).to(torch.bfloat16)
        ref = fp8.scaled_mm(aq, a_s, *ws[0], torch.bfloat16, True, bias=b)
        out[kind] = {}
        for choice in ("scaled_mm", "cublaslt"):
            mm = gemm.select(choice, "plain", dev)
            diff = float((mm(aq, a_s, *ws[0], torch.bfloat16, True, bias=b).float()
                          - ref.float()).abs().max())
            us = graph_time_us(lambda i: mm(aq, a_s, *ws[i % BUFFERS], torch.bfloat16, True,
                                            bias=b), GEMM_CALLS, reps)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for i in range(GEMM_CALLS):
                    mm(aq, a_s, *ws[i % BUFFERS], torch.bfloat16, True, bias=b)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                graph.replay()
                torch.cuda.synchronize(dev)
            ev = [e for e in prof.key_averages()
                  if e.device_type == torch.autograd.DeviceType.CUDA]
            out[kind][choice] = {
                "us": us, "max_diff_from_scaled_mm": diff,
                "memsets_per_call": sum(e.count for e in ev if "memset" in e.key.lower())
                / GEMM_CALLS,
                "kernels_per_call": sum(e.count for e in ev) / GEMM_CALLS}
            r = out[kind][choice]
            print(f"gemm {kind:8s} {choice:9s} {us:7.1f} us  memsets/call "
                  f"{r['memsets_per_call']:.1f}  kernels/call {r['kernels_per_call']:.1f}  "
                  f"max diff {diff:.3g}", flush=True)
    return out


def sections(cfg, args, dev) -> dict:
    spec = cfg.model
    S = spec.cache_frames * spec.frame_tokens
    return {
        "attention": lambda: bench_attention(spec.n_heads, spec.chunk_tokens, S, spec.head_dim,
                                             args.calls, args.reps, dev, EXTRA_TILES),
        "cross_attention": lambda: bench_cross_attention(spec, args.calls, args.reps, dev),
        "pre_attention": lambda: bench_pre_attention(spec, args.calls, args.reps, dev),
        "gemm": lambda: bench_gemm(spec, args.reps, dev),
        "epilogues": lambda: bench_epilogues(spec, args.calls, args.reps, dev),
    }
