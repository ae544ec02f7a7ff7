"""FP8 GEMM with rowwise scales, chosen per shape: cuBLASLt through `torch._scaled_mm` (with
or without fast accumulation, a numerics switch) or a Triton kernel with its tile sizes.

charbuild times both on the target GPU at each block linear's steady-state shape (M =
tokens per frame, the rank's own weights) and records the winner in the engine
(manifest `kernels.gemm_plan`); the model then calls `op(choice)` at that shape and
`_scaled_mm` at every other. scripts/bench_kernels.py sweeps the Triton kernel's tiles."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from charengine import fp8

reference = fp8.scaled_mm
CHOICES = ("scaled_mm", "triton")


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


def _triton(a_q, a_scale, w_q, w_scale, out_dtype, fast_accum: bool = False):
    """The Triton kernel's custom op (plugins/custom_ops.py; the CPU emulation on CPU tensors)
    with fp8.scaled_mm's signature (it always accumulates in fp32)."""
    from . import custom_ops  # noqa: F401  (registers torch.ops.charengine)

    return torch.ops.charengine.fp8_gemm.default(a_q, a_scale, w_q, w_scale, out_dtype)


def op(choice: str | None):
    """The GEMM for a recorded choice (None: the default, `_scaled_mm`)."""
    if choice in (None, "scaled_mm"):
        return reference
    if choice == "triton":
        return _triton
    raise ValueError(f"unknown GEMM choice {choice!r}; known: {', '.join(CHOICES)}")


def time_choices(weights: list[tuple[torch.Tensor, torch.Tensor]], m: int, out_dtype,
                 fast_accum: bool, reps: int = 5) -> dict[str, float]:
    """Microseconds per call of each choice at [m, K] x [N, K]^T on the weights' GPU, calls
    walking over `weights` (every block's, so they stream from memory as in a step); the
    median of `reps` passes after one warm pass."""
    dev = weights[0][0].device
    g = torch.Generator(device=dev).manual_seed(0)
    a_q, a_s = fp8.quantize_rows(torch.randn(m, weights[0][0].shape[1], device=dev, generator=g))
    out = {}
    for choice in CHOICES:
        gemm = op(choice)
        passes = []
        for _ in range(reps + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for w_q, w_s in weights:
                gemm(a_q, a_s, w_q, w_s, out_dtype, fast_accum)
            b.record()
            b.synchronize()
            passes.append(1e3 * a.elapsed_time(b) / len(weights))
        out[choice] = statistics.median(passes[1:])
    return out


def choose(times: dict[str, float]) -> str:
    return min(times, key=times.get)
