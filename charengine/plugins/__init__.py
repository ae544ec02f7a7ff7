"""Fast kernels, each beside its plain PyTorch reference.

Each module has `reference(...)` (runs anywhere, the definition the kernel is tested against)
and registers its torch operator through the leaf `registry.py` at import: the Triton kernel
on CUDA tensors, the reference on CPU ones. `gemm.py` is the one interface to the FP8 GEMMs
(backends x epilogues). The model chooses among them once, when its ops are built
(charengine/characters/ops.py); where a switch is off it runs the reference.
"""
