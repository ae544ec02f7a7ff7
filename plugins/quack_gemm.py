"""FP8 GEMM with rowwise scales through QuACK (quack-kernels): a persistent,
warp-specialized CuTe DSL GEMM for Hopper, the scales applied in its epilogue
(plugins/kernels/quack_epilogues.py). The CUTLASS DSL candidate of the per-shape GEMM choice
(`fp8_gemm.op("quack:<tiles>")`); on CPU tensors it is the reference.

Session 7 (one H200, `scripts/bench_kernels.py --only gemm --gemm-libs scaled_mm,quack`,
docs/PERFORMANCE.md): with fast accumulation, 105.7 us at the output projection against
117.9 / 127.4 for `_scaled_mm` promoted / fast, and 228.0 against 242.8 / 235.9 at the
input projection; the TP-3 step 117.9 against 121.9 ms. Its promoted-sum path runs 5-20x
slower, so it serves fast accumulation only. quack and nvidia-cutlass-dsl are not on the GPU
machine: they travel as wheels (docs/PERFORMANCE.md lists them; the shared carry script
stops at flash-attn-4) and compile each tile configuration at first use (2-5 s).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

import torch

from charengine import fp8


@dataclass(frozen=True)
class QuackTiles:
    tile_m: int = 128
    tile_n: int = 256
    cluster_m: int = 2
    cluster_n: int = 1
    pingpong: bool = False

    def spec(self) -> str:
        return ",".join(str(int(v)) for v in astuple(self))

    @classmethod
    def parse(cls, text: str) -> "QuackTiles":
        """'128,256,2,1,0' -> QuackTiles (pingpong 0 or 1)."""
        f = [int(x) for x in text.split(",")]
        if len(f) != 5 or f[4] not in (0, 1):
            raise ValueError(f"QuACK tiles {text!r}: tile_m,tile_n,cluster_m,cluster_n,pingpong")
        return cls(*f[:4], bool(f[4]))


def available() -> bool:
    try:
        import quack  # noqa: F401
    except ImportError:
        return False
    return True


def quack_scaled_mm(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor,
                    w_scale: torch.Tensor, out_dtype: torch.dtype, fast_accum: bool = False,
                    tiles: QuackTiles = QuackTiles()) -> torch.Tensor:
    """As fp8.scaled_mm: a_q [M, K], a_scale [M, 1], w_q [N, K], w_scale [N]."""
    if not a_q.is_cuda:
        return fp8.scaled_mm(a_q, a_scale, w_q, w_scale, out_dtype, fast_accum)
    from .kernels.quack_epilogues import rowwise_scaled

    M, N = a_q.shape[0], w_q.shape[0]
    d = torch.empty((1, M, N), dtype=out_dtype, device=a_q.device)
    rowwise_scaled.gemm(a_q[None], w_q[None], d,
                        epi_args={"sa": a_scale.float().reshape(1, M),
                                  "sw": w_scale.float().reshape(1, N)},
                        tile_M=tiles.tile_m, tile_N=tiles.tile_n, cluster_M=tiles.cluster_m,
                        cluster_N=tiles.cluster_n, pingpong=tiles.pingpong,
                        post_init_attrs=(("fp8_slow_accum", False),) if fast_accum else ())
    return d[0]
