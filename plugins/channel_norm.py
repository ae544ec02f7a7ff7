"""The Wan VAE's RMS norm over channels, with the SiLU that follows it, as one kernel: x
[B, C, ...] divided by its L2 norm over C (floored at 1e-12), times sqrt(C) and a per-channel
gain, then SiLU where asked; computed in fp32 from the input and rounded once. In place of
F.normalize's norm, clamp and broadcast division, the two products and the SiLU (five to six
passes, two of them broadcasts the generic elementwise kernel runs slowly). Two layouts: the
channels of a position strided apart ([B, C, T, H, W] contiguous: C tiles of positions) or
side by side (channels-last: a row per position)."""

from __future__ import annotations

import torch

from charengine.ops import channel_rms_norm as reference

from . import registry

NORM_FLOOR = 1e-12  # F.normalize's eps
CF_BLOCK_C, CF_BLOCK_P = 32, 128  # channels-first tile (channels x positions)
CL_ROWS = 16  # channels-last: positions per program


def triton_channel_norm(x: torch.Tensor, gain: torch.Tensor, silu: bool) -> torch.Tensor:
    """The kernel; arguments and result as `reference`, the result laid out as x where x is
    contiguous or channels-last with batch 1 (any other x is made contiguous first)."""
    import triton

    from .kernels.channel_norm import channel_norm_cf_kernel, channel_norm_cl_kernel

    if not (x.is_contiguous() or (x.shape[0] == 1 and x[0].movedim(0, -1).is_contiguous())):
        x = x.contiguous()
    C = x.shape[1]
    positions = x[0, 0].numel()
    gain = gain.reshape(C).contiguous()
    out = torch.empty_like(x)
    if x.is_contiguous():
        grid = (triton.cdiv(positions, CF_BLOCK_P), x.shape[0])
        channel_norm_cf_kernel[grid](x, gain, out, C, positions, C ** 0.5, NORM_FLOOR, SILU=silu,
                                     BLOCK_C=CF_BLOCK_C, BLOCK_P=CF_BLOCK_P, num_warps=4)
        return out
    rows = positions  # channels-last: one row of C per position (out is laid out as x)
    grid = (triton.cdiv(rows, CL_ROWS),)
    channel_norm_cl_kernel[grid](x, gain, out, C, rows, C ** 0.5, NORM_FLOOR, SILU=silu,
                                 ROWS=CL_ROWS, BLOCK_C=triton.next_power_of_2(C), num_warps=4)
    return out


def select():
    """The op (registered below): the kernel on CUDA tensors, the reference on CPU ones."""
    return torch.ops.charengine.channel_norm.default


registry.register("channel_norm", "(Tensor x, Tensor gain, bool silu) -> Tensor", reference,
                  triton_channel_norm, lambda x, gain, silu: torch.empty_like(x))
