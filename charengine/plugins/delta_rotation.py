"""The delta rotation at a reset, for every cache at once: each window key's temporal pairs
are dequantized with the head's scale, rotated by omega_j * delta in fp32, clamped and
requantized with the same scale, in place. Global slots and values are untouched.

`reference` loops over the caches in torch (one rounding per key, once per reset).
"""

from __future__ import annotations

import torch

from charengine import fp8
from charengine.rope import rotate_temporal_f32

from . import registry


def reference(k8: torch.Tensor, k_scale: torch.Tensor, first_slot: int,
              omega_t: torch.Tensor, delta: float) -> None:
    """k8 [caches, H, S, D] e4m3, k_scale [caches, H, 1, 1]: rotate slots first_slot.. in
    place."""
    for c in range(k8.shape[0]):
        s = k_scale[c]
        win = fp8.dequantize(k8[c, :, first_slot:], s)
        k8[c, :, first_slot:] = fp8.quantize(rotate_temporal_f32(win, omega_t, delta), s)


def triton_delta_rotation(k8, k_scale, first_slot, omega_t, delta, block_r: int = 128) -> None:
    import triton

    C, H, S, D = k8.shape
    if k8.stride(-1) != 1:
        raise ValueError("k8 needs a contiguous head dimension")
    W = S - first_slot
    rows = C * H * W
    ang = omega_t * delta  # in omega_t's precision, as the reference
    nt = omega_t.shape[0]
    from .kernels.delta_rotation import delta_rotation_kernel

    delta_rotation_kernel[((rows + block_r - 1) // block_r,)](
        k8, k_scale, torch.cos(ang).float(), torch.sin(ang).float(), rows, H, W, first_slot,
        k8.stride(0), k8.stride(1), k8.stride(2), k_scale.stride(0), k_scale.stride(1),
        NT=nt, BLOCK_R=block_r, BLOCK_J=triton.next_power_of_2(nt), num_warps=4)


def select():
    """The op (registered below): the Triton kernel on CUDA tensors, the reference on CPU
    ones."""
    return torch.ops.charengine.delta_rotation.default


registry.register("delta_rotation", "(Tensor(a!) k8, Tensor k_scale, int first_slot, "
                  "Tensor omega_t, float delta) -> ()", reference, triton_delta_rotation,
                  lambda *args: None)
