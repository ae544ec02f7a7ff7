"""FP8 KV calibration, once per session on entering step `calibration_steps`: per (cache, K or
V, head) scale = amax of the unquantized cache x margin / 448, and every cache quantized
with its scales. The reference walks the caches one at a time in torch (about 2,000 small
ops at the characters-57b rank slice, each cache's fp32 temporaries); the kernels do it in
two passes over all caches: an amax kernel (one atomic max per tile) and a quantize kernel
that writes the FP8 stores, the transposed value store included, through their strides.
Both compute the same bytes: the amax is exact and the division, saturation and rounding are
`fp8.quantize`'s.
"""

from __future__ import annotations

import torch

from charengine import fp8

from . import registry


def reference(k: torch.Tensor, v: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor,
              scale: torch.Tensor, margin: float, fp8_max: float) -> None:
    """k, v [caches, H, S, D] unquantized (one cache may be a slice of a longer one's slots);
    k8, v8 the FP8 stores as [caches, H, S, D] (v8 may be a view of a [caches, H, D, S]
    store); scale [caches, 2, H, 1, 1] receives the scales.
    One cache at a time, so the fp32 temporaries stay one cache's size."""
    for c in range(k.shape[0]):
        for i, (src, dst) in enumerate(((k, k8), (v, v8))):
            amax = src[c].float().abs().amax(dim=(1, 2)).clamp_min(fp8.TINY)  # [heads]
            scale[c, i] = (amax * margin / fp8_max)[:, None, None]
            dst[c] = fp8.quantize(src[c], scale[c, i])


def triton_calibrate(k, v, k8, v8, scale, margin: float, fp8_max: float,
                     block_s: int = 64) -> None:
    """The kernels; arguments and effect as `reference`."""
    import triton

    C, H, S, D = k.shape
    for name, t in (("k", k), ("v", v)):
        # the kernels step (cache, head) rows by the head stride: one cache may be any
        # slice of its slots, several must lie back to back
        if t.stride(3) != 1 or (C > 1 and t.stride(0) != H * t.stride(1)):
            raise ValueError(f"{name} needs a contiguous head dimension and its caches "
                             "back to back [caches, heads, slots, head_dim]")
    from .kernels.calibrate import cache_amax_kernel, cache_quantize_kernel

    grid = (C * H, triton.cdiv(S, block_s))
    block_d = triton.next_power_of_2(D)
    amax = torch.zeros(2, C * H, dtype=torch.float32, device=k.device)
    for i, src in enumerate((k, v)):
        cache_amax_kernel[grid](src, amax[i], S, src.stride(1), src.stride(2), D=D,
                                BLOCK_S=block_s, BLOCK_D=block_d)
    s = amax.clamp_min(fp8.TINY) * margin / fp8_max  # [2, C * H], as the reference rounds
    scale.copy_(s.view(2, C, H).permute(1, 0, 2)[..., None, None])
    for i, (src, dst) in enumerate(((k, k8), (v, v8))):
        cache_quantize_kernel[grid](src, s[i], dst, S, H, src.stride(1), src.stride(2),
                                    dst.stride(0), dst.stride(1), dst.stride(2), dst.stride(3),
                                    D=D, BLOCK_S=block_s, BLOCK_D=block_d)


def select():
    """The op (registered below): the kernels on CUDA tensors, the reference on CPU
    ones."""
    return torch.ops.charengine.calibrate_cache.default


registry.register("calibrate_cache", "(Tensor k, Tensor v, Tensor(a!) k8, Tensor(b!) v8, "
                  "Tensor(c!) scale, float margin, float fp8_max) -> ()", reference,
                  triton_calibrate, lambda *args: None)
