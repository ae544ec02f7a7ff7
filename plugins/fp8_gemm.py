"""FP8 GEMM with rowwise scales, chosen per shape: cuBLASLt through `torch._scaled_mm` (with
or without fast accumulation, a numerics switch) or a Triton kernel with its tile sizes.

charbuild times both on the target GPU at each block linear's steady-state shape (M =
tokens per frame, the rank's own weights), and QuACK's CuTe DSL GEMM at `quack_gemm.CANDIDATES`
where quack-kernels is installed, and records the winner in the engine (manifest
`kernels.gemm_plan`); the model then calls `op(choice)` at that shape and `_scaled_mm` at
every other. scripts/bench_kernels.py sweeps the Triton kernel's tiles."""

from __future__ import annotations

import functools
import statistics
from dataclasses import astuple, dataclass

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
    """The Triton kernel's custom op (plugins/custom_ops.py; the CPU emulation on CPU tensors)
    with fp8.scaled_mm's signature and the tiles' spec."""
    from . import custom_ops  # noqa: F401  (registers torch.ops.charengine)

    return torch.ops.charengine.fp8_gemm.default(a_q, a_scale, w_q, w_scale, out_dtype,
                                                 fast_accum, tiles)


def op(choice: str | None):
    """The GEMM for a recorded choice (None: the default, `_scaled_mm`): "scaled_mm",
    "triton" (default tiles), "triton:<GemmTiles spec>", or "quack[:<QuackTiles spec>]"
    (plugins/quack_gemm.py, where quack is installed)."""
    if choice in (None, "scaled_mm"):
        return reference
    name, _, spec = choice.partition(":")
    if name == "triton":
        return functools.partial(_triton, tiles=GemmTiles.parse(spec).spec() if spec
                                 else GemmTiles().spec())
    if name == "quack":
        from . import quack_gemm

        tiles = quack_gemm.QuackTiles.parse(spec) if spec else quack_gemm.QuackTiles()
        if not quack_gemm.available():
            raise ValueError(f"GEMM choice {choice!r} needs quack-kernels, not installed here")
        return functools.partial(quack_gemm.quack_scaled_mm, tiles=tiles)
    raise ValueError(f"unknown GEMM choice {choice!r}; known: {', '.join(CHOICES)}, quack")


def time_choices(weights: list[tuple[torch.Tensor, torch.Tensor]], m: int, out_dtype,
                 fast_accum: bool, reps: int = 5, choices=CHOICES, gemm_for=None
                 ) -> dict[str, float]:
    """Microseconds per call of each choice at [m, K] x [N, K]^T on the weights' GPU, calls
    walking over `weights` (every block's, so they stream from memory as in a step); the
    median of `reps` passes after one warm pass. `gemm_for(choice)` gives the op timed (by
    default `op`, the plain GEMM; a builder passes the epilogue variant its switches run); a
    choice it refuses with ValueError (tiles that do not fit the shape) is left out."""
    dev = weights[0][0].device
    g = torch.Generator(device=dev).manual_seed(0)
    a_q, a_s = fp8.quantize_rows(torch.randn(m, weights[0][0].shape[1], device=dev, generator=g))
    out = {}
    for choice in choices:
        gemm = (gemm_for or op)(choice)
        try:
            gemm(a_q, a_s, *weights[0], out_dtype, fast_accum)
        except ValueError:
            continue
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
