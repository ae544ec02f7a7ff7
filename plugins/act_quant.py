"""Per-token FP8 activation quantization in one kernel: each program reads its row twice
(amax, then scale and quantize), writing the e4m3 row and its fp32 scale. The reference is
charengine.fp8.quantize_rows (scale = amax / 448, saturate, round to nearest even)."""

from __future__ import annotations

import torch

from charengine import fp8

reference = fp8.quantize_rows


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def act_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        x_row = x_ptr + row * stride_x
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(0, K, BLOCK):
            offs = k + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / 448.0
        tl.store(s_ptr + row, scale)
        for k in range(0, K, BLOCK):
            offs = k + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            y = tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0)
            tl.store(q_ptr + row * stride_q + offs, y.to(tl.float8e4nv), mask=offs < K)

    return act_quant_kernel


def triton_act_quant(x: torch.Tensor, block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (row-major) -> (q [M, K] e4m3, scale [M, 1] fp32)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    q = torch.empty((M, K), dtype=fp8.FP8, device=x.device)
    s = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    _kernel()[(M,)](x, q, s, K, x.stride(0), q.stride(0), BLOCK=block)
    return q, s


def select(device: torch.device):
    """The Triton kernel on CUDA, else the reference."""
    return triton_act_quant if device.type == "cuda" else reference
