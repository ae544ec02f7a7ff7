"""LiveTalk's fused epilogue kernels against their references on the GPU, at the released
model's shapes (3,072 tokens, width 1,536, FFN 8,960) and small odd ones: the gated residual
inside the cross-attention's layer norm and inside the next block's AdaLN (with a frame's
audio row), GELU with its quantization, the q RMS norm across heads, and the VAE's channel
RMS norm with its SiLU (both layouts). Outputs are
poisoned first. (Triton's CPU interpreter rounds e4m3 and bf16 unlike the hardware, so these
run only on a GPU.)"""

import pytest
import torch

from charengine import fp8
from charengine.plugins import act_quant, channel_norm, rms_norm

pytest.importorskip("triton")
pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def rows(g, T, d, spread=4.0):
    return (torch.randn(T, d, device=DEV, generator=g) * spread + 1).to(torch.bfloat16)


def vec(g, d, around=0.0):
    return (torch.randn(d, device=DEV, generator=g) * 0.3 + around).to(torch.bfloat16)


def assert_quantized_rows_close(ref, out):
    """Scales within one bf16 unit of the row's amax; each value within one e4m3 rounding
    of the reference's plus the bf16 units that moved; nine in ten codes equal."""
    (rq, rs), (tq, ts) = ref, out
    assert ((ts - rs).abs() <= rs * 2.0 ** -7).all()
    r, t = fp8.dequantize(rq, rs), fp8.dequantize(tq, ts)
    assert ((t - r).abs() <= r.abs() * 2.0 ** -3 + rs * 448 * 2.0 ** -7).all()
    assert (tq.view(torch.uint8) == rq.view(torch.uint8)).float().mean() > 0.9


def assert_new_h_close(ref, out):
    """The stored residual stream within one bf16 rounding of the reference's."""
    assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2.0 ** -8).all()
    assert (out == ref).float().mean() > 0.99


@pytest.mark.parametrize("T,d", [(3072, 1536), (31, 100)])
def test_residual_layer_norm_quant_matches_reference(T, d):
    g = torch.Generator(device=DEV).manual_seed(T + d)
    h, o = rows(g, T, d), rows(g, T, d)
    gate, weight, bias = vec(g, d), vec(g, d, 1.0), vec(g, d)
    rq, rs, rh = act_quant.residual_layer_norm_reference(h, o, gate, weight, bias, 1e-6)
    h_before = h.clone()
    tq, ts, th = act_quant.triton_residual_layer_norm_quant(h, o, gate, weight, bias, 1e-6)
    assert torch.equal(h, h_before)
    assert_new_h_close(rh, th)
    assert_quantized_rows_close((rq, rs), (tq, ts))


@pytest.mark.parametrize("T,F,d", [(3072, 3, 1536), (30, 3, 100)])
def test_residual_add_norm_modulate_quant_matches_reference(T, F, d):
    g = torch.Generator(device=DEV).manual_seed(T + F + d)
    h, o, add = rows(g, T, d), rows(g, T, d), rows(g, F, d, 1.0)
    gate, shift, scale = vec(g, d), vec(g, d), vec(g, d)
    rq, rs, rh = act_quant.residual_add_norm_modulate_reference(h, o, gate, add, shift, scale,
                                                                1e-6)
    tq, ts, th = act_quant.triton_residual_add_norm_modulate_quant(h, o, gate, add, shift,
                                                                   scale, 1e-6)
    assert_new_h_close(rh, th)
    assert_quantized_rows_close((rq, rs), (tq, ts))


def test_residual_add_refuses_rows_that_do_not_divide():
    h = torch.zeros(10, 64, device=DEV, dtype=torch.bfloat16)
    v = torch.zeros(64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do not divide"):
        act_quant.triton_residual_add_norm_modulate_quant(h, h, v, h[:3], v, v, 1e-6)


@pytest.mark.parametrize("T,K", [(3072, 8960), (19, 200), (5, 64)])
def test_gelu_quant_matches_reference(T, K):
    g = torch.Generator(device=DEV).manual_seed(K)
    x = rows(g, T, K, 3.0)
    x[0, :7] = torch.tensor([-30.0, -8.0, -1e-3, 0.0, 1e-3, 8.0, 30.0])  # tails and zero
    ref = act_quant.gelu_quant_reference(x)
    assert_quantized_rows_close(ref, act_quant.triton_gelu_quant(x))
    op = torch.ops.charengine.gelu_quant.default(x)  # the registered op runs the kernel
    assert_quantized_rows_close(ref, op)


@pytest.mark.parametrize("T,d", [(3072, 1536), (17, 100)])
def test_rms_norm_width_matches_reference(T, d):
    g = torch.Generator(device=DEV).manual_seed(d)
    x, w = rows(g, T, d), vec(g, d, 1.0)
    ref = rms_norm.reference(x, w, 1e-6)
    out = rms_norm.triton_rms_norm_width(x, w, 1e-6)
    assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2.0 ** -7).all()
    assert (out == ref).float().mean() > 0.99


@pytest.mark.parametrize("T,H,D", [(3072, 12, 128), (17, 3, 32)])
def test_rms_norm_heads_quant_matches_reference(T, H, D):
    """The cross-attention's q norm with each head quantized apart, head-major (the FP8
    cross-attention's queries), against the reference; 12 heads pad to 16 lanes of heads,
    3 to 4."""
    g = torch.Generator(device=DEV).manual_seed(T + H)
    x, w = rows(g, T, H * D), vec(g, H * D, 1.0)
    rq, rs = rms_norm.heads_quant_reference(x, w, 1e-6, H)
    tq, ts = rms_norm.triton_rms_norm_heads_quant(x, w, 1e-6, H)
    assert tq.shape == (H, T, D) and ts.shape == (H, T, 1) and tq.is_contiguous()
    assert_quantized_rows_close((rq, rs), (tq, ts))
    op = torch.ops.charengine.rms_norm_heads_quant.default(x, w, 1e-6, H)
    assert_quantized_rows_close((rq, rs), op)


@pytest.mark.parametrize("shape,layout", [((1, 96, 4, 64, 64), "contiguous"),
                                          ((1, 384, 1, 16, 16), "contiguous"),
                                          ((2, 37, 3, 5, 7), "contiguous"),
                                          ((1, 192, 4, 32, 32), "frames"),
                                          ((1, 37, 3, 5, 7), "frames")])
@pytest.mark.parametrize("silu", [True, False])
def test_channel_norm_matches_reference(shape, layout, silu):
    """The kernel computes in fp32 and rounds once; the reference rounds after each of its
    ops in bf16: within two bf16 units of the output's size. The output keeps the input's
    layout; poisoned outputs would show (empty_like is not zeroed)."""
    g = torch.Generator(device=DEV).manual_seed(shape[1])
    x = (torch.randn(shape, device=DEV, generator=g) * 3 + 0.5).to(torch.bfloat16)
    if layout == "frames":
        x = x.contiguous(memory_format=torch.channels_last_3d)
    gain = (torch.randn(shape[1], 1, 1, 1, device=DEV, generator=g) * 0.3 + 1).to(torch.bfloat16)
    want = channel_norm.reference(x.float(), gain.float(), silu)
    got = channel_norm.triton_channel_norm(x, gain, silu)
    assert got.stride() == x.stride() and got.dtype == x.dtype
    assert ((got.float() - want).abs() <= want.abs() * 2.0 ** -7 + 2.0 ** -8).all()
    plain = channel_norm.reference(x, gain, silu)  # the bf16 path the kernel replaces
    assert (got.float() - want).abs().mean() <= (plain.float() - want).abs().mean()


@pytest.mark.parametrize("frames,n,C,H,W", [(4, 2, 96, 64, 64), (1, 2, 384, 16, 16),
                                            (2, 2, 192, 8, 8), (3, 2, 37, 5, 7), (2, 0, 40, 3, 3)])
@pytest.mark.parametrize("bias", [True, False])
def test_channel_norm_taps_matches_reference(frames, n, C, H, W, bias):
    """The taps kernel against ops.channel_norm_taps in fp32: every tap slot (the past
    frames' slots copied, the new frames' written by the kernel, into memory that held other
    tensors: a slot left unwritten would show) and the past left behind, within two bf16
    units; consecutive calls carry the past as the reference does."""
    g = torch.Generator(device=DEV).manual_seed(C + frames)
    gain = (torch.randn(C, 1, 1, 1, device=DEV, generator=g) * 0.3 + 1).to(torch.bfloat16)
    b = (torch.randn(C, device=DEV, generator=g)).to(torch.bfloat16) if bias else None
    past = (torch.randn(n, H, W, C, device=DEV, generator=g)).to(torch.bfloat16)
    want_past = past.float()
    for call in range(3):
        x = (torch.randn(frames, H, W, C, device=DEV, generator=g) * 3 + 0.5).to(torch.bfloat16)
        want = channel_norm.taps_reference(x.float(), gain.float(),
                                           None if b is None else b.float(), want_past, True)
        got = channel_norm.triton_channel_norm_taps(x, gain, b, past, True)
        assert got.shape == (frames, H, W, (n + 1) * C) and got.dtype == torch.bfloat16
        assert ((got.float() - want).abs() <= want.abs() * 2.0 ** -7 + 2.0 ** -8).all(), call
        assert ((past.float() - want_past).abs() <= want_past.abs() * 2.0 ** -7 + 2.0 ** -8).all()


@pytest.mark.parametrize("shape", [(4, 256, 256, 192), (2, 128, 128, 384), (3, 5, 7, 37)])
def test_nearest2x_rows_matches_reference(shape):
    """The resize kernel writes exactly PyTorch's nearest resize (copies, no arithmetic),
    every output pixel (the output is allocated over memory that held other values)."""
    from charengine.plugins import pixel_rows

    g = torch.Generator(device=DEV).manual_seed(shape[-1])
    x = torch.randn(shape, device=DEV, generator=g).to(torch.bfloat16)
    poison = torch.full((4 * x.numel(),), float("nan"), device=DEV, dtype=torch.bfloat16)
    del poison  # its memory goes to the output
    assert torch.equal(pixel_rows.triton_nearest2x_rows(x), pixel_rows.nearest2x_reference(x))


@pytest.mark.parametrize("shape", [(4, 512, 512, 96), (1, 64, 64, 384), (3, 5, 7, 37)])
def test_bias_residual_rows_matches_reference(shape):
    """The block-end kernel sums in fp32 and rounds once: within one bf16 unit of the sum in
    fp32, and no farther from it than the reference's two bf16 roundings."""
    from charengine.plugins import pixel_rows

    g = torch.Generator(device=DEV).manual_seed(shape[-1])
    h, x = (torch.randn(shape, device=DEV, generator=g).to(torch.bfloat16) for _ in range(2))
    b = torch.randn(shape[-1], device=DEV, generator=g).to(torch.bfloat16)
    want = pixel_rows.bias_residual_reference(h.float(), b.float(), x.float())
    got = pixel_rows.triton_bias_residual_rows(h, b, x)
    assert ((got.float() - want).abs() <= want.abs() * 2.0 ** -8 + 2.0 ** -24).all()
    plain = pixel_rows.bias_residual_reference(h, b, x)
    assert (got.float() - want).abs().mean() <= (plain.float() - want).abs().mean()
