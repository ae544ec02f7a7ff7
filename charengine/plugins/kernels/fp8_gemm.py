"""Triton kernel of plugins/fp8_gemm.py (imported only where Triton and a GPU are)."""

import triton
import triton.language as tl


@triton.jit
def fp8_gemm_tile(a_ptr, as_ptr, w_ptr, ws_ptr, M, N, K, stride_am, stride_wn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, PROMOTE: tl.constexpr):
    """This program's tile of (A * a_scale[M]) (W * w_scale[N])^T in fp32, A [M, K] and
    W [N, K] e4m3 row-major; tiles walked in groups of GROUP_M rows so that W tiles are
    reused from L2. The tensor cores accumulate FP8 products at reduced precision; PROMOTE
    (K elements, at most BLOCK_K) says how often the partial sum is added into an fp32
    accumulator (tl.dot's max_num_imprecise_acc): 0 never (Triton's sm_90 default, the
    numerics of cuBLASLt's fast accumulation).
    Returns (tile, offs_m, offs_n, pid_m, pid_n)."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rm = tl.where(offs_m < M, offs_m, 0)
    rn = tl.where(offs_n < N, offs_n, 0)
    a_ptrs = a_ptr + rm[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + rn[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        kmask = offs_k[None, :] < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=kmask, other=0.0)
        w = tl.load(w_ptrs, mask=kmask, other=0.0)
        if PROMOTE == 0:
            acc = tl.dot(a, tl.trans(w), acc)
        else:
            acc = tl.dot(a, tl.trans(w), acc, max_num_imprecise_acc=PROMOTE)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    sa = tl.load(as_ptr + offs_m, mask=offs_m < M, other=0.0)
    sw = tl.load(ws_ptr + offs_n, mask=offs_n < N, other=0.0)
    return acc * sa[:, None] * sw[None, :], offs_m, offs_n, pid_m, pid_n


@triton.jit
def fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, M, N, K, stride_am, stride_wn,
                    stride_cm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PROMOTE: tl.constexpr):
    """C[M, N] = (A * a_scale[M]) (W * w_scale[N])^T (fp8_gemm_tile), stored as C's dtype."""
    c, offs_m, offs_n, _, _ = fp8_gemm_tile(a_ptr, as_ptr, w_ptr, ws_ptr, M, N, K, stride_am,
                                            stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                                            PROMOTE)
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], c.to(c_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
