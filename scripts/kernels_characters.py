"""The characters family's kernels for scripts/bench_kernels.py, at a preset's TP rank-slice
shapes: the attention kernel's tiles, the fused pre-attention, the activation quantizations,
the delta rotation, the FP8 KV calibration (a session runs it once, eagerly: timed eagerly,
host launches included), the FP8 GEMMs of every backend, and the block with the work between
its GEMMs moved into their epilogues; each against its reference."""

from __future__ import annotations

import functools
import math

import torch

from charengine import fp8
from charengine.characters.rope import RopeTables
from charengine.characters.spec import RankShape
from charengine.plugins import act_quant, attention, calibrate, delta_rotation, fp8_gemm, gemm, \
    gemm_residual, pre_attention, quack_gemm
from charengine.plugins.gemm import BACKENDS as GEMM_BACKENDS
from kernel_timing import (bench_attention, eager_time_ms, fp8_code_diff, graph_time_us, rel,
                           rowwise_weights, scale_bias, timed)

SECTIONS = ("attention", "pre_attention", "act", "delta", "calibrate", "gemm", "epilogues")
DEFAULTS = {"tp": 3, "calls": 40, "reps": 7}  # the characters-57b TP-3 slice, as measured


def bench_pre_attention(spec, shape, calls, reps, dev):
    H, T, D = shape.heads, spec.tokens_per_frame, spec.head_dim
    S = spec.global_tokens + 6 * T
    g = torch.Generator(device=dev).manual_seed(1)
    n = 8
    ys = [torch.randn(T, 3 * H * D, device=dev, generator=g).to(torch.bfloat16) for _ in range(n)]
    split = [[t.reshape(T, H, D).transpose(0, 1) for t in y.split(H * D, -1)] for y in ys]
    qn = (torch.rand(D, device=dev, generator=g) + 0.5).to(torch.bfloat16)
    kn = (torch.rand(D, device=dev, generator=g) + 0.5).to(torch.bfloat16)
    rope = RopeTables(spec).to(dev)
    cos, sin = torch.cos(rope.frame_angles(torch.tensor(20, device=dev))), \
        torch.sin(rope.frame_angles(torch.tensor(20, device=dev)))
    idx = spec.global_tokens + 3 * T + torch.arange(T, device=dev)
    ks = torch.full((H, 1, 1), 0.02, device=dev)
    vs = torch.full((H, 1, 1), 0.02, device=dev)
    pad = -S % 16

    def v_store():  # the production layout: [H, D, S] padded, seen as [H, S, D]
        return torch.zeros(H, D, S + pad, dtype=fp8.FP8, device=dev)[..., :S].transpose(1, 2)

    stores = [[torch.zeros(H, S, D, dtype=fp8.FP8, device=dev), v_store()] for _ in range(n)]
    out = {"reference": {"us": graph_time_us(lambda i: pre_attention.reference(
        *split[i % n], qn, kn, 1e-6, cos, sin, *stores[i % n], ks, vs, idx, quantize_q=True),
        calls, reps)}}
    for bt, w in ((16, 4), (32, 4), (32, 8), (64, 8), (16, 2)):
        out[f"triton_t{bt}_w{w}"] = {"us": graph_time_us(
            lambda i, bt=bt, w=w: pre_attention.triton_pre_attention(
                *split[i % n], qn, kn, 1e-6, cos, sin, *stores[i % n], ks, vs, idx,
                quantize_q=True, block_t=bt, warps=w), calls, reps)}
    a = [torch.zeros(H, S, D, dtype=fp8.FP8, device=dev) for _ in range(4)]
    qr = pre_attention.reference(*split[0], qn, kn, 1e-6, cos, sin, a[0], a[1], ks, vs, idx)
    qt = pre_attention.triton_pre_attention(*split[0], qn, kn, 1e-6, cos, sin, a[2], a[3], ks, vs, idx)
    out["parity_rows_store"] = ({"q_max_abs": (qr.float() - qt.float()).abs().max().item(),
                          "k": fp8_code_diff(a[0], a[2]), "v": fp8_code_diff(a[1], a[3])})
    return out


def bench_act(spec, shape, calls, reps, dev):
    T, d = spec.tokens_per_frame, spec.dim
    A, M = shape.attn_width(spec), shape.mlp
    g = torch.Generator(device=dev).manual_seed(2)
    n = 8
    hs = [torch.randn(T, d, device=dev, generator=g).to(torch.bfloat16) for _ in range(n)]
    shift = (torch.randn(d, device=dev, generator=g) * 0.1).to(torch.bfloat16)
    scale = (torch.randn(d, device=dev, generator=g) * 0.1).to(torch.bfloat16)
    att = [torch.randn(T, A, device=dev, generator=g).to(torch.bfloat16) for _ in range(n)]
    gu = [torch.randn(T, 2 * M, device=dev, generator=g).to(torch.bfloat16) for _ in range(n)]
    out = {}
    variants = [("norm_modulate_reference", lambda i: act_quant.norm_modulate_reference(
                    hs[i % n], shift, scale, 1e-6)),
                ("swiglu_reference", lambda i: act_quant.swiglu_reference(
                    att[i % n], gu[i % n][:, :M], gu[i % n][:, M:]))]
    for w in (None, 4, 8, 16):
        variants.append((f"norm_modulate_triton_w{w}", lambda i, w=w: act_quant.triton_norm_modulate_quant(
            hs[i % n], shift, scale, 1e-6, warps=w)))
    os_ = [torch.randn(T, d, device=dev, generator=g).to(torch.bfloat16) for _ in range(n)]
    gate = (torch.randn(d, device=dev, generator=g) * 0.1).to(torch.bfloat16)
    outs = [torch.empty(T, d, device=dev, dtype=torch.bfloat16) for _ in range(n)]
    # what the GPU's memory gives an elementwise kernel here: read two [T, d], write one
    variants.append(("torch_add_bandwidth_reference", lambda i: torch.add(
        hs[i % n], os_[i % n], out=outs[i % n])))
    variants.append(("addcmul_then_norm_modulate_triton", lambda i: act_quant.triton_norm_modulate_quant(
        torch.addcmul(hs[i % n], gate, os_[i % n]), shift, scale, 1e-6)))
    for w in (None, 8, 16):
        variants.append((f"residual_norm_modulate_triton_w{w}",
                         lambda i, w=w: act_quant.triton_residual_norm_modulate_quant(
                             hs[i % n], os_[i % n], gate, shift, scale, 1e-6, warps=w)))
    for w in (8, 16, 32):
        variants.append((f"swiglu_row_triton_w{w}", lambda i, w=w: act_quant.triton_swiglu_quant_row(
            att[i % n], gu[i % n][:, :M], gu[i % n][:, M:], warps=w)))
    # as in the step: gate and up strided views of the input projection's output
    proj = [torch.randn(T, 3 * A + 2 * M, device=dev, generator=g).to(torch.bfloat16)
            for _ in range(n)]
    for name, fn in (("swiglu_triton_w8_c2048_strided", act_quant.triton_swiglu_quant),
                     ("swiglu_row_triton_w8_strided", act_quant.triton_swiglu_quant_row)):
        variants.append((name, lambda i, fn=fn: fn(att[i % n], proj[i % n][:, 3 * A:3 * A + M],
                                                    proj[i % n][:, 3 * A + M:])))
    for w, c in ((8, 2048), (4, 1024), (16, 2048), (8, 1024), (16, 4096)):
        variants.append((f"swiglu_triton_w{w}_c{c}", lambda i, w=w, c=c: act_quant.triton_swiglu_quant(
            att[i % n], gu[i % n][:, :M], gu[i % n][:, M:], warps=w, chunk=c)))
    for name, fn in variants:
        timed(out, name, fn, calls, reps)
    for kind, r, t in (
            ("norm_modulate", act_quant.norm_modulate_reference(hs[0], shift, scale, 1e-6),
             act_quant.triton_norm_modulate_quant(hs[0], shift, scale, 1e-6)),
            ("swiglu", act_quant.swiglu_reference(att[0], gu[0][:, :M], gu[0][:, M:]),
             act_quant.triton_swiglu_quant(att[0], gu[0][:, :M], gu[0][:, M:]))):
        out[f"{kind}_parity"] = ({
            "scale_max_rel": ((r[1] - t[1]).abs() / r[1]).max().item(),
            "rows_same_scale": float((r[1] == t[1]).float().mean()),
            **fp8_code_diff(r[0], t[0])})
    return out


def bench_delta(spec, cfg, shape, reps, dev):
    H, T, D = shape.heads, spec.tokens_per_frame, spec.head_dim
    G, W = spec.global_tokens, cfg.cache.window
    C = spec.n_blocks * cfg.schedule.passes
    g = torch.Generator(device=dev).manual_seed(3)
    k8 = torch.empty(C, H, G + W * T, D, dtype=fp8.FP8, device=dev)
    for c in range(C):
        k8[c] = fp8.quantize(torch.randn(H, G + W * T, D, device=dev, generator=g) * 50, 1.0)
    sc = torch.rand(C, H, 1, 1, device=dev, generator=g) * 0.01 + 0.005
    rope = RopeTables(spec).to(dev)
    delta = float(cfg.cache.delta)
    out = {}
    for name, fn in (("reference", delta_rotation.reference),
                     ("triton", delta_rotation.triton_delta_rotation)):
        out[name] = {"ms": graph_time_us(lambda i: fn(k8, sc, G, rope.omega_t, delta), 1, reps) / 1e3}
    a, b = k8[:4].clone(), k8[:4].clone()
    delta_rotation.reference(a, sc[:4], G, rope.omega_t, delta)
    delta_rotation.triton_delta_rotation(b, sc[:4], G, rope.omega_t, delta)
    out["triton"].update(fp8_code_diff(a, b))
    return out


def bench_calibrate(spec, cfg, shape, reps, dev):
    """The FP8 KV calibration over every cache of the rank slice, as a session's calibration
    step runs it (eager)."""
    H, D = shape.heads, spec.head_dim
    S = spec.global_tokens + cfg.cache.window * spec.tokens_per_frame
    C = spec.n_blocks * cfg.schedule.passes
    g = torch.Generator(device=dev).manual_seed(5)
    k = torch.randn(C, H, S, D, device=dev, generator=g, dtype=torch.bfloat16)
    v = torch.randn(C, H, S, D, device=dev, generator=g, dtype=torch.bfloat16)
    k8 = torch.empty(C, H, S, D, dtype=fp8.FP8, device=dev)
    v8 = torch.empty(C, H, D, S + (-S % 16), dtype=fp8.FP8, device=dev)[..., :S].transpose(-1, -2)
    scale = torch.empty(C, 2, H, 1, 1, device=dev)
    cc = cfg.cache
    return {name: {"ms": eager_time_ms(lambda fn=fn: fn(k, v, k8, v8, scale, cc.scale_margin,
                                                        cc.fp8_max), reps)}
            for name, fn in (("reference", calibrate.reference),
                             ("triton", calibrate.triton_calibrate))}


# charbuild's QuACK candidates and one more tile configuration
QUACK_TILES = (*quack_gemm.CANDIDATES, "128,128,2,1,1")


def bench_gemm(spec, shape, calls, reps, dev, libs=GEMM_BACKENDS):
    """`libs`: the candidates timed; quack where it is installed (plugins/quack_gemm.py),
    with fast accumulation at every tile configuration and promoted sums at the first."""
    T = spec.tokens_per_frame
    g = torch.Generator(device=dev).manual_seed(4)
    out = {}
    for name, N, K in (("w_in", shape.in_proj_rows(spec), spec.dim),
                       ("w_out", spec.dim, shape.out_proj_cols(spec))):
        n = max(2, math.ceil(200e6 / (N * K)))  # weights past L2
        a_q, a_s = fp8.quantize_rows(torch.randn(T, K, device=dev, generator=g))
        ws = rowwise_weights(n, N, K, dev, g)
        flop = 2 * T * N * K
        # fp32 sums of the exact FP8 products: the error is the accumulation's and rounding's
        ref = (a_q.float() @ ws[0][0].float().t()) * a_s * ws[0][1][None, :]
        res = {}
        for fast in (False, True):
            us = graph_time_us(lambda i: fp8.scaled_mm(a_q, a_s, *ws[i % n], torch.bfloat16, fast),
                               calls, reps)
            o = fp8.scaled_mm(a_q, a_s, *ws[0], torch.bfloat16, fast)
            res[f"scaled_mm{'_fast' if fast else ''}"] = {
                "us": us, "tflops": flop / us / 1e6, "rel_err": rel(o, ref),
                "scale_bias": scale_bias(fp8.scaled_mm(a_q, a_s, *ws[0], torch.float32, fast), ref)}
        # promote: None once per K tile (cuBLASLt's default numerics), 0 never (fast
        # accumulation's)
        triton_tiles = () if "triton" not in libs else (
                (128, 128, 128, 8, 4, None), (128, 256, 128, 8, 3, None),
                (64, 128, 128, 4, 4, None), (128, 128, 64, 4, 5, None),
                (128, 128, 128, 8, 4, 0), (128, 256, 128, 8, 3, 0))
        for bm, bn, bk, w, st, promote in triton_tiles:
            t = fp8_gemm.GemmTiles(bm, bn, bk, 8, w, st, promote)
            key = f"triton_m{bm}_n{bn}_k{bk}_w{w}_s{st}_promote{t.promote(False)}"
            try:
                o = fp8_gemm.triton_scaled_mm(a_q, a_s, *ws[0], torch.bfloat16, t)
                us = graph_time_us(lambda i: fp8_gemm.triton_scaled_mm(
                    a_q, a_s, *ws[i % n], torch.bfloat16, t), calls, reps)
            except Exception as e:
                res[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                continue
            res[key] = {"us": us, "tflops": flop / us / 1e6, "rel_err": rel(o, ref)}
        if "quack" in libs and quack_gemm.available():
            runs = [(spec_, True) for spec_ in QUACK_TILES] + [(QUACK_TILES[0], False)]
            for spec_, fast in runs:
                key = f"quack_{spec_.replace(',', '_')}{'_fast' if fast else ''}"
                gemm = functools.partial(quack_gemm.quack_scaled_mm, fast_accum=fast,
                                         tiles=quack_gemm.QuackTiles.parse(spec_))
                try:
                    o = gemm(a_q, a_s, *ws[0], torch.bfloat16)
                    us = graph_time_us(lambda i: gemm(a_q, a_s, *ws[i % n], torch.bfloat16),
                                       calls, reps)
                except Exception as e:
                    res[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                    continue
                res[key] = {"us": us, "tflops": flop / us / 1e6, "rel_err": rel(o, ref)}
        out[f"{name}_{T}x{N}x{K}"] = res
    return out


SWIGLU_TILES = ("128,256,2,1,0", "128,192,2,1,1", "128,128,2,1,1", "256,128,1,2,0",
                "128,192,1,2,1", "256,192,1,2,0", "128,160,2,1,1")


def bench_epilogues(spec, shape, calls, reps, dev):
    """The block with the work between the GEMMs moved into their epilogues (gemm_swiglu): the
    input projection with SwiGLU and row maxima in QuACK's epilogue, as one GEMM and as the
    rejected split (a q/k/v GEMM and a gate/up one), the attention kernel giving its row
    maxima, the concatenate-and-quantize kernel that needs no row reduction, and the output
    projection with the residual in its epilogue; each against the default block's kernels
    at the rank slice."""
    T, d = spec.tokens_per_frame, spec.dim
    A, M = shape.attn_width(spec), shape.mlp
    g = torch.Generator(device=dev).manual_seed(6)
    out = {}
    bf = torch.bfloat16
    # input projection: the present single GEMM against the split
    a_q, a_s = fp8.quantize_rows(torch.randn(T, d, device=dev, generator=g))
    n = 3
    w_in = rowwise_weights(n, 3 * A + 2 * M, d, dev, g, 0.02)
    w_qkv = [(q[:3 * A].contiguous(), s[:3 * A].contiguous()) for q, s in w_in]
    w_gu = [(quack_gemm.interleave_gate_up(q[3 * A:]).contiguous(),
             quack_gemm.interleave_gate_up(s[3 * A:]).contiguous()) for q, s in w_in]
    timed(out, "w_in_scaled_mm_fast", lambda i: fp8.scaled_mm(a_q, a_s, *w_in[i % n], bf, True),
           calls, reps)
    timed(out, "qkv_scaled_mm_fast", lambda i: fp8.scaled_mm(a_q, a_s, *w_qkv[i % n], bf, True),
           calls, reps)
    if not quack_gemm.available():
        out["quack"] = "not installed"
    else:
        ref_y, ref_amax = quack_gemm.swiglu_reference(a_q, a_s, *w_gu[0], bf, True)[1:]
        w_pairs = [(torch.cat([q[:3 * A], p]), torch.cat([s_[:3 * A], ps]))
                   for (q, s_), (p, ps) in zip(w_in, w_gu)]
        for spec_ in QUACK_TILES:
            t = quack_gemm.QuackTiles.parse(spec_)
            timed(out, f"w_in_quack_{spec_}", lambda i, t=t: quack_gemm.quack_scaled_mm(
                a_q, a_s, *w_in[i % n], bf, True, t), calls, reps)
            timed(out, f"qkv_quack_{spec_}", lambda i, t=t: quack_gemm.quack_scaled_mm(
                a_q, a_s, *w_qkv[i % n], bf, True, t), calls, reps)
        for spec_ in SWIGLU_TILES:
            t = quack_gemm.QuackTiles.parse(spec_)

            def check(t=t, split=0):
                w = w_pairs[0] if split else w_gu[0]
                _, y, am = quack_gemm.quack_swiglu_mm(a_q, a_s, *w, bf, True, split, t)
                return {"rel_err": rel(y, ref_y),
                        "amax_max_rel": ((am.amax(1, keepdim=True) - ref_amax).abs()
                                         / ref_amax).max().item()}
            # the gate/up GEMM alone (after a q/k/v one), and the whole input projection
            timed(out, f"swiglu_quack_{spec_}", lambda i, t=t: quack_gemm.quack_swiglu_mm(
                a_q, a_s, *w_gu[i % n], bf, True, 0, t), calls, reps, check)
            if 3 * A % t.tile_n == 0:
                timed(out, f"w_in_swiglu_quack_{spec_}",
                       lambda i, t=t: quack_gemm.quack_swiglu_mm(a_q, a_s, *w_pairs[i % n], bf,
                                                                 True, 3 * A, t),
                       calls, reps, lambda t=t: check(t, 3 * A))
        # output projection with the residual in the epilogue
        K = A + M
        o_q, o_s = fp8.quantize_rows(torch.randn(T, K, device=dev, generator=g))
        w_out = rowwise_weights(n, d, K, dev, g, 0.02)
        hs = [torch.randn(T, d, device=dev, generator=g).to(bf) for _ in range(n)]
        ref_r = gemm_residual.reference(o_q, o_s, *w_out[0], hs[0], bf, True)
        for spec_ in ("128,192,2,1,1", "256,192,1,2,0", "128,256,2,1,0"):
            t = quack_gemm.QuackTiles.parse(spec_)
            timed(out, f"w_out_quack_{spec_}", lambda i, t=t: quack_gemm.quack_scaled_mm(
                o_q, o_s, *w_out[i % n], bf, True, t), calls, reps)
            timed(out, f"w_out_residual_quack_{spec_}",
                   lambda i, t=t: quack_gemm.quack_scaled_mm_residual(
                       o_q, o_s, *w_out[i % n], hs[i % n], bf, True, t), calls, reps,
                   lambda t=t: {"rel_err": rel(quack_gemm.quack_scaled_mm_residual(
                       o_q, o_s, *w_out[0], hs[0], bf, True, t), ref_r)})
        lt = gemm.select("scaled_mm", "residual", dev)
        timed(out, "w_out_residual_cublaslt", lambda i: lt(o_q, o_s, *w_out[i % n], hs[i % n],
                                                            bf, True), calls, reps)
    # the quantization before the output projection
    nb = 8
    att = [torch.randn(T, A, device=dev, generator=g).to(bf) for _ in range(nb)]
    ys = [torch.randn(T, M, device=dev, generator=g).to(bf) for _ in range(nb)]
    gu = [torch.randn(T, 2 * M, device=dev, generator=g).to(bf) for _ in range(nb)]
    ya = [y.float().abs().reshape(T, -1, 128).amax(-1) for y in ys]  # 128-column partials
    aa = [a.float().abs().reshape(T, -1, spec.head_dim).amax(-1).t().contiguous().t()
          for a in att]  # [heads, T] seen as [T, heads], as the attention kernel gives it
    ref_q, ref_s = fp8.quantize_rows(torch.cat([att[0], ys[0]], -1))
    timed(out, "swiglu_row_triton_w16", lambda i: act_quant.triton_swiglu_quant_row(
        att[i % nb], gu[i % nb][:, :M], gu[i % nb][:, M:]), calls, reps)
    timed(out, "act_quant_triton_concatenated", lambda i: act_quant.triton_act_quant(
        torch.cat([att[i % nb], ys[i % nb]], -1)), calls, reps)
    for has_am in (True, False):
        for chunk, w in ((1024, 4), (2048, 4), (2048, 2), (4096, 4), (4096, 8), (1024, 2)):
            def check(chunk=chunk, w=w, has_am=has_am):
                q, s_ = act_quant.triton_concat_quant(att[0], aa[0] if has_am else None, ys[0],
                                                      ya[0], chunk, w)
                return {"same_bytes": bool((q.view(torch.uint8) == ref_q.view(torch.uint8)).all()),
                        "same_scales": bool((s_ == ref_s).all())}
            timed(out, f"concat_quant_c{chunk}_w{w}{'_attn_amax' if has_am else ''}",
                   lambda i, chunk=chunk, w=w, has_am=has_am: act_quant.triton_concat_quant(
                       att[i % nb], aa[i % nb] if has_am else None, ys[i % nb], ya[i % nb],
                       chunk, w), calls, reps, check)
    hs = [torch.randn(T, d, device=dev, generator=g).to(bf) for _ in range(nb)]
    shift = (torch.randn(d, device=dev, generator=g) * 0.1).to(bf)
    scale = (torch.randn(d, device=dev, generator=g) * 0.1).to(bf)
    timed(out, "norm_modulate_triton", lambda i: act_quant.triton_norm_modulate_quant(
        hs[i % nb], shift, scale, 1e-6), calls, reps)
    # attention with and without its row maxima
    H, D = shape.heads, spec.head_dim
    S = spec.global_tokens + 6 * T
    q8, qs = fp8.quantize_rows(torch.randn(H, T, D, device=dev, generator=g))
    k8 = [fp8.quantize(torch.randn(H, S, D, device=dev, generator=g) * 2, 1.0) for _ in range(4)]
    # values stored [H, D, S] with rows padded to 16 bytes, as the cache keeps them
    v8 = [fp8.quantize(torch.randn(H, D, S - S % -16, device=dev, generator=g) * 2,
                       1.0)[..., :S].transpose(1, 2) for _ in range(4)]
    ks = torch.full((H, 1, 1), 0.01, device=dev)
    amax = torch.empty(H, T, device=dev)
    timed(out, "attention", lambda i: attention.triton_attention(
        q8, qs, k8[i % 4], v8[i % 4], ks, ks, bf), calls, reps)

    def check_att():
        o = attention.triton_attention(q8, qs, k8[0], v8[0], ks, ks, bf, amax=amax)
        return {"amax_exact": bool((o.float().abs().reshape(T, H, D).amax(-1) == amax.t()).all())}
    timed(out, "attention_amax", lambda i: attention.triton_attention(
        q8, qs, k8[i % 4], v8[i % 4], ks, ks, bf, amax=amax), calls, reps, check_att)
    return out


def sections(cfg, args, dev) -> dict:
    """Each section's run at TP rank 0's slice of cfg's layout."""
    spec, shape = cfg.model, RankShape.of(cfg.model, cfg.tp, 0)
    S = spec.global_tokens + cfg.cache.window * spec.tokens_per_frame
    libs = tuple(args.gemm_libs.split(",")) if args.gemm_libs else GEMM_BACKENDS
    return {
        "attention": lambda: bench_attention(shape.heads, spec.tokens_per_frame, S,
                                             spec.head_dim, args.calls, args.reps, dev),
        "pre_attention": lambda: bench_pre_attention(spec, shape, args.calls, args.reps, dev),
        "act": lambda: bench_act(spec, shape, args.calls, args.reps, dev),
        "delta": lambda: bench_delta(spec, cfg, shape, args.reps, dev),
        "calibrate": lambda: bench_calibrate(spec, cfg, shape, args.reps, dev),
        "epilogues": lambda: bench_epilogues(spec, shape, args.calls, args.reps, dev),
        "gemm": lambda: bench_gemm(spec, shape, args.calls, args.reps, dev, libs),
    }
