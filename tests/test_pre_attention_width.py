"""The fused pre-attention for a norm across heads (LiveTalk's) against its reference on the
GPU, at the released model's shape and a small one: the queries quantized alike, the keys and
values written at the ring's slots within one e4m3 code, other slots untouched; into a cache
in the compute dtype, the queries and the keys within one bf16 rounding and the values
copied exactly."""

import pytest
import torch

from charengine import fp8
from charengine.plugins import pre_attention_width
from charengine.rope import cos_sin

pytest.importorskip("triton")
pytestmark = pytest.mark.gpu
DEV = "cuda"
NAN8 = 0x7F  # an e4m3fn NaN byte


def within_one_code(a, b) -> bool:
    """Every e4m3 value of b within one code of a's (zero's sign aside)."""
    x, y = a.float(), b.float()
    return bool(((x - y).abs() <= torch.maximum(x.abs(), y.abs()) * 2.0 ** -3 + 2.0 ** -9)
                .all())


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.mark.parametrize("H,T,D,S", [(12, 3072, 128, 15360), (2, 192, 32, 960)])
def test_fused_pre_attention_across_heads_matches_its_reference(H, T, D, S):
    g = torch.Generator(device=DEV).manual_seed(T)
    y = (torch.randn(T, 3 * H * D, device=DEV, generator=g) * 3).to(torch.bfloat16)
    q, k, v = (t.unflatten(1, (H, D)) for t in y.split(H * D, -1))  # strided, as the GEMM's
    qn, kn = ((torch.rand(H * D, device=DEV, generator=g) + 0.5).to(torch.bfloat16)
              for _ in range(2))
    cos, sin = cos_sin(torch.rand(T, D // 2, device=DEV, generator=g) * 6)
    idx = S - 2 * T + torch.arange(T, device=DEV)
    idx = idx[torch.randperm(T, device=DEV, generator=g)]
    ks = torch.rand(H, 1, 1, device=DEV, generator=g) * 0.01 + 0.01
    vs = torch.rand(H, 1, 1, device=DEV, generator=g) * 0.01 + 0.01
    stores = []
    for _ in range(2):
        k8 = torch.empty(H, S, D, dtype=fp8.FP8, device=DEV)
        v8 = torch.empty(H, D, S, dtype=fp8.FP8, device=DEV)  # values stored [H, D, S]
        k8.view(torch.uint8).fill_(NAN8)
        v8.view(torch.uint8).fill_(NAN8)
        stores.append((k8, v8))
    ref = pre_attention_width.reference(q, k, v, qn, kn, 1e-6, cos, sin, stores[0][0],
                                        stores[0][1].transpose(1, 2), ks, vs, idx)
    out = pre_attention_width.op(q, k, v, qn, kn, 1e-6, cos, sin, stores[1][0],
                                 stores[1][1].transpose(1, 2), ks, vs, idx)
    (rq, rs), (tq, ts) = ref, out
    assert ((ts - rs).abs() <= rs * 2.0 ** -7).all()
    assert within_one_code(rq, tq)
    assert (rq.view(torch.uint8) == tq.view(torch.uint8)).float().mean() > 0.99
    for r, t in zip(stores[0], stores[1]):
        written = r.view(torch.uint8) != NAN8
        assert torch.equal(written, t.view(torch.uint8) != NAN8)
        assert within_one_code(r.float()[written], t.float()[written])
    untouched = S - 2 * T
    assert (stores[1][0].view(torch.uint8)[:, :untouched] == NAN8).all()
    assert (stores[1][1].view(torch.uint8)[:, :, :untouched] == NAN8).all()


@pytest.mark.parametrize("H,T,D,S", [(12, 3072, 128, 12288), (2, 192, 32, 960)])
def test_fused_pre_attention_into_a_bf16_cache_matches_its_reference(H, T, D, S):
    g = torch.Generator(device=DEV).manual_seed(T + 1)
    y = (torch.randn(T, 3 * H * D, device=DEV, generator=g) * 3).to(torch.bfloat16)
    q, k, v = (t.unflatten(1, (H, D)) for t in y.split(H * D, -1))
    qn, kn = ((torch.rand(H * D, device=DEV, generator=g) + 0.5).to(torch.bfloat16)
              for _ in range(2))
    cos, sin = cos_sin(torch.rand(T, D // 2, device=DEV, generator=g) * 6)
    idx = (S - 2 * T + torch.arange(T, device=DEV))[torch.randperm(T, device=DEV, generator=g)]
    stores = [tuple(torch.full((H, S, D), float("nan"), dtype=torch.bfloat16, device=DEV)
                    for _ in range(2)) for _ in range(2)]
    rq, rs = pre_attention_width.reference(q, k, v, qn, kn, 1e-6, cos, sin, *stores[0], None,
                                           None, idx)
    tq, ts = pre_attention_width.op(q, k, v, qn, kn, 1e-6, cos, sin, *stores[1], None, None,
                                    idx)
    assert tq.dtype == torch.bfloat16 and tq.shape == (H, T, D) and ts.numel() == rs.numel() == 0
    step = 2.0 ** -7  # bf16's relative step

    def near(a, b):
        """Within two bf16 steps of the row's largest magnitude (a rotation sums two rounded
        values, so a small output can carry its inputs' rounding), and mostly equal."""
        a, b = a.float(), b.float()
        row = a.abs().amax(-1, keepdim=True)
        return bool(((a - b).abs() <= 2 * step * row).all()) and \
            float((a == b).float().mean()) > 0.95

    assert near(rq, tq)
    (rk, rv), (tk, tv) = stores
    written = ~rk.isnan()
    assert torch.equal(written, ~tk.isnan()) and torch.equal(written, ~tv.isnan())
    assert near(rk[:, idx], tk[:, idx])
    assert torch.equal(rv[written], tv[written])
    assert tk[:, : S - 2 * T].isnan().all() and tv[:, : S - 2 * T].isnan().all()
