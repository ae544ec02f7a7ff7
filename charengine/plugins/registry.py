"""The leaf every plugin registers its torch operator through (namespace `charengine`): an
op's CPU kernel is its plain PyTorch reference, its CUDA kernel the fast one, its fake
kernel gives output shapes to tracers (torch.compile, export). A plugin module calls
`register` once, at import, so its op exists wherever the module is imported; this module
imports no plugin, so there are no import cycles.

    torch.ops.charengine.norm_modulate_quant.default(h, shift, scale, eps)

Registered through torch.library.Library with explicit schemas rather than the
`torch.library.custom_op` decorator: that one wraps every kernel in a dynamo guard whose first
call imports torch._dynamo and sympy (seconds more at worker start), and costs several times
more per call (docs/PERFORMANCE_LOG.md).

The fused GEMM + all-reduce is not an op: it holds its TP group's symmetric buffers
(plugins/gemm_allreduce.py), which an op's schema cannot carry.
"""

from __future__ import annotations

import torch
from torch.library import Library, register_fake

from charengine import fp8

NAMESPACE = "charengine"
# The registrations live as long as this library object: the process's one handle on the
# namespace, made when the first plugin registers.
LIBRARY = Library(NAMESPACE, "DEF")


def register(name: str, schema: str, cpu, cuda, fake) -> None:
    """Define torch.ops.charengine.<name> with `schema`: `cpu` (the reference) on CPU
    tensors, `cuda` (the kernel) on CUDA ones, `fake` for tracers."""
    LIBRARY.define(name + schema)
    LIBRARY.impl(name, cpu, "CPU")
    LIBRARY.impl(name, cuda, "CUDA")
    register_fake(f"{NAMESPACE}::{name}", fake, lib=LIBRARY)


def rows_and_scale(x: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fake outputs of a per-row FP8 quantization: [rows, cols] e4m3 and [rows, 1] fp32."""
    return (x.new_empty((x.shape[0], cols), dtype=fp8.FP8),
            x.new_empty((x.shape[0], 1), dtype=torch.float32))


def no_scale(q: torch.Tensor) -> torch.Tensor:
    return q.new_empty(0, dtype=torch.float32)
