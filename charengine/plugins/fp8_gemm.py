"""The Triton backend of the FP8 GEMM with rowwise scales (plugins/gemm.py chooses among
backends): tile sizes as a `GemmTiles`, partial sums promoted to fp32 as the numerics say.
scripts/bench_kernels.py sweeps its tiles."""

from __future__ import annotations

import functools
from dataclasses import astuple, dataclass

import torch

from charengine import fp8

from . import registry

reference = fp8.scaled_mm


@dataclass(frozen=True)
class GemmTiles:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    group_m: int = 8
    warps: int = 8
    stages: int = 4
    # K elements (at most block_k) the tensor cores accumulate at reduced precision before
    # each add into the fp32 accumulator (kernels/fp8_gemm.py): None follows the numerics,
    # once per K tile as cuBLASLt does by default, never (0) with fast accumulation
    promote_k: int | None = None

    def promote(self, fast_accum: bool) -> int:
        if self.promote_k is not None:
            return self.promote_k
        return 0 if fast_accum else self.block_k

    def spec(self) -> str:
        """The text `parse` reads back."""
        return ",".join("" if v is None else str(v) for v in astuple(self))

    @classmethod
    def parse(cls, text: str) -> "GemmTiles":
        """'128,256,128,8,8,3[,promote_k]' -> GemmTiles."""
        f = text.split(",")
        promote = int(f[6]) if len(f) > 6 and f[6] else None
        return cls(*(int(x) for x in f[:6]), promote)


def triton_scaled_mm(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor,
                     w_scale: torch.Tensor, out_dtype: torch.dtype,
                     tiles: GemmTiles = GemmTiles(), fast_accum: bool = False) -> torch.Tensor:
    """As fp8.scaled_mm: a_q [M, K], a_scale [M, 1], w_q [N, K], w_scale [N]; the FP8
    products promoted to fp32 as `tiles.promote(fast_accum)` says."""
    promote = tiles.promote(fast_accum)
    if not 0 <= promote <= tiles.block_k:
        raise ValueError(f"promote_k {promote} must be between 0 and block_k {tiles.block_k}")
    from .kernels.fp8_gemm import fp8_gemm_kernel

    M, K = a_q.shape
    N = w_q.shape[0]
    if a_q.stride(-1) != 1 or w_q.stride(-1) != 1:
        raise ValueError("a_q and w_q need contiguous rows")
    c = torch.empty((M, N), dtype=out_dtype, device=a_q.device)
    grid = (((M + tiles.block_m - 1) // tiles.block_m) * ((N + tiles.block_n - 1) // tiles.block_n),)
    fp8_gemm_kernel[grid](a_q, a_scale, w_q, w_scale, c, M, N, K, a_q.stride(0), w_q.stride(0),
                          c.stride(0), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                          BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m, PROMOTE=promote,
                          num_warps=tiles.warps, num_stages=tiles.stages)
    return c


def _triton(a_q, a_scale, w_q, w_scale, out_dtype, fast_accum: bool = False,
            tiles: str = GemmTiles().spec()):
    """The Triton kernel's op (registered below; the exact emulation on CPU tensors) with
    fp8.scaled_mm's signature and the tiles' spec."""
    return torch.ops.charengine.fp8_gemm.default(a_q, a_scale, w_q, w_scale, out_dtype,
                                                 fast_accum, tiles)


def select(tiles: str = ""):
    """The Triton GEMM with `tiles` (a GemmTiles spec; the default tiles when empty)."""
    return functools.partial(_triton, tiles=GemmTiles.parse(tiles).spec() if tiles
                             else GemmTiles().spec())


def _kernel(a_q, a_scale, w_q, w_scale, out_dtype, fast_accum, tiles):
    return triton_scaled_mm(a_q, a_scale, w_q, w_scale, out_dtype, GemmTiles.parse(tiles),
                            fast_accum)


def _reference(a_q, a_scale, w_q, w_scale, out_dtype, fast_accum, tiles):
    """The exact emulation: fp32 sums of exact products (no reduced-precision accumulator)."""
    return reference(a_q, a_scale, w_q, w_scale, out_dtype)


registry.register("fp8_gemm", "(Tensor a_q, Tensor a_scale, Tensor w_q, Tensor w_scale, "
                  "ScalarType out_dtype, bool fast_accum, str tiles) -> Tensor",
                  _reference, _kernel,
                  lambda a_q, a_s, w_q, w_s, out_dtype, fast_accum, tiles: a_q.new_empty(
                      (a_q.shape[0], w_q.shape[0]), dtype=out_dtype))
