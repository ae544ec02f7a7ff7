"""Fast kernels, each beside its plain PyTorch reference.

Every module has one entry shape: its reference (`reference(...)`, or one per op it holds,
`*_reference`: runs anywhere, the definition the kernel is tested against), its kernel
(registered as a torch operator through the leaf `registry.py` at import: the Triton kernel
on CUDA tensors, the reference on CPU ones), and one `select(...)` taking only what picks the
variant (a head dim and tiles, an op's name, a flag for its second op) and returning the
callable. `gemm.py` is the one interface to the FP8 GEMMs (backends x epilogues,
`select(choice, epilogue, device)`). A family's ops choose among them once, when they are
built (charengine/characters/ops.py, charengine/livetalk/ops.py); where a switch is off they
run the reference.
"""
