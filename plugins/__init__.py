"""Fast kernels, each beside its plain PyTorch reference; chosen once from a config switch.

Each module has `reference(...)` (runs anywhere, the definition the kernel is tested against)
and `select(...)`, which returns the kernel's torch operator (custom_ops.py): the Triton
kernel on CUDA tensors, the reference on CPU ones. Where a switch is off the model calls the
reference directly.
"""
