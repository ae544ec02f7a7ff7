"""Triton kernels of the plugins, one module per plugin; importing one needs Triton."""
