"""The fused activation-quantization kernel against its reference, bit for bit, on the GPU.
(Triton's CPU interpreter cannot stand in: its fp32 -> e4m3 conversion rounds wrongly at
binade edges, 31.86 -> 16, and breaks ties away from even, 136 -> 144.)"""

import pytest
import torch

from charengine import fp8

triton = pytest.importorskip("triton")

@pytest.mark.gpu
@pytest.mark.parametrize("m,k", [(757, 7680), (757, 12800), (3072, 1536), (33, 100),
                                 (33, 20000)])
def test_kernel_matches_reference_on_the_gpu(m, k):
    """Rows held in registers (up to ROW_LANES lanes: one power of two, or two) and wider
    ones in two passes (20,000)."""
    from charengine.plugins.act_quant import triton_act_quant

    x = (torch.randn(m, k, device="cuda") * 5).to(torch.bfloat16)
    q, s = triton_act_quant(x)
    rq, rs = fp8.quantize_rows(x)
    assert torch.equal(s, rs)
    assert (q.view(torch.uint8) != rq.view(torch.uint8)).sum() == 0


@pytest.mark.gpu
def test_kernel_division_matches_torch_over_wide_magnitudes():
    """The kernels divide by the scale as x * (1 / s) plus one FMA correction
    (plugins/kernels/fp8_math.py): over values spread across 2^-30..2^30 within each row, rows
    whose amax is tiny or huge and a row of zeros, the codes and scales equal torch's exact
    division."""
    from charengine.plugins.act_quant import triton_act_quant

    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(512, 4096, device="cuda", generator=g)
    x = x * torch.exp2(torch.randint(-30, 31, x.shape, device="cuda", generator=g).float())
    x[:64] *= 2.0 ** -60
    x[64:128] *= 2.0 ** 60
    x[0] = 0  # its scale from the floor
    x = x.to(torch.bfloat16)
    q, s = triton_act_quant(x)
    rq, rs = fp8.quantize_rows(x)
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
