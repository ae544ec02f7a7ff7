"""The block's FP8 GEMMs behind one interface: backends x epilogues, one choice grammar.

A choice is "<backend>[:<tiles>]", as an engine's GEMM plan records it (manifest
`kernels.gemm_plan`):
    scaled_mm          cuBLASLt: `torch._scaled_mm`, or cuBLASLt directly where the epilogue
                       takes a C input (plugins/cublaslt.py)
    cublaslt           cuBLASLt directly, with no workspace: its algorithms that need none,
                       so no memset of one before each call (plugins/cublaslt.Gemm)
    triton[:<tiles>]   the Triton kernel (plugins/fp8_gemm.py, a GemmTiles spec)
    quack[:<tiles>]    QuACK's CuTe DSL GEMM (plugins/quack_gemm.py, a QuackTiles spec), where
                       quack-kernels is installed
An epilogue is what the GEMM does with its product before the store; each has one call
signature and one plain reference, which runs anywhere:
    plain      gemm(a_q, a_scale, w_q, w_scale, out_dtype, fast_accum) -> [M, N]; where
               `takes_bias(gemm)`, also a keyword bias [N] added before the one rounding
    residual   gemm(a_q, a_scale, w_q, w_scale, residual, out_dtype, fast_accum)
               -> residual + product, rounded once (plugins/gemm_residual.py)
    swiglu     gemm(a_q, a_scale, w_q, w_scale, out_dtype, fast_accum, split)
               -> (the first `split` columns, silu(gate) * up of the (gate, up) row pairs
               past them, each row's |max| partials) (plugins/quack_gemm.py)
charbuild times `candidates(epilogue)` for each block linear at its steady shape and records
the fastest; the model takes `select(choice, epilogue, device)` once, at construction.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from charengine import fp8

from . import cublaslt, fp8_gemm, gemm_residual, quack_gemm

BACKENDS = ("scaled_mm", "cublaslt", "triton", "quack")
EPILOGUES = ("plain", "residual", "swiglu")
# the backends with each epilogue
SUPPORTED = {"plain": BACKENDS, "residual": ("scaled_mm", "quack"), "swiglu": ("quack",)}
REFERENCES = {"plain": fp8.scaled_mm, "residual": gemm_residual.reference,
              "swiglu": quack_gemm.swiglu_reference}


@dataclass(frozen=True)
class GemmChoice:
    backend: str = "scaled_mm"
    tiles: str = ""  # the backend's tile spec; empty: its default

    @classmethod
    def parse(cls, text: str | None) -> "GemmChoice":
        """'quack:128,256,2,1,0' -> GemmChoice("quack", "128,256,2,1,0"); None: scaled_mm."""
        backend, _, tiles = (text or "scaled_mm").partition(":")
        if backend not in BACKENDS:
            raise ValueError(f"unknown GEMM choice {text!r}; known backends: "
                             f"{', '.join(BACKENDS)}")
        return cls(backend, tiles)

    def __str__(self) -> str:
        return f"{self.backend}:{self.tiles}" if self.tiles else self.backend


def _need_quack(choice) -> None:
    if not quack_gemm.available():
        raise ValueError(f"GEMM choice {str(choice)!r} needs quack-kernels, not installed here")


def _quack_tiles(choice: GemmChoice, default: quack_gemm.QuackTiles) -> quack_gemm.QuackTiles:
    return quack_gemm.QuackTiles.parse(choice.tiles) if choice.tiles else default


def select(choice: str | None, epilogue: str = "plain", device="cuda"):
    """The GEMM of `choice` with `epilogue`, in the epilogue's call signature; None where the
    backend has no such epilogue (the Triton GEMM has no C input). On a device other than
    CUDA the epilogues with a C input or SwiGLU are their references."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"unknown GEMM epilogue {epilogue!r}; known: {', '.join(EPILOGUES)}")
    c, device = GemmChoice.parse(choice), torch.device(device)
    if epilogue == "plain":
        if c.backend == "scaled_mm" or (c.backend == "cublaslt" and device.type != "cuda"):
            return fp8.scaled_mm
        if c.backend == "cublaslt":
            return cublaslt.Gemm(device)
        if c.backend == "triton":
            return fp8_gemm.select(c.tiles)
        _need_quack(c)
        return functools.partial(quack_gemm.quack_scaled_mm,
                                 tiles=_quack_tiles(c, quack_gemm.QuackTiles()))
    if epilogue == "residual":
        if c.backend == "quack":
            if device.type == "cuda":
                _need_quack(c)
            return functools.partial(quack_gemm.quack_scaled_mm_residual,
                                     tiles=_quack_tiles(c, quack_gemm.QuackTiles()))
        if c.backend != "scaled_mm":
            return None
        return gemm_residual.LtGemmResidual(device) if device.type == "cuda" \
            else gemm_residual.reference
    # swiglu: QuACK's epilogue; a plan naming another backend takes QuACK's default tiles
    if device.type != "cuda":
        return quack_gemm.swiglu_reference
    if not quack_gemm.available():
        raise ValueError("gemm_swiglu needs quack-kernels on a GPU, not installed here")
    tiles = _quack_tiles(c, quack_gemm.SWIGLU_TILES) if c.backend == "quack" \
        else quack_gemm.SWIGLU_TILES
    return functools.partial(quack_gemm.quack_swiglu_mm, tiles=tiles)


def takes_bias(gemm) -> bool:
    """Whether a plain GEMM adds a bias in its epilogue (its `bias` keyword)."""
    return gemm is fp8.scaled_mm or isinstance(gemm, cublaslt.Gemm)


def candidates(epilogue: str, quack: bool | None = None) -> tuple[str, ...]:
    """The choices charbuild times for `epilogue`: each backend that has it, QuACK at its
    candidate tiles where it is installed (`quack`, by default: whether it is)."""
    quack = quack_gemm.available() if quack is None else quack
    out = []
    for backend in SUPPORTED[epilogue]:
        if backend == "quack":
            out += [f"quack:{t}" for t in quack_gemm.CANDIDATES] if quack else []
        else:
            out.append(backend)
    if not out:
        raise ValueError(f"the {epilogue} GEMM epilogue needs quack-kernels on the build GPU")
    return tuple(out)


def as_plain_call(gemm, epilogue: str, residual: torch.Tensor | None = None, split: int = 0):
    """`gemm` (of `epilogue`) called with the plain signature, its epilogue's extra input
    bound: what the builder times."""
    if epilogue == "residual":
        return lambda a_q, a_s, w_q, w_s, dt, fast: gemm(a_q, a_s, w_q, w_s, residual, dt, fast)
    if epilogue == "swiglu":
        return lambda a_q, a_s, w_q, w_s, dt, fast: gemm(a_q, a_s, w_q, w_s, dt, fast, split)
    return gemm


def time_choices(weights: list[tuple[torch.Tensor, torch.Tensor]], m: int, out_dtype,
                 fast_accum: bool, choices: tuple[str, ...], epilogue: str = "plain",
                 residual: torch.Tensor | None = None, split: int = 0, reps: int = 5
                 ) -> dict[str, float]:
    """Microseconds per call of each choice at [m, K] x [N, K]^T on the weights' GPU, calls
    walking over `weights` (every block's, so they stream from memory as in a step); the
    median of `reps` passes after one warm pass. On a CUDA device the walk is captured in a
    CUDA graph and its replays are timed, as the runtime runs GEMMs: a choice's host-side
    setup per call, which a replay does not pay, does not count. A choice that refuses the
    shape with ValueError (tiles that do not fit) is left out; one that cannot be captured
    stops the build with its error."""
    from charengine.timing import cuda_ms, median

    dev = weights[0][0].device
    g = torch.Generator(device=dev).manual_seed(0)
    a_q, a_s = fp8.quantize_rows(torch.randn(m, weights[0][0].shape[1], device=dev, generator=g))
    out = {}
    for choice in choices:
        gemm = as_plain_call(select(choice, epilogue, dev), epilogue, residual, split)
        try:
            gemm(a_q, a_s, *weights[0], out_dtype, fast_accum)
        except ValueError:
            continue

        def walk():
            for w_q, w_s in weights:
                gemm(a_q, a_s, w_q, w_s, out_dtype, fast_accum)

        passes = cuda_ms(_graphed(walk, dev), reps, warmup=1, device=dev)
        out[choice] = median([1e3 * t / len(weights) for t in passes])
    return out


def _graphed(fn, dev: torch.device):
    """fn on the CPU; on a CUDA device, the replay of a graph of fn captured after one warm
    call on a side stream (the lazy setup a first call does stays out of the capture)."""
    if dev.type != "cuda":
        return fn
    with torch.cuda.device(dev):
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    return graph.replay


def choose(times: dict[str, float]) -> str:
    return min(times, key=times.get)
