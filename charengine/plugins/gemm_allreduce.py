"""Fused FP8 GEMM + tensor-parallel all-reduce for the output projection.

`reference` is the plain path, kept and always available: the FP8 GEMM, then the group's
all-reduce (NCCL on GPUs, gloo on CPU).

`SymmetricGemmAllReduce` is the fused path (plugins/kernels/gemm_allreduce.py). Every rank
holds a [2, world, M, N] bf16 buffer and a flag array in symmetric memory. The GEMM's
epilogue stores each finished bf16 tile straight into every rank's buffer (peer-to-peer
stores over NVLink) and raises that tile's flag on every rank; a second kernel sums the
world's partials tile by tile as their flags arrive. The exchange runs while later tiles
are still in the GEMM, with no NCCL call and no NVLink multicast (switched off on our
machines: no multimem instruction is used). The buffers are bound once, for the
steady-state shape (M = tokens per frame, N = model width); every other shape (the session
start's global tokens) takes the reference path. The paper's production outage came from
binding buffers per prompt length: here there is exactly one binding per worker.

The products follow numerics.fast_accum, and the partials cross the wire as bf16, as NCCL's
bf16 all-reduce does. With `residual` (plugins/gemm_residual.py: the gate folded into the
weight scale) the reduction adds the residual stream h to the sum on every rank; the NCCL
path has rank 0 add it to its partial before the all-reduce.
"""

from __future__ import annotations

import torch

from charengine import fp8

from . import gemm_residual
from .fp8_gemm import GemmTiles


def reference(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor,
              w_scale: torch.Tensor, out_dtype: torch.dtype, fast_accum: bool,
              all_reduce, residual: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 activations a_q [M, K] with per-token scales [M, 1], FP8 weight slice w_q [N, K]
    with per-channel scales [N]: the rank's partial product (plus `residual`, which the
    caller passes on one rank only), summed over the TP group."""
    if residual is None:
        return all_reduce(fp8.scaled_mm(a_q, a_scale, w_q, w_scale, out_dtype, fast_accum))
    return all_reduce(gemm_residual.reference(a_q, a_scale, w_q, w_scale, residual, out_dtype,
                                              fast_accum))


def symmetric_memory_available(device: torch.device, peer_devices: list[str]) -> bool:
    """Whether the TP group's GPUs can map each other's memory: torch's symmetric memory is
    built in, and `device` has peer access to every other device of the group."""
    if device.type != "cuda":
        return False
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return False
    peers = {torch.device(d) for d in peer_devices} - {device}
    return all(torch.cuda.can_device_access_peer(device, p) for p in peers)


def use_fused(device: torch.device, world: int, shape: tuple[int, int],
              steady: tuple[int, int], symmetric_memory: bool) -> bool:
    """The dispatch rule: the fused kernel only on CUDA, for more than one rank, with
    symmetric memory available, at exactly the bound steady-state (M, N); NCCL otherwise."""
    return device.type == "cuda" and world > 1 and symmetric_memory and shape == steady


class Exchange:
    """One rank's view of the exchange buffers: its own data and flags, the addresses of
    every rank's (as this process maps them) and the epoch counter."""

    def __init__(self, data: torch.Tensor, flags: torch.Tensor, data_ptrs: torch.Tensor,
                 flag_ptrs: torch.Tensor, rank: int, world: int):
        self.data, self.flags, self.data_ptrs, self.flag_ptrs = data, flags, data_ptrs, flag_ptrs
        self.rank, self.world = rank, world
        self.epoch = torch.zeros((), dtype=torch.int64, device=data.device)

    @staticmethod
    def tiles(m: int, n: int, t: GemmTiles) -> int:
        return -(-m // t.block_m) * -(-n // t.block_n)

    @classmethod
    def symmetric(cls, group, m: int, n: int, device, tiles: GemmTiles = GemmTiles()):
        """Buffers in torch symmetric memory, rendezvoused over the TP process group
        (collective: every rank of the group calls it)."""
        import torch.distributed._symmetric_memory as symm_mem

        world = torch.distributed.get_world_size(group)
        data = symm_mem.empty((2, world, m, n), dtype=torch.bfloat16, device=device)
        flags = symm_mem.empty((2, world, cls.tiles(m, n, tiles)), dtype=torch.int64,
                               device=device)
        flags.zero_()
        hd = symm_mem.rendezvous(data, group.group_name)
        hf = symm_mem.rendezvous(flags, group.group_name)
        torch.distributed.barrier(group)  # every rank's flags are zero before any push
        ptrs = [torch.tensor(h.buffer_ptrs, dtype=torch.int64, device=device) for h in (hd, hf)]
        return cls(data, flags, *ptrs, hd.rank, world)

    @classmethod
    def local(cls, world: int, m: int, n: int, device, tiles: GemmTiles = GemmTiles()):
        """`world` ranks' buffers on one device (the single-GPU test of the exchange)."""
        data = [torch.zeros((2, world, m, n), dtype=torch.bfloat16, device=device)
                for _ in range(world)]
        flags = [torch.zeros((2, world, cls.tiles(m, n, tiles)), dtype=torch.int64,
                             device=device) for _ in range(world)]
        dp = torch.tensor([d.data_ptr() for d in data], dtype=torch.int64, device=device)
        fp = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64, device=device)
        return [cls(data[r], flags[r], dp, fp, r, world) for r in range(world)]


def gemm_push(x: Exchange, a_q, a_scale, w_q, w_scale,
              tiles: GemmTiles = GemmTiles(), fast_accum: bool = False) -> None:
    """This rank's partial product into every rank's slot, flags raised; FP8 products
    promoted to fp32 as `tiles.promote(fast_accum)` says."""
    from .kernels.gemm_allreduce import gemm_push_kernel

    M, K = a_q.shape
    N = w_q.shape[0]
    if a_q.stride(-1) != 1 or w_q.stride(-1) != 1:
        raise ValueError("a_q and w_q need contiguous rows")
    if tuple(x.data.shape[2:]) != (M, N):
        raise ValueError(f"exchange bound for {tuple(x.data.shape[2:])}, called with {(M, N)}")
    grid = (Exchange.tiles(M, N, tiles),)
    gemm_push_kernel[grid](a_q, a_scale, w_q, w_scale, x.data_ptrs, x.flag_ptrs, x.epoch, M, N,
                           K, a_q.stride(0), w_q.stride(0), RANK=x.rank, WORLD=x.world,
                           BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                           GROUP_M=tiles.group_m, PROMOTE=tiles.promote(fast_accum),
                           num_warps=tiles.warps,
                           num_stages=tiles.stages)


def reduce(x: Exchange, out_dtype: torch.dtype, tiles: GemmTiles = GemmTiles(),
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of the world's partials (plus `residual` [M, N], contiguous), as they arrive, rounded
    once; then the epoch advances."""
    from .kernels.gemm_allreduce import reduce_kernel

    M, N = x.data.shape[2:]
    if residual is not None and (tuple(residual.shape) != (M, N) or not residual.is_contiguous()):
        raise ValueError(f"residual must be a contiguous {(M, N)}, got {tuple(residual.shape)}")
    out = torch.empty((M, N), dtype=out_dtype, device=x.data.device)
    grid = (-(-M // tiles.block_m), -(-N // tiles.block_n))
    reduce_kernel[grid](x.data, x.flags, x.epoch, out, residual if residual is not None else out,
                        M, N, WORLD=x.world, RESIDUAL=residual is not None,
                        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, num_warps=4)
    x.epoch.add_(1)
    return out


class SymmetricGemmAllReduce:
    """The fused op for one TP rank, bound to the steady-state shape; same call as
    `reference`, which it falls back to at every other shape."""

    def __init__(self, exchange: Exchange, tiles: GemmTiles = GemmTiles()):
        self.x, self.tiles = exchange, tiles
        self.steady = tuple(exchange.data.shape[2:])

    def __call__(self, a_q, a_scale, w_q, w_scale, out_dtype, fast_accum, all_reduce,
                 residual=None):
        """`residual`: the residual stream, the same on every rank, added once to the sum."""
        shape = (a_q.shape[0], w_q.shape[0])
        if shape != self.steady:  # bound where symmetric memory was found, at one shape
            return reference(a_q, a_scale, w_q, w_scale, out_dtype, fast_accum, all_reduce,
                             residual if self.x.rank == 0 else None)
        gemm_push(self.x, a_q, a_scale, w_q, w_scale, self.tiles, fast_accum)
        return reduce(self.x, out_dtype, self.tiles, residual)
