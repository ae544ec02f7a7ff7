"""The plugin kernels as torch ops (each registered by its module through plugins/registry.py): torch's own op checks
(schema and declared mutations, fake kernels against real outputs, dispatch) on real inputs,
on CPU (the references) and, on a GPU, CUDA (the Triton kernels)."""

import pytest
import torch
from torch.library import opcheck

OPS = torch.ops.charengine

from charengine import fp8
from charengine.plugins import act_quant, attention, calibrate, delta_rotation, fp8_gemm, \
    gemm, pre_attention  # noqa: F401  (each registers its torch.ops.charengine op)
from charengine.rope import cos_sin

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def gen(device, seed):
    return torch.Generator(device=device).manual_seed(seed)


def rnd(*shape, device, g, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, device=device, generator=g) * scale).to(dtype)


def pre_attention_args(device, quantize_q, H=2, T=9, D=32, S=40):
    g = gen(device, 1)
    y = rnd(T, 3 * H * D, device=device, g=g, scale=3)
    q, k, v = (t.reshape(T, H, D).transpose(0, 1) for t in y.split(H * D, -1))
    norm = (torch.rand(D, device=device, generator=g) + 0.5).to(torch.bfloat16)
    cos, sin = cos_sin(torch.rand(T, D // 2, device=device, generator=g))
    stores = [torch.zeros(H, S, D, dtype=fp8.FP8, device=device) for _ in range(2)]
    scale = torch.full((H, 1, 1), 0.02, device=device)
    idx = 7 + torch.arange(T, device=device)
    return (q, k, v, norm, norm, 1e-6, cos, sin, *stores, scale, scale, idx, quantize_q)


@pytest.mark.parametrize("device", DEVICES)
def test_every_op_passes_torchs_op_checks(device):
    g = gen(device, 0)
    h, o = rnd(5, 64, device=device, g=g), rnd(5, 64, device=device, g=g)
    vec = rnd(64, device=device, g=g, scale=0.2)
    checks = [
        (OPS.act_quant.default, (h,)),
        (OPS.norm_modulate_quant.default, (h, vec, vec, 1e-6)),
        (OPS.residual_norm_modulate_quant.default, (h, o, vec, vec, vec, 1e-6)),
        (OPS.swiglu_quant.default, (h[:, :16], h[:, 16:40], h[:, 40:])),
        (OPS.pre_attention.default, pre_attention_args(device, True)),
        (OPS.pre_attention.default, pre_attention_args(device, False)),
    ]
    q8, qs = fp8.quantize_rows(rnd(2, 9, 32, device=device, g=g))
    k8 = fp8.quantize(rnd(2, 40, 32, device=device, g=g), 0.01)
    sc = torch.full((2, 1, 1), 0.01, device=device)
    for tiles in (attention.AttentionTiles(), attention.AttentionTiles(fma=False)):
        checks.append((OPS.fp8_attention.default,
                       (q8, qs, k8, k8, sc, sc, torch.bfloat16, tiles.spec())))
    cache = fp8.quantize(rnd(3, 2, 40, 32, device=device, g=g, scale=3), 0.05)
    omega = torch.rand(4, device=device, generator=g)
    checks.append((OPS.delta_rotation.default,
                   (cache, torch.full((3, 2, 1, 1), 0.05, device=device), 10, omega, -42.0)))
    a8, a_s = fp8.quantize_rows(rnd(9, 64, device=device, g=g))
    w8, w_s = fp8.quantize_rows(rnd(48, 64, device=device, g=g))
    for fast, tiles in ((False, fp8_gemm.GemmTiles()), (True, fp8_gemm.GemmTiles(promote_k=64))):
        checks.append((OPS.fp8_gemm.default, (a8, a_s, w8, w_s.reshape(-1), torch.bfloat16,
                                               fast, tiles.spec())))
    kv = [rnd(3, 2, 40, 32, device=device, g=g, scale=3) for _ in range(2)]
    stores = [torch.zeros(3, 2, 40, 32, dtype=fp8.FP8, device=device),
              torch.zeros(3, 2, 32, 48, dtype=fp8.FP8, device=device)[..., :40].transpose(-1, -2)]
    checks.append((OPS.calibrate_cache.default,
                   (*kv, *stores, torch.ones(3, 2, 2, 1, 1, device=device), 1.5, 448.0)))
    for op, args in checks:
        # torch's schema check compares inputs before and after with allclose, which has no
        # FP8 kernel: ops with FP8 tensors skip it, and the declared writes are checked below
        fp8_args = any(isinstance(a, torch.Tensor) and a.dtype == fp8.FP8 for a in args)
        utils = [u for u in ("test_schema", "test_autograd_registration", "test_faketensor",
                             "test_aot_dispatch_dynamic") if not (fp8_args and u == "test_schema")]
        result = opcheck(op, args, test_utils=utils)
        assert set(result.values()) == {"SUCCESS"}, (op, result)


def test_the_ops_declare_exactly_the_tensors_they_write():
    writes = {name: {a.name for a in getattr(OPS, name).default._schema.arguments
                     if a.alias_info is not None and a.alias_info.is_write}
              for name in ("act_quant", "norm_modulate_quant", "residual_norm_modulate_quant",
                           "swiglu_quant", "pre_attention", "fp8_attention", "delta_rotation",
                           "fp8_gemm", "calibrate_cache")}
    assert writes == {"act_quant": set(), "norm_modulate_quant": set(),
                      "residual_norm_modulate_quant": set(), "swiglu_quant": set(),
                      "pre_attention": {"k_store", "v_store"}, "fp8_attention": set(),
                      "delta_rotation": {"k8"}, "fp8_gemm": set(),
                      "calibrate_cache": {"k8", "v8", "scale"}}


def test_on_cpu_the_ops_are_the_references():
    """The switch picks the op once; on CPU tensors the op runs the plain reference."""
    args = pre_attention_args("cpu", True)
    ref_stores = [t.clone() for t in args[8:10]]
    ref = pre_attention.reference(*args[:8], *ref_stores, *args[10:])
    out = pre_attention.select()(*args)
    assert all(torch.equal(a.view(torch.uint8) if a.dtype == fp8.FP8 else a,
                           b.view(torch.uint8) if b.dtype == fp8.FP8 else b)
               for a, b in zip((*ref, *ref_stores), (*out, *args[8:10])))
    assert args[8].view(torch.uint8).any()  # the op wrote the store it was given
    g = gen("cpu", 3)
    h = rnd(6, 64, device="cpu", g=g)
    vec = rnd(64, device="cpu", g=g, scale=0.2)
    ops = act_quant.select()
    for a, b in zip(ops.norm_modulate(h, vec, vec, 1e-6),
                    act_quant.norm_modulate_reference(h, vec, vec, 1e-6)):
        assert torch.equal(a.view(torch.uint8) if a.dtype == fp8.FP8 else a,
                           b.view(torch.uint8) if b.dtype == fp8.FP8 else b)
    cache = fp8.quantize(rnd(2, 2, 20, 32, device="cpu", g=g, scale=3), 0.05)
    twin, omega = cache.clone(), torch.rand(4, generator=g)
    sc = torch.full((2, 2, 1, 1), 0.05)
    delta_rotation.select()(cache, sc, 5, omega, 3.0)
    delta_rotation.reference(twin, sc, 5, omega, 3.0)
    assert torch.equal(cache.view(torch.uint8), twin.view(torch.uint8))
    assert not torch.equal(cache.view(torch.uint8)[:, :, 5:], fp8.quantize(
        rnd(2, 2, 20, 32, device="cpu", g=gen("cpu", 3), scale=3), 0.05).view(torch.uint8)[:, :, 5:])
    a8, a_s = fp8.quantize_rows(rnd(9, 64, device="cpu", g=g))
    w8, w_s = fp8.quantize_rows(rnd(48, 64, device="cpu", g=g))
    assert torch.equal(gemm.select("triton")(a8, a_s, w8, w_s.reshape(-1), torch.bfloat16),
                       fp8_gemm.reference(a8, a_s, w8, w_s.reshape(-1), torch.bfloat16))


def test_the_quack_gemm_choice_reads_its_tiles_and_says_what_it_needs():
    """quack:<tiles> reads back; where quack-kernels is missing, choosing it fails at model
    build with a line naming the package; on CPU tensors the GEMM is the reference."""
    from charengine.plugins import quack_gemm

    t = quack_gemm.QuackTiles(256, 192, 1, 2, True)
    assert quack_gemm.QuackTiles.parse(t.spec()) == t
    with pytest.raises(ValueError, match="pingpong"):
        quack_gemm.QuackTiles.parse("128,256,2,1")
    if not quack_gemm.available():
        with pytest.raises(ValueError, match="quack-kernels"):
            gemm.select("quack:128,256,2,1,0")
    g = gen("cpu", 5)
    a8, a_s = fp8.quantize_rows(rnd(9, 64, device="cpu", g=g))
    w8, w_s = fp8.quantize_rows(rnd(48, 64, device="cpu", g=g))
    assert torch.equal(quack_gemm.quack_scaled_mm(a8, a_s, w8, w_s.reshape(-1), torch.bfloat16),
                       fp8_gemm.reference(a8, a_s, w8, w_s.reshape(-1), torch.bfloat16))


def test_attention_tiles_read_back_from_their_spec():
    """The op carries its tiles as text: every field survives the round trip, and specs
    written before the optional fields existed still read."""
    for t in (attention.AttentionTiles(), attention.AttentionTiles(128, 64, 8, 2, False, False),
              attention.AttentionTiles(fma=False), attention.SPLIT_TILES,
              attention.AttentionTiles(split_ctas_per_sm=3)):
        assert attention.AttentionTiles.parse(t.spec()) == t
    old = attention.AttentionTiles.parse("64,128,4,3,fp8")
    assert old == attention.AttentionTiles(tma=False, fma=False) and not old.fma


def test_the_split_plan_fills_the_last_round():
    """LiveTalk's 576 tiles over 264 slots: two rounds whole, the other 48 in five key
    ranges (240 programs in the third round); tiles that fill their rounds, or leave too few
    slots to split into, run whole."""
    assert attention.split_plan(576, 120, 264) == (528, 5)
    assert attention.split_plan(576, 120, 396) == (396, 2)
    assert attention.split_plan(240, 60, 396) == (240, 1)  # 240 tiles, 396 slots: 1 part
    assert attention.split_plan(792, 120, 396) == (792, 1)
    assert attention.split_plan(100, 120, 396) == (0, 3)
    assert attention.split_plan(100, 2, 396) == (0, 2)  # no more parts than key tiles
    assert attention.split_plan(300, 120, 264) == (264, 7)
