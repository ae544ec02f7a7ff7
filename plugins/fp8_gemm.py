"""FP8 GEMM with rowwise scales, chosen per shape: cuBLASLt through `torch._scaled_mm` (with
or without fast accumulation) or a Triton kernel with its tile sizes. scripts/bench_kernels.py
measures the candidates at a preset's rank-slice shapes. cuBLASLt won at both rank-slice
shapes (docs/PERFORMANCE.md), so the model calls fp8.scaled_mm; recording a per-shape winner
in the engine is still to do."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from charengine import fp8

reference = fp8.scaled_mm


@dataclass(frozen=True)
class GemmTiles:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    group_m: int = 8
    warps: int = 8
    stages: int = 4


def triton_scaled_mm(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor,
                     w_scale: torch.Tensor, out_dtype: torch.dtype,
                     tiles: GemmTiles = GemmTiles()) -> torch.Tensor:
    """As fp8.scaled_mm: a_q [M, K], a_scale [M, 1], w_q [N, K], w_scale [N]."""
    from .kernels.fp8_gemm import fp8_gemm_kernel

    M, K = a_q.shape
    N = w_q.shape[0]
    if a_q.stride(-1) != 1 or w_q.stride(-1) != 1:
        raise ValueError("a_q and w_q need contiguous rows")
    c = torch.empty((M, N), dtype=out_dtype, device=a_q.device)
    grid = (((M + tiles.block_m - 1) // tiles.block_m) * ((N + tiles.block_n - 1) // tiles.block_n),)
    fp8_gemm_kernel[grid](a_q, a_scale, w_q, w_scale, c, M, N, K, a_q.stride(0), w_q.stride(0),
                          c.stride(0), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                          BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m, num_warps=tiles.warps,
                          num_stages=tiles.stages)
    return c
