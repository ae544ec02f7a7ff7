"""Triton kernels of plugins/gemm_allreduce.py (imported only where Triton and a GPU are).

Buffers (every rank holds the same layout, peers reach it through symmetric memory):
    data  [2, world, M, N] bf16: slot (parity, r) holds rank r's partial product
    flags [2, world, tiles] int64: flag (parity, r, t) = epoch + 1 once rank r's tile t is
          in this rank's slot (parity, r)
The epoch (one int64 on the device, advanced once per call by the caller's stream) picks the
parity: a peer can run at most one call ahead (its next call needs this rank's next
partial), so it never writes the slot this rank is still reducing.
"""

import triton
import triton.language as tl

from .fp8_gemm import fp8_gemm_tile


@triton.jit
def gemm_push_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, data_ptrs, flag_ptrs, epoch_ptr, M, N, K,
                     stride_am, stride_wn, RANK: tl.constexpr, WORLD: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, PROMOTE: tl.constexpr):
    """This rank's partial C = (A * a_scale) (W * w_scale)^T, tile by tile, stored as bf16
    straight into every rank's slot (parity, RANK) (peer-to-peer stores), each tile then
    signalled to every rank with a system-scope release."""
    c, offs_m, offs_n, pid_m, pid_n = fp8_gemm_tile(a_ptr, as_ptr, w_ptr, ws_ptr, M, N, K,
                                                    stride_am, stride_wn, BLOCK_M, BLOCK_N,
                                                    BLOCK_K, GROUP_M, PROMOTE)
    c = c.to(tl.bfloat16)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    epoch = tl.load(epoch_ptr)
    parity = epoch % 2
    tiles = grid_m * grid_n
    tile = pid_m * grid_n + pid_n
    offs = offs_m[:, None] * N + offs_n[None, :]
    inside = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    slot = (parity * WORLD + RANK) * M * N
    for p in tl.static_range(WORLD):
        dst = tl.load(data_ptrs + p).to(tl.pointer_type(tl.bfloat16))
        tl.store(dst + slot + offs, c, mask=inside)
    tl.debug_barrier()  # every thread's stores precede the release below
    for p in tl.static_range(WORLD):
        flag = tl.load(flag_ptrs + p).to(tl.pointer_type(tl.int64))
        tl.atomic_xchg(flag + (parity * WORLD + RANK) * tiles + tile, epoch + 1, sem="release",
                       scope="sys")


@triton.jit
def reduce_kernel(data_ptr, flag_ptr, epoch_ptr, out_ptr, res_ptr, M, N, WORLD: tl.constexpr,
                  RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out tile = sum over ranks of this rank's slots (parity, r), each read once its flag
    says the epoch's tile is there (system-scope acquire); with RESIDUAL, plus the residual
    tile, in fp32 before the one rounding."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    grid_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(M, BLOCK_M) * grid_n
    tile = pid_m * grid_n + pid_n
    epoch = tl.load(epoch_ptr)
    parity = epoch % 2
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs = offs_m[:, None] * N + offs_n[None, :]
    inside = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if RESIDUAL:
        acc += tl.load(res_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    for r in tl.static_range(WORLD):
        flag = flag_ptr + (parity * WORLD + r) * tiles + tile
        while tl.atomic_add(flag, 0, sem="acquire", scope="sys") <= epoch:
            pass
        tl.debug_barrier()
        part = tl.load(data_ptr + (parity * WORLD + r) * M * N + offs, mask=inside, other=0.0,
                       volatile=True)
        acc += part.to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=inside)
