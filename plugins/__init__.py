"""Fast kernels, each beside its plain PyTorch reference; chosen once from a config switch.

Each module has `reference(...)` (runs anywhere, the definition the kernel is tested against)
and `select(device)`, which returns the kernel where one exists for the device and the
reference otherwise.
"""
