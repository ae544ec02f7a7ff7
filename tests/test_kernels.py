"""The plugins' Triton kernels against their references on the GPU: random inputs, odd sizes,
outputs poisoned before the run. (Triton's CPU interpreter cannot stand in: its fp32 -> e4m3
and -> bf16 conversions round differently from the hardware.)

Bounds, and why:
- FP8 attention: P enters the P V dot as e4m3 (3 mantissa bits), so each probability carries
  up to 2^-4 relative error and the output at most 2^-4 of max |V| against the reference's
  bf16 softmax; with P in bf16 the bound is the bf16 unit, 2^-8.
- Pre-attention, activation quantization, delta rotation: the kernels round where the
  references round; fp32 summation order and fused multiply-adds can still move a value
  across a rounding boundary, so a few values may differ by one code (e4m3) or one unit
  (bf16) and none by more.
"""


import dataclasses

import pytest
import torch

from charengine import fp8
from charengine.characters.spec import PRESETS
from charengine.config import preset
from charengine.characters.config import Switches
from charengine.plugins import act_quant, attention, calibrate, delta_rotation, fp8_gemm, gemm, \
    gemm_residual, pre_attention
from charengine.rope import cos_sin
from rollout import rel_err

pytest.importorskip("triton")
pytestmark = pytest.mark.gpu
DEV = "cuda"
NAN8 = 0x7F  # an e4m3fn NaN byte
H200_SMS = 132


def codes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in e4m3 codes (adjacent values of one sign differ by one code)."""
    return (a.view(torch.uint8).int() - b.view(torch.uint8).int()).abs()


def fp8_tensor(shape, g, spread=2.0):
    return fp8.quantize(torch.randn(shape, device=DEV, generator=g) * spread, 1.0)


@pytest.mark.parametrize("H,T,S,D", [(20, 757, 5788, 128), (3, 37, 150, 64), (5, 200, 333, 32)])
@pytest.mark.parametrize("p_fp8", [True, False])
@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("fma", [False, True])
def test_fp8_attention_matches_reference(H, T, S, D, p_fp8, tma, fma):
    g = torch.Generator(device=DEV).manual_seed(H + T)
    q8, qs = fp8.quantize_rows(torch.randn(H, T, D, device=DEV, generator=g))
    k8, v8 = fp8_tensor((H, S, D), g), fp8_tensor((H, S, D), g)
    ks = torch.rand(H, 1, 1, device=DEV, generator=g) * 0.02 + 0.01
    vs = torch.rand(H, 1, 1, device=DEV, generator=g) * 0.02 + 0.01
    ref = attention.reference(q8, qs, k8, v8, ks, vs, torch.float32)
    out = torch.full((T, H * D), float("nan"), dtype=torch.bfloat16, device=DEV)
    attention.triton_attention(q8, qs, k8, v8, ks, vs, torch.bfloat16,
                               attention.AttentionTiles(p_fp8=p_fp8, tma=tma, fma=fma), out=out)
    vmax = (v8.float().abs().amax(dim=(1, 2)) * vs.flatten()).max()
    bound = 2.0 ** -4 if p_fp8 else 2.0 ** -7
    assert not out.isnan().any()
    assert (out.float() - ref).abs().max() <= bound * vmax


@pytest.mark.parametrize("tma", [True, False])
def test_fp8_attention_reads_a_transposed_value_store(tma):
    """A value store laid out [H, D, S] (slots padded to 16 bytes) gives the same result."""
    g = torch.Generator(device=DEV).manual_seed(7)
    H, T, S, D = 4, 100, 500, 128
    q8, qs = fp8.quantize_rows(torch.randn(H, T, D, device=DEV, generator=g))
    k8, v8 = fp8_tensor((H, S, D), g), fp8_tensor((H, S, D), g)
    one = torch.full((H, 1, 1), 0.01, device=DEV)
    store = torch.zeros(H, D, S + (-S % 16), dtype=fp8.FP8, device=DEV)
    store[..., :S] = v8.transpose(1, 2)
    vt = store[..., :S].transpose(1, 2)
    tiles = attention.AttentionTiles(p_fp8=False, tma=tma)
    a = attention.triton_attention(q8, qs, k8, v8, one, one, torch.bfloat16, tiles)
    b = attention.triton_attention(q8, qs, k8, vt, one, one, torch.bfloat16, tiles)
    assert torch.equal(a, b)


@pytest.mark.parametrize("H,T,D", [(20, 757, 128), (3, 17, 16), (2, 33, 8)])
@pytest.mark.parametrize("quant", [True, False])
@pytest.mark.parametrize("scattered", [False, True])
def test_pre_attention_matches_reference(H, T, D, quant, scattered):
    """A frame's slots as a run (as KVCache.frame_index gives them) or scattered."""
    g = torch.Generator(device=DEV).manual_seed(T)
    S = 4 * T + 11
    y = (torch.randn(T, 3 * H * D, device=DEV, generator=g) * 3).to(torch.bfloat16)
    q, k, v = (t.reshape(T, H, D).transpose(0, 1) for t in y.split(H * D, -1))
    qn = (torch.rand(D, device=DEV, generator=g) + 0.5).to(torch.bfloat16)
    kn = (torch.rand(D, device=DEV, generator=g) + 0.5).to(torch.bfloat16)
    cos, sin = cos_sin(torch.rand(T, D // 2, device=DEV, generator=g) * 6)
    idx = 5 + 2 * T + torch.arange(T, device=DEV)
    if scattered:
        idx = idx[torch.randperm(T, device=DEV, generator=g)]
    dt = fp8.FP8 if quant else torch.bfloat16
    ks = torch.rand(H, 1, 1, device=DEV, generator=g) * 0.01 + 0.005 if quant else None
    vs = torch.rand(H, 1, 1, device=DEV, generator=g) * 0.01 + 0.005 if quant else None
    stores = []
    for _ in range(4):
        t = torch.empty(H, S, D, dtype=dt, device=DEV)
        (t.view(torch.uint8).fill_(NAN8) if quant else t.fill_(float("nan")))
        stores.append(t)
    qr = pre_attention.reference(q, k, v, qn, kn, 1e-6, cos, sin, stores[0], stores[1], ks, vs, idx)
    qt = pre_attention.triton_pre_attention(q, k, v, qn, kn, 1e-6, cos, sin, stores[2],
                                            stores[3], ks, vs, idx, block_t=16)
    two_ulps = qr.float().abs().amax(-1, keepdim=True) * 2.0 ** -7  # of the row's scale
    assert ((qt.float() - qr.float()).abs() <= two_ulps).all()
    for r, t in ((stores[0], stores[2]), (stores[1], stores[3])):
        if quant:
            assert codes(r, t).max() <= 1
            assert torch.equal(r.view(torch.uint8)[:, :5], t.view(torch.uint8)[:, :5])  # untouched
        else:
            written = r[:, idx].float()
            two_ulps = written.abs().amax(-1, keepdim=True) * 2.0 ** -7
            assert ((t[:, idx].float() - written).abs() <= two_ulps).all()
            assert t[:, :5].isnan().all()


def test_pre_attention_quantizes_queries_like_the_reference():
    g = torch.Generator(device=DEV).manual_seed(3)
    H, T, D, S = 20, 757, 128, 3100
    y = (torch.randn(T, 3 * H * D, device=DEV, generator=g) * 3).to(torch.bfloat16)
    q, k, v = (t.reshape(T, H, D).transpose(0, 1) for t in y.split(H * D, -1))
    qn, kn = ((torch.rand(D, device=DEV, generator=g) + 0.5).to(torch.bfloat16) for _ in range(2))
    cos, sin = cos_sin(torch.rand(T, D // 2, device=DEV, generator=g) * 6)
    idx = 1000 + torch.arange(T, device=DEV)
    ks = vs = torch.full((H, 1, 1), 0.01, device=DEV)
    stores = [torch.zeros(H, S, D, dtype=fp8.FP8, device=DEV) for _ in range(4)]
    ref = pre_attention.reference(q, k, v, qn, kn, 1e-6, cos, sin, stores[0], stores[1], ks, vs,
                                  idx, quantize_q=True)
    out = pre_attention.triton_pre_attention(q, k, v, qn, kn, 1e-6, cos, sin, stores[2],
                                             stores[3], ks, vs, idx, quantize_q=True)
    assert_quantized_rows_close(ref, out)


@pytest.mark.parametrize("C,H,S,G,D,nt", [(9, 20, 600, 100, 128, 22), (3, 3, 77, 10, 16, 3)])
def test_delta_rotation_matches_reference(C, H, S, G, D, nt):
    g = torch.Generator(device=DEV).manual_seed(C)
    k8 = fp8_tensor((C, H, S, D), g, spread=60)
    scale = torch.rand(C, 2, H, 1, 1, device=DEV, generator=g) * 0.01 + 0.005
    k8.view(torch.uint8)[:, :, :G] = NAN8  # globals: must stay as they are
    omega = torch.rand(nt, device=DEV, generator=g)
    a, b = k8.clone(), k8.clone()
    delta_rotation.reference(a, scale[:, 0], G, omega, -42.0)
    delta_rotation.triton_delta_rotation(b, scale[:, 0], G, omega, -42.0)
    assert torch.equal(b.view(torch.uint8)[:, :, :G], k8.view(torch.uint8)[:, :, :G])
    assert torch.equal(b[..., 2 * nt:].view(torch.uint8), k8[..., 2 * nt:].view(torch.uint8))
    d = codes(a[:, :, G:], b[:, :, G:])
    assert d.max() <= 1 and (d > 0).float().mean() < 1e-3


@pytest.mark.parametrize("T,d", [(757, 7680), (31, 100), (5, 64)])
def test_norm_modulate_quant_matches_reference(T, d):
    g = torch.Generator(device=DEV).manual_seed(d)
    h = (torch.randn(T, d, device=DEV, generator=g) * 4 + 1).to(torch.bfloat16)
    shift, scale = ((torch.randn(d, device=DEV, generator=g) * 0.3).to(torch.bfloat16)
                    for _ in range(2))
    ref = act_quant.norm_modulate_reference(h, shift, scale, 1e-6)
    assert_quantized_rows_close(ref, act_quant.triton_norm_modulate_quant(h, shift, scale, 1e-6))


@pytest.mark.parametrize("T,d", [(757, 7680), (31, 100)])
def test_residual_norm_modulate_quant_matches_reference(T, d):
    """The previous block's gated residual added in front: the new h (stored, poisoned first)
    within one bf16 rounding of torch.addcmul's, the quantized rows as the reference's."""
    g = torch.Generator(device=DEV).manual_seed(d + 1)
    h, o = ((torch.randn(T, d, device=DEV, generator=g) * 4 + 1).to(torch.bfloat16)
            for _ in range(2))
    gate, shift, scale = ((torch.randn(d, device=DEV, generator=g) * 0.3).to(torch.bfloat16)
                          for _ in range(3))
    rq, rs, rh = act_quant.residual_norm_modulate_reference(h, o, gate, shift, scale, 1e-6)
    h_before = h.clone()
    tq, ts, th = act_quant.triton_residual_norm_modulate_quant(h, o, gate, shift, scale, 1e-6)
    assert torch.equal(h, h_before)  # the old h is left as it was
    assert ((th.float() - rh.float()).abs() <= rh.float().abs() * 2.0 ** -8).all()
    assert (th == rh).float().mean() > 0.99
    assert_quantized_rows_close((rq, rs), (tq, ts))


@pytest.mark.parametrize("T,A,M", [(757, 2560, 10240), (19, 48, 80), (3, 100, 37)])
def test_one_pass_swiglu_quant_equals_the_two_pass_kernel(T, A, M):
    """Same per-element arithmetic, the row held in registers: the same bytes and scales
    (the two-pass kernel divides with div_rn, the one-pass one with fp8_math.div_scale)."""
    g = torch.Generator(device=DEV).manual_seed(M + 7)
    attn = torch.randn(T, A, device=DEV, generator=g).to(torch.bfloat16)
    gu = (torch.randn(T, 2 * M, device=DEV, generator=g) * 2).to(torch.bfloat16)
    q1, s1 = act_quant.triton_swiglu_quant(attn, gu[:, :M], gu[:, M:])
    q2, s2 = act_quant.triton_swiglu_quant_row(attn, gu[:, :M], gu[:, M:])
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s1, s2)


@pytest.mark.parametrize("C,H,S,D,extra", [(9, 20, 600, 128, 0), (3, 3, 77, 16, 0),
                                            (1, 12, 300, 128, 84)])
def test_calibration_kernels_match_the_reference(C, H, S, D, extra):
    """Scales bit-identical (the amax is exact); codes as the reference's, the value store
    written transposed as production keeps it; outputs poisoned first; one head all zeros
    (its scale from the floor). With `extra`, k and v are the first S slots of a longer
    cache (LiveTalk's calibration reads the slots its first chunks wrote): the slots past
    them, poisoned, are not read."""
    g = torch.Generator(device=DEV).manual_seed(S)
    k = (torch.randn(C, H, S + extra, D, device=DEV, generator=g)
         * torch.rand(C, H, 1, 1, device=DEV, generator=g) * 5).to(torch.bfloat16)
    v = (torch.randn(C, H, S + extra, D, device=DEV, generator=g) * 3).to(torch.bfloat16)
    k[:, :, S:], v[:, :, S:] = float("nan"), float("nan")
    k, v = k[:, :, :S], v[:, :, :S]
    k[-1, 1] = 0
    outs = []
    for fn in (calibrate.reference, calibrate.triton_calibrate):
        k8 = torch.empty(C, H, S, D, dtype=fp8.FP8, device=DEV)
        k8.view(torch.uint8).fill_(NAN8)
        store = torch.empty(C, H, D, S + (-S % 16), dtype=fp8.FP8, device=DEV)
        store.view(torch.uint8).fill_(NAN8)
        scale = torch.full((C, 2, H, 1, 1), float("nan"), device=DEV)
        fn(k, v, k8, store[..., :S].transpose(-1, -2), scale, 1.5, 448.0)
        outs.append((k8, store, scale))
    (rk, rv, rs), (tk, tv, ts) = outs
    assert torch.equal(rs, ts)
    for r, t in ((rk, tk), (rv[..., :S], tv[..., :S])):
        d = codes(r, t)
        assert d.max() <= 1 and (d > 0).float().mean() < 1e-3
    assert (tv.view(torch.uint8)[..., S:] == NAN8).all()  # the padding is left alone


def assert_quantized_rows_close(ref, out):
    """Scales within one bf16 unit of the row's amax; each value within one e4m3 rounding
    (2^-4 relative) of the reference's, each side, plus the bf16 units that moved."""
    (rq, rs), (tq, ts) = ref, out
    assert ((ts - rs).abs() <= rs * 2.0 ** -7).all()
    r, t = fp8.dequantize(rq, rs), fp8.dequantize(tq, ts)
    assert ((t - r).abs() <= r.abs() * 2.0 ** -3 + rs * 448 * 2.0 ** -7).all()
    assert (tq.view(torch.uint8) == rq.view(torch.uint8)).float().mean() > 0.9


@pytest.mark.parametrize("T,A,M", [(757, 2560, 10240), (19, 48, 80)])
def test_swiglu_quant_matches_reference(T, A, M):
    g = torch.Generator(device=DEV).manual_seed(M)
    attn = (torch.randn(T, A, device=DEV, generator=g)).to(torch.bfloat16)
    gu = (torch.randn(T, 2 * M, device=DEV, generator=g) * 2).to(torch.bfloat16)
    assert_quantized_rows_close(act_quant.swiglu_reference(attn, gu[:, :M], gu[:, M:]),
                                act_quant.triton_swiglu_quant(attn, gu[:, :M], gu[:, M:]))


@pytest.mark.parametrize("M,N,K", [(757, 7680, 12800), (100, 304, 96)])
def test_triton_fp8_gemm_accumulates_as_cublaslt_does(M, N, K):
    """Hopper's FP8 tensor cores sum at reduced precision unless the partial sums are promoted
    to fp32: cuBLASLt promotes by default and not with fast accumulation, and the Triton
    kernel follows the same numerics switch. fp32 outputs, so the error is the accumulation's,
    against fp32 sums of the exact products: over a long sum (K = 12,800) the promoted ones
    are less than a tenth as far off as the unpromoted ones (the errors: docs/PERFORMANCE_LOG.md,
    "Fast accumulation")."""
    g = torch.Generator(device=DEV).manual_seed(N)
    aq, a_s = fp8.quantize_rows(torch.randn(M, K, device=DEV, generator=g))
    wq, ws = fp8.quantize_rows(torch.randn(N, K, device=DEV, generator=g))
    ws = ws[:, 0].contiguous()
    exact = (aq.float() @ wq.float().t()) * a_s * ws[None, :]
    err = {}
    for fast in (False, True):
        for lib, out in (("cublaslt", fp8.scaled_mm(aq, a_s, wq, ws, torch.float32, fast)),
                         ("triton", fp8_gemm.triton_scaled_mm(aq, a_s, wq, ws, torch.float32,
                                                              fast_accum=fast))):
            err[lib, fast] = float(rel_err(exact[None], out[None])[0])
    assert max(err.values()) < 1e-2, err  # and the shapes and masks are right
    for fast in (False, True):  # the same numerics (docs/PERFORMANCE_LOG.md, "Fast accumulation")
        assert err["triton", fast] <= 1.01 * err["cublaslt", fast] + 1e-7, err
    if K > 1024:
        for lib in ("cublaslt", "triton"):
            assert err[lib, False] < err[lib, True] / 10, err


@pytest.mark.parametrize("M,N,K", [(757, 7680, 12800), (37, 304, 96)])
@pytest.mark.parametrize("fast", [False, True])
def test_cublaslt_adds_the_residual_in_its_epilogue(M, N, K, fast):
    """h + (a * sa) (w * sw)^T rounded once, as the reference, with signed weight scales (the
    AdaLN gate folded in); the output buffer poisoned before the call. cuBLASLt and the
    reference's `_scaled_mm` sum in different orders, so a value may sit one bf16 unit off."""
    from charengine.plugins.cublaslt import Handle, Matmul

    g = torch.Generator(device=DEV).manual_seed(M + N)
    aq, a_s = fp8.quantize_rows(torch.randn(M, K, device=DEV, generator=g))
    wq, ws = fp8.quantize_rows(torch.randn(N, K, device=DEV, generator=g))
    gate = torch.randn(N, device=DEV, generator=g)
    ws = (ws[:, 0] * gate).contiguous()
    h = (torch.randn(M, N, device=DEV, generator=g) * 4).to(torch.bfloat16)
    handle = Handle(torch.device(DEV), gemm_residual.WORKSPACE_BYTES)
    for residual in (h, None):
        ref = gemm_residual.reference(aq, a_s, wq, ws, residual, torch.bfloat16, fast)
        mm = Matmul(handle, M, N, K, torch.bfloat16, fast, residual is not None)
        out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=DEV)
        mm(aq, a_s[:, 0].contiguous(), wq, ws, residual, out=out)
        diff = (out.float() - ref.float()).abs()
        assert not out.isnan().any()
        assert (diff <= 2.0 ** -7 * ref.float().abs() + 1e-6).all(), diff.max()
        assert (diff > 0).float().mean() < 0.05
    op = gemm_residual.LtGemmResidual(torch.device(DEV))
    assert torch.equal(op(aq, a_s, wq, ws, h, torch.bfloat16, fast),
                       Matmul(handle, M, N, K, torch.bfloat16, fast, True)(
                           aq, a_s[:, 0].contiguous(), wq, ws, h))
    with pytest.raises(ValueError, match="residual"):
        op(aq, a_s, wq, ws, h[:, :16].contiguous(), torch.bfloat16, fast)


def test_step_with_kernels_matches_the_plain_step():
    """A tiny model with head dim 64 (the attention kernel's smallest is 32), 60 steps through
    calibration and a reset: every kernel switch on against every one off."""
    from test_gpu import run

    spec = PRESETS["tiny-d64"]
    off = Switches(fused_pre_attention=False, fused_act_quant=False, fp8_attention_kernel=False,
                   fused_delta_rotation=False)
    kernels = run(preset("tiny").replace(model=spec), DEV)
    plain = run(preset("tiny").replace(model=spec, switches=off), DEV)
    assert rel_err(kernels, plain).max() < 2e-2


def test_step_with_the_triton_gemm_planned_matches_cublaslt():
    """An engine's GEMM plan may pick the Triton kernel per block linear: the step with it at
    both projections against the step with `_scaled_mm`."""
    from test_gpu import run

    cfg = preset("tiny").replace(model=PRESETS["tiny-d64"])
    planned = run(cfg, DEV, gemm_plan={"w_in": "triton", "w_out": "triton"})
    assert rel_err(planned, run(cfg, DEV)).max() < 2e-2


@pytest.mark.parametrize("M,N,K", [(757, 7680, 12800), (100, 304, 256)])
def test_quack_fp8_gemm_matches_cublaslt_fast_accumulation(M, N, K):
    """The CuTe DSL GEMM (plugins/quack_gemm.py; skipped where quack-kernels is not
    installed) with the rowwise scales in its epilogue: in bf16 outputs its error against
    exact sums equals cuBLASLt's with fast accumulation (bench_kernels' numbers:
    docs/PERFORMANCE_LOG.md, "A CuTe DSL GEMM: QuACK")."""
    pytest.importorskip("quack")
    from charengine.plugins import quack_gemm

    g = torch.Generator(device=DEV).manual_seed(N)
    aq, a_s = fp8.quantize_rows(torch.randn(M, K, device=DEV, generator=g))
    wq, ws = fp8.quantize_rows(torch.randn(N, K, device=DEV, generator=g))
    ws = ws[:, 0].contiguous()
    exact = (aq.float() @ wq.float().t()) * a_s * ws[None, :]
    lt = float(rel_err(exact[None], fp8.scaled_mm(aq, a_s, wq, ws, torch.bfloat16, True)[None])[0])
    for spec in ("128,256,2,1,0", "128,192,2,1,1"):
        out = quack_gemm.quack_scaled_mm(aq, a_s, wq, ws, torch.bfloat16, True,
                                         quack_gemm.QuackTiles.parse(spec))
        assert not out.isnan().any()
        assert float(rel_err(exact[None], out[None])[0]) <= 1.05 * lt + 1e-6


@pytest.mark.parametrize("M,S,F,K", [(757, 7680, 10240, 7680), (100, 0, 152, 256),
                                     (100, 192, 152, 256)])
def test_quack_swiglu_epilogue_matches_its_reference(M, S, F, K):
    """The input projection with SwiGLU in its epilogue (QuACK, skipped without it), the
    first S columns plain: against exact sums, its plain columns and silu(gate) * up err
    no more than the reference's with cuBLASLt's fast accumulation; its row maxima (from
    partials per N tile) equal the reference's to accumulation noise."""
    pytest.importorskip("quack")
    from charengine.plugins import quack_gemm

    g = torch.Generator(device=DEV).manual_seed(F + S)
    aq, a_s = fp8.quantize_rows(torch.randn(M, K, device=DEV, generator=g))
    wq, ws = fp8.quantize_rows(torch.randn(S + 2 * F, K, device=DEV, generator=g) * 0.05)
    ws = ws[:, 0].contiguous()
    wq[S:], ws[S:] = quack_gemm.interleave_gate_up(wq[S:]), quack_gemm.interleave_gate_up(ws[S:])
    exact = (aq.float() @ wq.float().t()) * a_s * ws[None, :]
    exact_y = torch.nn.functional.silu(exact[:, S::2]) * exact[:, S + 1::2]
    ref_d, ref_y, ref_amax = quack_gemm.swiglu_reference(aq, a_s, wq, ws, torch.bfloat16, True,
                                                         S)
    for spec in ("128,192,2,1,1", "128,64,2,1,0"):
        torch.empty(M * (S + F) * 8, dtype=torch.uint8, device=DEV).fill_(0xFF)  # poison
        d, y, amax = quack_gemm.quack_swiglu_mm(aq, a_s, wq, ws, torch.bfloat16, True, S,
                                                quack_gemm.QuackTiles.parse(spec))
        assert y.shape == (M, F) and not y.isnan().any() and not amax.isnan().any()
        assert float(rel_err(exact_y[None], y[None])[0]) <= \
            1.05 * float(rel_err(exact_y[None], ref_y[None])[0]) + 1e-6
        if S:
            assert d.shape == (M, S) and float(rel_err(exact[None, :, :S], d[None])[0]) <= \
                1.05 * float(rel_err(exact[None, :, :S], ref_d[None])[0]) + 1e-6
        assert ((amax.amax(1, keepdim=True) - ref_amax).abs() <= ref_amax * 1e-3).all()


@pytest.mark.parametrize("M,N,K", [(757, 7680, 12800), (37, 304, 96)])
def test_quack_residual_epilogue_matches_cublaslt(M, N, K):
    """The output projection with the residual as QuACK's C input (skipped without quack):
    its error against the exact sum plus h is that of cuBLASLt's same epilogue; the output
    buffer's memory poisoned first."""
    pytest.importorskip("quack")
    from charengine.plugins import quack_gemm

    g = torch.Generator(device=DEV).manual_seed(N + 1)
    aq, a_s = fp8.quantize_rows(torch.randn(M, K, device=DEV, generator=g))
    wq, ws = fp8.quantize_rows(torch.randn(N, K, device=DEV, generator=g) * 0.05)
    ws = ws[:, 0].contiguous()
    h = (torch.randn(M, N, device=DEV, generator=g) * 4).to(torch.bfloat16)
    exact = (aq.float() @ wq.float().t()) * a_s * ws[None, :] + h.float()
    lt = gemm.select("scaled_mm", "residual", DEV)(aq, a_s, wq, ws, h, torch.bfloat16, True)
    torch.empty(M * N * 4, dtype=torch.uint8, device=DEV).fill_(0xFF)  # poison the pool
    out = quack_gemm.quack_scaled_mm_residual(aq, a_s, wq, ws, h, torch.bfloat16, True,
                                              quack_gemm.QuackTiles.parse("128,192,2,1,1"))
    assert float(rel_err(exact[None], out[None])[0]) <= \
        1.05 * float(rel_err(exact[None], lt[None])[0]) + 1e-6


@pytest.mark.parametrize("T,A,F", [(757, 2560, 10240), (19, 48, 80), (3, 100, 37)])
@pytest.mark.parametrize("attn_amax", [True, False])
@pytest.mark.parametrize("chunk", [2048, 64])
def test_concat_quant_with_given_maxima_equals_quantize_rows(T, A, F, attn_amax, chunk):
    """Given true maxima (y's before rounding, as partials; attn's per head or none), the
    kernel gives quantize_rows([attn, y])'s bytes and scales: no row reduction of its own."""
    g = torch.Generator(device=DEV).manual_seed(F + A)
    attn = torch.randn(T, A, device=DEV, generator=g).to(torch.bfloat16)
    y32 = torch.randn(T, F, device=DEV, generator=g) * 3
    y = y32.to(torch.bfloat16)
    y_amax = torch.stack([c.abs().amax(1) for c in y32.split(16, dim=1)], dim=1)
    a_amax = torch.stack([c.float().abs().amax(1) for c in attn.split(16, dim=1)]).t() \
        if attn_amax else None  # [P, T] seen as [T, P], as the attention kernel's
    rq, rs = fp8.quantize_rows(torch.cat([attn, y], -1))
    torch.empty(T * (A + F) * 4, dtype=torch.uint8, device=DEV).fill_(NAN8)
    q, s = act_quant.triton_concat_quant(attn, a_amax, y, y_amax, chunk=chunk)
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    cq, cs = act_quant.concat_quant_reference(attn, a_amax, y, y_amax)
    assert torch.equal(cs, rs) and torch.equal(cq.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.parametrize("tma", [True, False])
def test_fp8_attention_gives_the_exact_row_maxima_of_its_output(tma):
    """With `amax`, each (token, head)'s max |output| as stored; the output unchanged."""
    H, T, S, D = 5, 77, 300, 64
    g = torch.Generator(device=DEV).manual_seed(3)
    q8, qs = fp8.quantize_rows(torch.randn(H, T, D, device=DEV, generator=g))
    k8, v8 = fp8_tensor((H, S, D), g), fp8_tensor((H, S, D), g)
    ks = torch.full((H, 1, 1), 0.02, device=DEV)
    tiles = attention.AttentionTiles(tma=tma)
    plain = attention.triton_attention(q8, qs, k8, v8, ks, ks, torch.bfloat16, tiles)
    amax = torch.full((H, T), float("nan"), device=DEV)
    out = attention.triton_attention(q8, qs, k8, v8, ks, ks, torch.bfloat16, tiles, amax=amax)
    assert torch.equal(out, plain)
    assert torch.equal(amax.t(), out.float().abs().reshape(T, H, D).amax(-1))


@pytest.mark.parametrize("M,N,K", [(3072, 8960, 1536), (3072, 1536, 8960), (37, 304, 96)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_cublaslt_gemm_without_workspace_matches_scaled_mm(M, N, K, with_bias):
    """cuBLASLt called directly with no workspace (the `cublaslt` choice), its bias in the
    epilogue or none: as close to the exact product (plus bias) as `torch._scaled_mm`'s
    same epilogue, the output's memory poisoned first."""
    g = torch.Generator(device=DEV).manual_seed(N + K)
    aq, a_s = fp8.quantize_rows(torch.randn(M, K, device=DEV, generator=g))
    wq, ws = fp8.quantize_rows(torch.randn(N, K, device=DEV, generator=g) * 0.05)
    ws = ws[:, 0].contiguous()
    b = (torch.randn(N, device=DEV, generator=g) * 2).to(torch.bfloat16) if with_bias else None
    exact = (aq.float() @ wq.float().t()) * a_s * ws[None, :] + (0 if b is None else b.float())
    lt = gemm.select("cublaslt", "plain", DEV)
    assert gemm.takes_bias(lt)
    ref = fp8.scaled_mm(aq, a_s, wq, ws, torch.bfloat16, True, bias=b)
    torch.empty(M * N * 4, dtype=torch.uint8, device=DEV).fill_(0xFF)  # poison the pool
    out = lt(aq, a_s, wq, ws, torch.bfloat16, True, bias=b)
    assert float(rel_err(exact[None], out[None])[0]) <= \
        1.05 * float(rel_err(exact[None], ref[None])[0]) + 1e-6


def test_the_gemm_timing_covers_both_choices():
    g = torch.Generator(device=DEV).manual_seed(0)
    weights = [(fp8_tensor((512, 1024), g), torch.rand(512, device=DEV, generator=g) + 0.5)
               for _ in range(4)]
    choices = gemm.candidates("plain", quack=False)
    times = gemm.time_choices(weights, 757, torch.bfloat16, False, choices, reps=2)
    assert set(times) == set(choices) == {"scaled_mm", "cublaslt", "triton"}
    assert all(t > 0 for t in times.values()) and gemm.choose(times) in choices


def test_pre_attention_writes_a_transposed_value_store():
    """The production value store is [H, D, S] (slots padded to 16); the kernel writes it
    transposed, the same bytes as a row store."""
    g = torch.Generator(device=DEV).manual_seed(5)
    H, T, D, S = 4, 77, 128, 300
    y = (torch.randn(T, 3 * H * D, device=DEV, generator=g) * 3).to(torch.bfloat16)
    q, k, v = (t.reshape(T, H, D).transpose(0, 1) for t in y.split(H * D, -1))
    qn = kn = torch.ones(D, dtype=torch.bfloat16, device=DEV)
    cos, sin = cos_sin(torch.rand(T, D // 2, device=DEV, generator=g))
    idx = 100 + torch.arange(T, device=DEV)
    ks = vs = torch.full((H, 1, 1), 0.01, device=DEV)
    rows = torch.zeros(H, S, D, dtype=fp8.FP8, device=DEV)
    store = torch.zeros(H, D, S + (-S % 16), dtype=fp8.FP8, device=DEV)
    store.view(torch.uint8).fill_(NAN8)
    vt = store[..., :S].transpose(1, 2)
    k8 = [torch.zeros(H, S, D, dtype=fp8.FP8, device=DEV) for _ in range(2)]
    pre_attention.triton_pre_attention(q, k, v, qn, kn, 1e-6, cos, sin, k8[0], rows, ks, vs, idx)
    pre_attention.triton_pre_attention(q, k, v, qn, kn, 1e-6, cos, sin, k8[1], vt, ks, vs, idx)
    assert torch.equal(vt[:, idx].view(torch.uint8), rows[:, idx].view(torch.uint8))
    assert (vt[:, :100].view(torch.uint8) == NAN8).all()
    assert (vt[:, 100 + T:].view(torch.uint8) == NAN8).all()


@pytest.mark.parametrize("H,T,S,D", [(12, 3072, 15360, 128), (12, 3072, 15300, 128),
                                     (5, 200, 333, 32), (3, 37, 150, 64)])
@pytest.mark.parametrize("fma", [True, False])
def test_split_attention_matches_the_whole_tiles(H, T, S, D, fma):
    """The split grid (SPLIT_TILES: the last round's tiles in key ranges, merged) against the
    reference within the FP8 bound, and as close to it as one program per tile; its planned
    split actually taken at LiveTalk's shape (a ragged key count too)."""
    g = torch.Generator(device=DEV).manual_seed(H + S)
    q8, qs = fp8.quantize_rows(torch.randn(H, T, D, device=DEV, generator=g))
    k8 = fp8_tensor((H, S, D), g)
    store = torch.zeros(H, D, S + (-S % 16), dtype=fp8.FP8, device=DEV)  # rows 16-byte aligned
    store[..., :S] = fp8_tensor((H, D, S), g)
    vt = store[..., :S].transpose(1, 2)  # the cache's value store, [H, D, S] in memory
    ks = torch.rand(H, 1, 1, device=DEV, generator=g) * 0.02 + 0.01
    vs = torch.rand(H, 1, 1, device=DEV, generator=g) * 0.02 + 0.01
    tiles = dataclasses.replace(attention.SPLIT_TILES, fma=fma)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    tile_count = -(-T // tiles.block_m) * H
    plan = attention.split_plan(tile_count, -(-S // tiles.block_n), tiles.split_ctas_per_sm * sms)
    if T == 3072 and sms == H200_SMS:  # LiveTalk's shape on its GPU: whole and split programs
        assert plan == (528, 5)
    ref = attention.reference(q8, qs, k8, vt, ks, vs, torch.float32)
    out = torch.full((T, H * D), float("nan"), dtype=torch.bfloat16, device=DEV)
    attention.triton_attention(q8, qs, k8, vt, ks, vs, torch.bfloat16, tiles, out=out)
    whole = attention.triton_attention(q8, qs, k8, vt, ks, vs, torch.bfloat16,
                                       attention.AttentionTiles(fma=fma))
    vmax = (vt.float().abs().amax(dim=(1, 2)) * vs.flatten()).max()
    assert not out.isnan().any()
    assert (out.float() - ref).abs().max() <= 2.0 ** -4 * vmax
    dist = [float((o.float() - ref).norm() / ref.norm()) for o in (out, whole)]
    assert dist[0] <= 1.05 * dist[1], dist


@pytest.mark.parametrize("H,T,S,D,cap,split", [(12, 3072, 15360, 128, 15360, 2),
                                               (12, 3072, 14464, 128, 15392, 2),
                                               (4, 130, 1280, 128, 1280, 2),
                                               (3, 77, 512, 64, 528, 0),
                                               (2, 64, 256, 128, 272, 0),
                                               (2, 64, 384, 128, 384, 0)])
@pytest.mark.parametrize("block_n,stages", [(128, 3), (64, 6)])
def test_pipelined_attention_matches_the_tma_kernel(H, T, S, D, cap, split, block_n, stages):
    """The Gluon kernel (AttentionTiles.pipelined: the next key tile's scores during this
    tile's softmax) against the reference within the FP8 bound and as close to it as the
    Triton kernel, over keys in a larger ring (cap slots a head, NaN past S: a read beyond the
    keys shows), ragged query tiles, key ranges of odd and even length (the split grid), and
    one, two, three and four key tiles a program (the loop's tails, a ring's worth)."""
    g = torch.Generator(device=DEV).manual_seed(T + S)
    q8, qs = fp8.quantize_rows(torch.randn(H, T, D, device=DEV, generator=g))
    ring = fp8_tensor((H, cap, D), g)
    ring.view(torch.uint8)[:, S:] = NAN8
    k8 = ring[:, :S]
    store = fp8_tensor((H, D, cap + (-cap % 16)), g)
    store.view(torch.uint8)[..., S:] = NAN8
    vt = store[..., :S].transpose(1, 2)
    ks = torch.rand(H, 1, 1, device=DEV, generator=g) * 0.02 + 0.01
    vs = torch.rand(H, 1, 1, device=DEV, generator=g) * 0.02 + 0.01
    tiles = attention.AttentionTiles(64, block_n, 4, stages, split_ctas_per_sm=split,
                                     pipelined=True)
    assert attention.pipelined_fits(q8, k8, vt, tiles)
    ref = attention.reference(q8, qs, k8, vt, ks, vs, torch.float32)
    out = torch.full((T, H * D), float("nan"), dtype=torch.bfloat16, device=DEV)
    attention.triton_attention(q8, qs, k8, vt, ks, vs, torch.bfloat16, tiles, out=out)
    tma = attention.triton_attention(q8, qs, k8, vt, ks, vs, torch.bfloat16,
                                     dataclasses.replace(tiles, pipelined=False))
    vmax = (vt.float().abs().amax(dim=(1, 2)) * vs.flatten()).max()
    assert not out.isnan().any()
    assert (out.float() - ref).abs().max() <= 2.0 ** -4 * vmax
    dist = [float((o.float() - ref).norm() / ref.norm()) for o in (out, tma)]
    assert dist[0] <= 1.05 * dist[1], dist


def test_pipelined_attention_falls_back_where_it_does_not_fit():
    """Keys that end inside a tile go to the Triton kernel (the same result as without the
    switch); fewer than three stages (the ring would wait forever) and no keys are refused."""
    g = torch.Generator(device=DEV).manual_seed(2)
    H, T, S, D = 2, 64, 200, 64
    q8, qs = fp8.quantize_rows(torch.randn(H, T, D, device=DEV, generator=g))
    k8, v8 = fp8_tensor((H, S, D), g), fp8_tensor((H, S, D), g)
    ks = vs = torch.full((H, 1, 1), 0.02, device=DEV)
    tiles = attention.AttentionTiles(pipelined=True)
    assert not attention.pipelined_fits(q8, k8, v8, tiles)
    whole = fp8_tensor((H, 256, D), g)
    vt = fp8_tensor((H, D, 256), g).transpose(1, 2)
    assert attention.pipelined_fits(q8, whole, vt, tiles)
    assert not attention.pipelined_fits(q8, whole, vt, dataclasses.replace(tiles, stages=2))
    assert not attention.pipelined_fits(q8, whole[:, :0], vt[:, :0], tiles)
    a = attention.triton_attention(q8, qs, k8, v8, ks, vs, torch.bfloat16, tiles)
    b = attention.triton_attention(q8, qs, k8, v8, ks, vs, torch.bfloat16,
                                   attention.AttentionTiles())
    assert torch.equal(a, b)
