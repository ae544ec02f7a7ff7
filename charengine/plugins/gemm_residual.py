"""The output projection with the block's gated residual add in its epilogue:
h' = h + gate * (A W^T), computed as h + (a_q * a_scale) (w_q * (w_scale * gate))^T.

The AdaLN gate depends only on the pass and the block (baked tables), so it folds into the
weight's per-output-channel scale, one scale vector per (block, pass); the residual stream h
is cuBLASLt's C input (beta = 1). The next block's norm kernel then reads h alone instead of
h and o (plugins/act_quant.py): 17.4 MB a call instead of 40.6 at the TP-3 rank slice.

Under tensor parallelism the partial products are summed across ranks; h must be added once:
by rank 0 before the all-reduce (NCCL), or by the fused exchange's reduction on every rank
(plugins/gemm_allreduce.py).

`reference` is the plain path (any device): the scaled product in fp32 plus h, rounded once.
`LtGemmResidual` calls cuBLASLt directly (plugins/cublaslt.py): `torch._scaled_mm` has no C.
"""

from __future__ import annotations

import torch

from charengine import fp8

# cuBLASLt's workspace for these matmuls: its heuristic asks for 4 bytes at the rank-slice
# shapes (docs/PERFORMANCE_LOG.md); this much leaves it room at any other shape
WORKSPACE_BYTES = 4 << 20


def reference(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor,
              w_scale: torch.Tensor, residual: torch.Tensor | None, out_dtype: torch.dtype,
              fast_accum: bool) -> torch.Tensor:
    """residual + (a_q * a_scale) (w_q * w_scale)^T, rounded once to out_dtype; a_q [M, K],
    a_scale [M, 1], w_q [N, K], w_scale [N], residual [M, N] or None (the product alone)."""
    out = fp8.scaled_mm(a_q, a_scale, w_q, w_scale, torch.float32, fast_accum)
    if residual is not None:
        out = out + residual.float()
    return out.to(out_dtype)


class LtGemmResidual:
    """`reference` on CUDA tensors through cuBLASLt (cublaslt.Gemm with the residual as its C
    input), one matmul (descriptor and algorithm) per shape and numerics, made at its first
    call."""

    def __init__(self, device: torch.device, workspace_bytes: int = WORKSPACE_BYTES):
        from .cublaslt import Gemm

        self.gemm = Gemm(device, workspace_bytes)

    def __call__(self, a_q, a_scale, w_q, w_scale, residual, out_dtype, fast_accum):
        if not a_q.is_cuda:
            return reference(a_q, a_scale, w_q, w_scale, residual, out_dtype, fast_accum)
        M, K = a_q.shape
        N = w_q.shape[0]
        for name, t in (("a_q", a_q), ("w_q", w_q), ("residual", residual)):
            if t is not None and not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        if residual is not None and (tuple(residual.shape) != (M, N)
                                     or residual.dtype != out_dtype):
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                             f"the output {(M, N)} {out_dtype}")
        return self.gemm(a_q, a_scale, w_q, w_scale, out_dtype, fast_accum, c=residual)
