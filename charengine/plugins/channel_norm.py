"""The Wan VAE's RMS norm over channels, with the SiLU that follows it, as one kernel: x
[B, C, ...] divided by its L2 norm over C (floored at 1e-12), times sqrt(C) and a per-channel
gain, then SiLU where asked; computed in fp32 from the input and rounded once. In place of
F.normalize's norm, clamp and broadcast division, the two products and the SiLU (five to six
passes, two of them broadcasts the generic elementwise kernel runs slowly). Two layouts: the
channels of a position strided apart ([B, C, T, H, W] contiguous: C tiles of positions) or
side by side (channels-last: a row per position).

`channel_norm_taps` (the frames layout's decoder) writes the normalized pixel rows of F
frames straight into the stacked taps of the causal conv that reads them (ops.stacked_taps),
each frame into the n + 1 taps that hold it, and the newest n frames into the conv's past:
one pass in place of the norm, the concatenation with the past frames, the copy of the new
past and the taps' concatenation (reading and writing the frames about eleven times over)."""

from __future__ import annotations

import torch

from charengine.ops import channel_norm_taps as taps_reference
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


def triton_channel_norm_taps(x: torch.Tensor, gain: torch.Tensor, bias: torch.Tensor | None,
                             past: torch.Tensor, silu: bool) -> torch.Tensor:
    """The taps kernel; arguments and result as `taps_reference` (x and past contiguous)."""
    import triton

    from .kernels.channel_norm import channel_norm_taps_kernel

    frames, h, w, C = x.shape
    n = past.shape[0]
    if not (x.is_contiguous() and past.is_contiguous()) or past.shape[1:] != x.shape[1:]:
        raise ValueError(f"channel_norm_taps: x [F, H, W, C] and past [n, H, W, C] contiguous, "
                         f"got {list(x.shape)} and {list(past.shape)}")
    taps = torch.empty((frames, h, w, (n + 1) * C), dtype=x.dtype, device=x.device)
    for s in range(n):  # the past frames' slots: taps[f, tap i] holds frame f + i of [past; x]
        for i in range(s + 1):
            if s - i < frames:
                taps[s - i, ..., i * C:(i + 1) * C].copy_(past[s])
    if frames < n:  # past frames that stay past move up; the kernel writes the rest
        past[:n - frames].copy_(past[frames:].clone())
    positions = h * w
    grid = (triton.cdiv(positions, CL_ROWS), frames)
    gain = gain.reshape(C).contiguous()
    channel_norm_taps_kernel[grid](
        x, gain, gain if bias is None else bias, taps, past if n else taps, frames, positions,
        C, C ** 0.5, NORM_FLOOR, N=n, SILU=silu, HAS_BIAS=bias is not None, ROWS=CL_ROWS,
        BLOCK_C=triton.next_power_of_2(C), num_warps=4)
    return taps


def select(taps: bool = False):
    """The op (registered below; with `taps`, the one writing a conv's stacked taps): the
    kernel on CUDA tensors, the reference on CPU ones."""
    ops = torch.ops.charengine
    return ops.channel_norm_taps.default if taps else ops.channel_norm.default


registry.register("channel_norm_taps",
                  "(Tensor x, Tensor gain, Tensor? bias, Tensor(a!) past, bool silu) -> Tensor",
                  taps_reference, triton_channel_norm_taps,
                  lambda x, gain, bias, past, silu: x.new_empty(
                      (*x.shape[:-1], (past.shape[0] + 1) * x.shape[-1])))
registry.register("channel_norm", "(Tensor x, Tensor gain, bool silu) -> Tensor", reference,
                  triton_channel_norm, lambda x, gain, silu: torch.empty_like(x))
