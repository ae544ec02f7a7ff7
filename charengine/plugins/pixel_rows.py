"""The Wan VAE decoder's elementwise passes over pixel rows [T, H, W, C] in the frames layout,
as kernels: the nearest 2x spatial resize (each input row read once and written to its four
output pixels, in place of PyTorch's channels-last nearest kernel, a tenth of its time:
docs/PERFORMANCE_LOG.md), and a residual block's end, its last conv's bias and the
residual added in one pass (in place of the conv's broadcast bias add, which runs on
PyTorch's strided elementwise kernel, and the add after it)."""

from __future__ import annotations

import torch

from charengine.ops import bias_residual_rows as bias_residual_reference
from charengine.ops import nearest2x_rows as nearest2x_reference

from . import registry

BLOCK = 2048  # input elements per program


def triton_nearest2x_rows(rows: torch.Tensor) -> torch.Tensor:
    """The resize kernel; argument and result as `nearest2x_reference` (rows contiguous)."""
    import triton

    from .kernels.pixel_rows import nearest2x_rows_kernel

    if not rows.is_contiguous():
        rows = rows.contiguous()
    t, h, w, c = rows.shape
    out = torch.empty((t, 2 * h, 2 * w, c), dtype=rows.dtype, device=rows.device)
    nearest2x_rows_kernel[(triton.cdiv(rows.numel(), BLOCK),)](rows, out, rows.numel(), h, w, c,
                                                                 BLOCK=BLOCK, num_warps=4)
    return out


def triton_bias_residual_rows(h: torch.Tensor, bias: torch.Tensor,
                              x: torch.Tensor) -> torch.Tensor:
    """The kernel; arguments and result as `bias_residual_reference` (h and x contiguous
    rows of one shape; summed in fp32, rounded once)."""
    import triton

    from .kernels.pixel_rows import bias_residual_rows_kernel

    if h.shape != x.shape or not (h.is_contiguous() and x.is_contiguous()):
        raise ValueError(f"bias_residual_rows: h and x contiguous rows of one shape, got "
                         f"{list(h.shape)} and {list(x.shape)}")
    out = torch.empty_like(h)
    bias_residual_rows_kernel[(triton.cdiv(h.numel(), BLOCK),)](h, bias, x, out, h.numel(),
                                                                h.shape[-1], BLOCK=BLOCK,
                                                                num_warps=4)
    return out


OPS = ("bias_residual", "nearest2x")  # the block end and the resize


def select(op: str):
    """Op `op` of OPS (registered below): the kernel on CUDA tensors, the reference on CPU
    ones."""
    if op not in OPS:
        raise ValueError(f"pixel_rows: unknown op {op!r}; known: {', '.join(OPS)}")
    return getattr(torch.ops.charengine, f"{op}_rows").default


registry.register("nearest2x_rows", "(Tensor rows) -> Tensor", nearest2x_reference,
                  triton_nearest2x_rows,
                  lambda rows: rows.new_empty((rows.shape[0], 2 * rows.shape[1],
                                               2 * rows.shape[2], rows.shape[3])))
registry.register("bias_residual_rows", "(Tensor h, Tensor bias, Tensor x) -> Tensor",
                  bias_residual_reference, triton_bias_residual_rows,
                  lambda h, bias, x: torch.empty_like(h))
