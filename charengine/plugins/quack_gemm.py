"""FP8 GEMMs with rowwise scales through QuACK (quack-kernels): a persistent,
warp-specialized CuTe DSL GEMM for Hopper, the scales applied in its epilogue
(plugins/kernels/quack_epilogues.py). The CUTLASS DSL candidate of the per-shape GEMM choice
(plugins/gemm.py: the choice "quack:<tiles>"), and the GEMMs with more in their epilogues: the residual
(`quack_scaled_mm_residual`, for gemm_residual) and SwiGLU with its row maxima
(`quack_swiglu_mm`, for gemm_swiglu). On CPU tensors, the references.

Measured against `_scaled_mm` by `scripts/bench_kernels.py --only gemm --gemm-libs
scaled_mm,quack` (docs/PERFORMANCE_LOG.md, "A CuTe DSL GEMM: QuACK"): faster with fast
accumulation at both rank-slice projections; its promoted-sum path is several times slower,
so it serves fast accumulation only. Each tile configuration and epilogue compiles at first
use: charbuild puts the objects in the engine (charengine/kernel_cache.py). quack and
nvidia-cutlass-dsl are the optional extra `charengine[quack]`; installed from wheels without
pip, they must be unpacked under a directory named `site-packages` (docs/PERFORMANCE_LOG.md).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

import torch

from charengine import fp8

from . import gemm_residual


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


# The tiles charbuild times (the fastest at the TP-3 rank slice's two projections and their
# epilogue variants: scripts/bench_kernels.py --only gemm epilogues, docs/PERFORMANCE_LOG.md)
CANDIDATES = ("128,256,2,1,0", "128,192,2,1,1", "256,192,1,2,0", "256,160,1,2,0")


def available() -> bool:
    try:
        import quack  # noqa: F401
    except ImportError:
        return False
    return True


def _tile_args(tiles: QuackTiles, fast_accum: bool) -> dict:
    return dict(tile_M=tiles.tile_m, tile_N=tiles.tile_n, cluster_M=tiles.cluster_m,
                cluster_N=tiles.cluster_n, pingpong=tiles.pingpong,
                post_init_attrs=(("fp8_slow_accum", False),) if fast_accum else ())


def _scales(a_scale: torch.Tensor, w_scale: torch.Tensor) -> dict:
    return {"sa": a_scale.float().reshape(1, -1), "sw": w_scale.float().reshape(1, -1)}


def quack_scaled_mm(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor,
                    w_scale: torch.Tensor, out_dtype: torch.dtype, fast_accum: bool = False,
                    tiles: QuackTiles = QuackTiles()) -> torch.Tensor:
    """As fp8.scaled_mm: a_q [M, K], a_scale [M, 1], w_q [N, K], w_scale [N]."""
    if not a_q.is_cuda:
        return fp8.scaled_mm(a_q, a_scale, w_q, w_scale, out_dtype, fast_accum)
    from .kernels.quack_epilogues import rowwise_scaled

    M, N = a_q.shape[0], w_q.shape[0]
    d = torch.empty((1, M, N), dtype=out_dtype, device=a_q.device)
    rowwise_scaled.gemm(a_q[None], w_q[None], d, epi_args=_scales(a_scale, w_scale),
                        **_tile_args(tiles, fast_accum))
    return d[0]


def quack_scaled_mm_residual(a_q, a_scale, w_q, w_scale, residual, out_dtype, fast_accum,
                             tiles: QuackTiles = QuackTiles()) -> torch.Tensor:
    """As plugins/gemm_residual.reference: residual [M, N] (or None) added to the scaled
    product in the epilogue (QuACK's C input), rounded once."""
    if not a_q.is_cuda:
        return gemm_residual.reference(a_q, a_scale, w_q, w_scale, residual, out_dtype, fast_accum)
    if residual is None:
        return quack_scaled_mm(a_q, a_scale, w_q, w_scale, out_dtype, fast_accum, tiles)
    from .kernels.quack_epilogues import rowwise_scaled_residual

    M, N = a_q.shape[0], w_q.shape[0]
    if tuple(residual.shape) != (M, N) or residual.dtype != out_dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                         f"the output {(M, N)} {out_dtype}")
    d = torch.empty((1, M, N), dtype=out_dtype, device=a_q.device)
    rowwise_scaled_residual.gemm(a_q[None], w_q[None], d, residual.contiguous()[None],
                                 epi_args=_scales(a_scale, w_scale),
                                 **_tile_args(tiles, fast_accum))
    return d[0]


def swiglu_reference(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor,
                     w_scale: torch.Tensor, out_dtype: torch.dtype, fast_accum: bool = False,
                     split: int = 0):
    """The input projection with SwiGLU, as its epilogue computes it: w_q [split + 2F, K],
    the rows past `split` (gate, up) pairs (`interleave_gate_up`). Returns the scaled
    product's first `split` columns (out_dtype; None when split is 0); y = silu(gate) * up of
    the scaled product in fp32, rounded once to out_dtype, [M, F]; and each row's |y| max
    before rounding, [M, 1] (the kernel gives partials per N tile, [M, tiles], whose max is
    the same)."""
    acc = fp8.scaled_mm(a_q, a_scale, w_q, w_scale, torch.float32, fast_accum)
    gu = acc[:, split:]
    y = torch.nn.functional.silu(gu[:, 0::2]) * gu[:, 1::2]
    return (acc[:, :split].to(out_dtype) if split else None), y.to(out_dtype), \
        y.abs().amax(dim=1, keepdim=True)


def quack_swiglu_mm(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor,
                    w_scale: torch.Tensor, out_dtype: torch.dtype, fast_accum: bool = False,
                    split: int = 0, tiles: QuackTiles = QuackTiles()):
    """`swiglu_reference` with SwiGLU and the row maxima in the GEMM's epilogue
    (kernels/quack_epilogues.py), the maxima as [M, tiles] partials. The epilogue pairs every
    column, so with `split` it writes the whole product (of which the first `split` columns
    are returned) and SwiGLU of the first `split / 2` pairs too (not returned); `split` must
    be whole N tiles, so that no tile's maxima mix the two. On CPU tensors, the reference."""
    if not a_q.is_cuda:
        return swiglu_reference(a_q, a_scale, w_q, w_scale, out_dtype, fast_accum, split)
    from .kernels.quack_epilogues import rowwise_swiglu, rowwise_swiglu_d

    M, N = a_q.shape[0], w_q.shape[0]
    if (N - split) % 2 or split % tiles.tile_n:
        raise ValueError(f"the SwiGLU projection needs (gate, up) row pairs after {split} "
                         f"rows, a multiple of tile_n {tiles.tile_n}; N = {N}")
    y = torch.empty((1, M, N // 2), dtype=out_dtype, device=a_q.device)
    amax = torch.empty((1, M, -(-N // tiles.tile_n)), dtype=torch.float32, device=a_q.device)
    epi = {**_scales(a_scale, w_scale), "postact": y, "amax": amax}
    if not split:
        rowwise_swiglu.gemm(a_q[None], w_q[None], None, epi_args=epi,
                            **_tile_args(tiles, fast_accum))
        return None, y[0], amax[0]
    d = torch.empty((1, M, N), dtype=out_dtype, device=a_q.device)
    rowwise_swiglu_d.gemm(a_q[None], w_q[None], d, epi_args=epi, **_tile_args(tiles, fast_accum))
    return d[0, :, :split], y[0, :, split // 2:], amax[0, :, split // tiles.tile_n:]


# The SwiGLU projection's tiles where the plan names none (the fastest measured at the TP-3
# rank slice, scripts/bench_kernels.py --only epilogues, docs/PERFORMANCE_LOG.md)
SWIGLU_TILES = QuackTiles(128, 192, 2, 1, True)


def interleave_gate_up(w: torch.Tensor) -> torch.Tensor:
    """[gate; up] stacked rows (or a per-row vector) [2F, ...] -> (gate, up) pairs, row 2j
    gate j and row 2j + 1 up j: the layout the SwiGLU epilogue pairs adjacent columns in."""
    f = w.shape[0] // 2
    raw = w.view(torch.uint8) if w.dtype == fp8.FP8 else w  # stack has no fp8 kernel
    out = torch.stack([raw[:f], raw[f:]], dim=1).reshape(w.shape)
    return out.view(w.dtype)
