"""FP8 (e4m3) quantization: per-token activations, per-channel weights, per-head KV, and the
scaled matmul. On CUDA the matmul is `torch._scaled_mm`; elsewhere it is emulated exactly
(FP8 values are exact in fp32, products are exact, sums accumulate in fp32)."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
TINY = 1e-12


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale, saturated to +-448, rounded to e4m3. `scale` broadcasts against x."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The scale an amax gives: floored at TINY, over 448 (the kernels' fp8_math.scale_of)."""
    return amax.clamp_min(TINY) / FP8_MAX


def amax_scale(x: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """The scale that maps x's largest magnitude over `dim` (kept as size 1; every element
    where None) to 448, its amax floored at TINY."""
    a = x.float().abs()
    return scale_of(a.amax() if dim is None else a.amax(dim=dim, keepdim=True))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-token, or per-output-channel for a weight) scales: amax / 448."""
    scale = amax_scale(x, -1)
    return quantize(x, scale), scale


def scaled_mm(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor,
              w_scale: torch.Tensor, out_dtype: torch.dtype, fast_accum: bool = False,
              bias: torch.Tensor | None = None):
    """(a_q * a_scale) @ (w_q * w_scale).T with a_q [M, K], a_scale [M, 1], w_q [N, K],
    w_scale [N]; with `bias` [N] (in out_dtype) added before the one rounding, as the GEMM's
    epilogue adds it."""
    if a_q.is_cuda:
        return torch._scaled_mm(a_q, w_q.t(), scale_a=a_scale.float(),
                                scale_b=w_scale.float()[None, :], bias=bias,
                                out_dtype=out_dtype, use_fast_accum=fast_accum)
    out = (a_q.float() @ w_q.float().t()) * a_scale * w_scale[None, :]
    return (out if bias is None else out + bias.float()).to(out_dtype)


def quant_dequant_rows(x: torch.Tensor) -> torch.Tensor:
    """x through FP8 with one scale per row (the queries' quantization for FP8 attention: one
    scale per head and token)."""
    q, scale = quantize_rows(x)
    return dequantize(q, scale, x.dtype)


def quant_dequant_per_tensor(x: torch.Tensor) -> torch.Tensor:
    scale = amax_scale(x)
    return dequantize(quantize(x, scale), scale, x.dtype)


def index_copy_(dst: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> None:
    """dst.index_copy_ that also works for FP8 tensors (copied as their bytes)."""
    src = src.to(dst.dtype)
    if dst.dtype == FP8:
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    dst.index_copy_(dim, index, src)


def cat(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """torch.cat that also works for FP8 tensors (joined as their bytes)."""
    if tensors[0].dtype != FP8:
        return torch.cat(tensors, dim)
    return torch.cat([t.view(torch.uint8) for t in tensors], dim).view(FP8)
