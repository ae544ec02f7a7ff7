"""FP8 attention over one (block, pass) cache, reading the ring as it lies: FP8 queries with a
scale per (head, token), FP8 keys and values with a scale per head (the cache's), FP8
tensor-core dots for Q K^T and for P V, fp32 online softmax, output [T, heads * head_dim] in
the layout the output projection reads.

Every slot is attended (the steady and reset steps run with the window full), so the kernel
takes no mask. P is quantized to e4m3 after scaling by P_SCALE (p <= 1, so p * 256 keeps the
small probabilities normal); the row sum uses the unquantized p.

The grid is (query tiles, heads): at 20 heads x 757 queries, 64-row tiles give 240 programs
over the H200's 132 SMs (128-row tiles would leave 12 idle). The tile sizes are an
`AttentionTiles`, chosen per shape by scripts/bench_kernels.py. Where the tiles would leave
the GPU's last round part-empty (LiveTalk's 576 tiles over 264 resident programs), the split
grid (`AttentionTiles.split_ctas_per_sm`, TMA and no output maxima only) runs the whole
rounds' tiles whole and the others in key ranges, which a second kernel merges.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from charengine import fp8

from . import registry

P_SCALE = 256.0
LOG2_P_SCALE = math.log2(P_SCALE)


def reference(q8: torch.Tensor, q_scale: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor,
              k_scale: torch.Tensor, v_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """q8 [H, T, D] e4m3 with q_scale [H, T, 1]; k8, v8 [H, S, D] e4m3 with k_scale, v_scale
    [H, 1, 1]: softmax(Q K^T / sqrt(D)) V over the dequantized tensors, [T, H * D]."""
    q = fp8.dequantize(q8, q_scale, out_dtype)
    k = fp8.dequantize(k8, k_scale, out_dtype)
    v = fp8.dequantize(v8, v_scale, out_dtype)
    o = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None])[0]
    return o.transpose(0, 1).reshape(q.shape[1], -1)


def reference_amax(q8, q_scale, k8, v8, k_scale, v_scale, out_dtype):
    """`reference` and each (token, head)'s max |output| [T, H] fp32, for the quantization of
    the output projection's input (plugins/act_quant.concat_quant_reference)."""
    o = reference(q8, q_scale, k8, v8, k_scale, v_scale, out_dtype)
    H, T, D = q8.shape
    return o, o.float().abs().reshape(T, H, D).amax(dim=-1)


@dataclass(frozen=True)
class AttentionTiles:
    """Tile sizes and variant; the default is the fastest measured on the H200 at the
    characters-57b TP-3 rank slice (scripts/bench_kernels.py, docs/PERFORMANCE_LOG.md)."""

    block_m: int = 64
    block_n: int = 128
    warps: int = 4
    stages: int = 3
    p_fp8: bool = True  # P V as an FP8 dot (else P and V in bf16); fast with V stored [D, S]
    tma: bool = True  # tiles through TMA descriptors (else pointer loads)
    # the softmax in fewer instructions per score (kernels/attention.py, _softmax_fma);
    # faster at the rank slice (docs/PERFORMANCE_LOG.md, the kernels' table)
    fma: bool = True
    # with TMA: resident programs per SM the grid is planned for (0: one program per query
    # tile). Where the tiles leave the GPU's last round part-empty, that round's tiles are
    # split over their keys to fill it, and a second kernel merges the parts (`split_plan`)
    split_ctas_per_sm: int = 0
    # with TMA, P as e4m3 and the FMA softmax, where the keys are whole tiles: the Gluon kernel
    # that computes the next key tile's scores during this tile's softmax
    # (kernels/attention_pipelined.py; `stages` is its ring of key and value buffers)
    pipelined: bool = False

    def spec(self) -> str:
        """The text `parse` reads back."""
        return (f"{self.block_m},{self.block_n},{self.warps},{self.stages},"
                f"{'fp8' if self.p_fp8 else 'bf16'},{'tma' if self.tma else 'ptr'}"
                + (",fma" if self.fma else "")
                + (f",split{self.split_ctas_per_sm}" if self.split_ctas_per_sm else "")
                + (",pipe" if self.pipelined else ""))

    @classmethod
    def parse(cls, text: str) -> "AttentionTiles":
        """'128,128,8,3,bf16,tma[,fma][,splitN][,pipe]' -> AttentionTiles (the fields after
        the fourth optional)."""
        f = text.split(",")
        flags = f[6:]
        split = next((int(x[len("split"):]) for x in flags if x.startswith("split")), 0)
        return cls(int(f[0]), int(f[1]), int(f[2]), int(f[3]), f[4] == "fp8",
                   len(f) > 5 and f[5] == "tma", "fma" in flags, split, "pipe" in flags)


# LiveTalk-1.3B's attention (12 heads x 3,072 queries over 15,360 keys): 576 tiles of 64
# queries, two programs to an SM (264 on an H200): two rounds of whole tiles, then the other
# 48 in five key ranges; faster than one program per tile at two or three programs to an SM
# (scripts/livetalk_kernels.py; docs/PERFORMANCE_LOG.md)
SPLIT_TILES = AttentionTiles(split_ctas_per_sm=2)
# LiveTalk-1.3B's cross-attention (12 heads x 3,072 queries over the prompt's 512 keys):
# 64-key tiles through pointer loads, one program per query tile: faster at this shape than
# through TMA, cuDNN's bf16 SDPA or SPLIT_TILES's pipelined kernel and its merge
# (scripts/livetalk_kernels.py --only cross_attention; docs/PERFORMANCE_LOG.md)
CROSS_TILES = AttentionTiles(64, 64, 4, 3, p_fp8=True, tma=False, fma=True)


def split_plan(tiles: int, key_tiles: int, slots: int) -> tuple[int, int]:
    """(whole, parts): the first `whole` tiles (whole rounds of `slots` programs) run alone,
    each of the others in `parts` key ranges so that they fill the last round; (tiles, 1)
    where the tiles fill their rounds or a split would not fit."""
    whole = tiles // slots * slots
    rest = tiles - whole
    parts = min(key_tiles, slots // rest) if rest else 1
    return (whole, parts) if parts > 1 else (tiles, 1)


def triton_attention(q8, q_scale, k8, v8, k_scale, v_scale, out_dtype,
                     tiles: AttentionTiles = AttentionTiles(), out=None,
                     amax: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel; arguments as `reference`. k8 and v8 may be any strided [H, S, D] views
    (a V stored transposed, [H, D, S] in memory, is read as it lies). `out` [T, H * D], if
    given, receives the result; `amax` [H, T] fp32, if given, each (head, token)'s max |out|
    (`reference_amax`'s, transposed)."""
    H, T, D = q8.shape
    S = k8.shape[1]
    if q8.stride(-1) != 1 or k8.stride(-1) != 1:
        raise ValueError("q8 and k8 need a contiguous head dimension")
    if q_scale.shape != (H, T, 1) or not q_scale.is_contiguous():
        raise ValueError(f"q_scale must be contiguous [H, T, 1] = [{H}, {T}, 1]")
    if out is None:
        out = torch.empty((T, H * D), dtype=out_dtype, device=q8.device)
    if amax is not None and (amax.shape != (H, T) or not amax.is_contiguous()):
        raise ValueError(f"amax must be contiguous [H, T] = [{H}, {T}]")
    grid = ((T + tiles.block_m - 1) // tiles.block_m, H)
    ks, vs = k_scale.reshape(H).float(), v_scale.reshape(H).float()
    sm_scale_log2 = math.log2(math.e) / math.sqrt(D)
    if tiles.pipelined and amax is None and pipelined_fits(q8, k8, v8, tiles):
        return _attention_pipelined(q8, q_scale, k8, v8, ks, vs, sm_scale_log2, out, tiles,
                                    grid)
    if tiles.tma:
        return _attention_tma(q8, q_scale, k8, v8, ks, vs, sm_scale_log2, out, amax, tiles,
                              grid)
    from .kernels.attention import attention_kernel

    attention_kernel[grid](
        q8, q_scale, k8, v8, ks, vs, out, out if amax is None else amax, T, S,
        sm_scale_log2, q8.stride(0), q8.stride(1), k8.stride(0), k8.stride(1),
        v8.stride(0), v8.stride(1), v8.stride(2), out.stride(0), D=D, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, P_FP8=tiles.p_fp8, P_SCALE=P_SCALE,
        LOG2_P_SCALE=LOG2_P_SCALE, FMA=tiles.fma, AMAX=amax is not None,
        num_warps=tiles.warps, num_stages=tiles.stages)
    return out


# the pipelined kernel's shape: one warpgroup (4 warps) of wgmma's 64-row tiles, on Hopper
PIPELINED_ROWS, PIPELINED_WARPS, PIPELINED_ARCH = 64, 4, (9, 0)
# its ring refills tile j - 1's stage with tile j + STAGES - 1 during tile j's turn, and
# tile j + 1's keys must already be there: at least three stages (fewer would wait forever)
PIPELINED_MIN_STAGES = 3
# TMA: a row of the value store is 16-byte aligned
TMA_ROW_BYTES = 16


def pipelined_fits(q8, k8, v8, tiles: AttentionTiles) -> bool:
    """The pipelined kernel's conditions: a Hopper GPU, one warpgroup of 64-row tiles, at
    least three stages, P as e4m3 with the FMA softmax, contiguous queries, keys in whole
    tiles (at least one) with rows of D, values stored transposed ([H, D, slots] in memory,
    rows 16-byte aligned)."""
    H, T, D = q8.shape
    S = k8.shape[1]
    return (tiles.block_m == PIPELINED_ROWS and tiles.warps == PIPELINED_WARPS
            and tiles.stages >= PIPELINED_MIN_STAGES and tiles.p_fp8 and tiles.fma
            and q8.is_cuda
            and torch.cuda.get_device_capability(q8.device) == PIPELINED_ARCH
            and q8.is_contiguous() and S >= tiles.block_n and S % tiles.block_n == 0
            and k8.stride(1) == D and k8.stride(0) % D == 0 and v8.stride(1) == 1
            and v8.stride(0) == D * v8.stride(2) and v8.stride(2) % TMA_ROW_BYTES == 0)


def _attention_pipelined(q8, q_scale, k8, v8, ks, vs, sm_scale_log2, out, tiles, grid):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .kernels.attention_pipelined import attention_pipelined_kernel

    H, T, D = q8.shape
    S = k8.shape[1]
    bm, bn = tiles.block_m, tiles.block_n
    k_cap, v_cap = k8.stride(0) // D, v8.stride(2)

    def desc(t, shape, row_stride, block):
        return TensorDescriptor(t, shape, [row_stride, 1], block,
                                gl.NVMMASharedLayout.get_default_for(block, gl.float8e4nv))

    whole, parts = _split_grid(tiles, grid[0] * H, S // bn, q8.device)
    rest = grid[0] * H - whole
    part, stat = _split_buffers(rest, parts, bm, D, q8.device)
    attention_pipelined_kernel[(whole + rest * parts,)](
        desc(q8, [H * T, D], D, [bm, D]), q_scale, desc(k8, [H * k_cap, D], D, [bn, D]),
        desc(v8, [H * D, S], v_cap, [D, bn]), ks, vs, out, part, stat, T, S, k_cap, grid[0],
        whole, parts, sm_scale_log2, out.stride(0), D=D, BLOCK_M=bm, BLOCK_N=bn,
        STAGES=tiles.stages, LOG2_P_SCALE=LOG2_P_SCALE, num_warps=tiles.warps)
    _merge(part, stat, vs, out, T, grid[0], whole, rest, parts)
    return out


def _split_grid(tiles: AttentionTiles, n_tiles: int, key_tiles: int, device
                ) -> tuple[int, int]:
    """(whole, parts) of `split_plan` at the tiles' programs per SM on `device`; every tile
    whole where the tiles do not split."""
    if not tiles.split_ctas_per_sm:
        return n_tiles, 1
    slots = tiles.split_ctas_per_sm * torch.cuda.get_device_properties(
        device).multi_processor_count
    return split_plan(n_tiles, key_tiles, slots)


def _split_buffers(rest: int, parts: int, bm: int, D: int, device):
    """The split programs' accumulators [rest * parts, bm, D] and row statistics
    [rest * parts, 2, bm] (fp32), for `attention_merge_kernel`; one unused slot where no
    tile is split (a kernel still takes the pointers)."""
    n = max(rest * parts, 1)
    return (torch.empty((n, bm, D), dtype=torch.float32, device=device),
            torch.empty((n, 2, bm), dtype=torch.float32, device=device))


def _merge(part, stat, vs, out, T, NT, whole, rest, parts):
    """The `rest` split tiles' parts merged into `out` (nothing where no tile was split)."""
    from .kernels.attention import attention_merge_kernel

    bm, D = part.shape[1], part.shape[2]
    if rest:
        attention_merge_kernel[(rest,)](part, stat, vs, out, T, NT, whole, parts,
                                        out.stride(0), D=D, BLOCK_M=bm, num_warps=4)


def _attention_tma(q8, q_scale, k8, v8, ks, vs, sm_scale_log2, out, amax, tiles, grid):
    from triton.tools.tensor_descriptor import TensorDescriptor

    from .kernels.attention import attention_tma_kernel

    H, T, D = q8.shape
    S = k8.shape[1]
    bm, bn = tiles.block_m, tiles.block_n
    v_t = v8.stride(1) == 1  # [H, D, S] in memory
    vd = v8.transpose(1, 2) if v_t else v8
    descs = (TensorDescriptor(q8, list(q8.shape), list(q8.stride()), [1, bm, D]), q_scale,
             TensorDescriptor(k8, list(k8.shape), list(k8.stride()), [1, bn, D]),
             TensorDescriptor(vd, list(vd.shape), list(vd.stride()),
                              [1, D, bn] if v_t else [1, bn, D]), ks, vs, out)
    consts = dict(D=D, BLOCK_M=bm, BLOCK_N=bn, P_FP8=tiles.p_fp8, V_T=v_t, P_SCALE=P_SCALE,
                  LOG2_P_SCALE=LOG2_P_SCALE, FMA=tiles.fma, num_warps=tiles.warps,
                  num_stages=tiles.stages)
    whole, parts = (grid[0] * H, 1) if amax is not None else \
        _split_grid(tiles, grid[0] * H, -(-S // bn), q8.device)
    if parts == 1:
        attention_tma_kernel[grid](*descs, out if amax is None else amax, T, S, sm_scale_log2,
                                   out.stride(0), AMAX=amax is not None, **consts)
        return out
    from .kernels.attention import attention_split_kernel

    rest = grid[0] * H - whole
    part, stat = _split_buffers(rest, parts, bm, D, q8.device)
    attention_split_kernel[(whole + rest * parts,)](
        *descs, part, stat, T, S, grid[0], whole, parts, sm_scale_log2, out.stride(0),
        **consts)
    _merge(part, stat, vs, out, T, grid[0], whole, rest, parts)
    return out


def supports(head_dim: int) -> bool:
    """FP8 tensor-core dots take K in multiples of 32; a tile's head dim is a power of 2."""
    return head_dim >= 32 and head_dim & (head_dim - 1) == 0


def select(head_dim: int, tiles: AttentionTiles | None = None, amax: bool = False):
    """For head dims the kernel supports, the op (registered below: the Triton kernel with
    `tiles`, else the default, on CUDA tensors; the reference on CPU ones), with
    `reference`'s signature (with `amax`, `reference_amax`'s: the output's maxima too); else
    that reference."""
    if not supports(head_dim):
        return reference_amax if amax else reference
    return functools.partial(_op_amax if amax else _op,
                             tiles=(tiles or AttentionTiles()).spec())


def _op_amax(q8, q_scale, k8, v8, k_scale, v_scale, out_dtype, tiles: str):
    return torch.ops.charengine.fp8_attention_amax.default(q8, q_scale, k8, v8, k_scale,
                                                           v_scale, out_dtype, tiles)


def _op(q8, q_scale, k8, v8, k_scale, v_scale, out_dtype, tiles: str):
    return torch.ops.charengine.fp8_attention.default(q8, q_scale, k8, v8, k_scale, v_scale,
                                                      out_dtype, tiles)


def _kernel(q8, q_scale, k8, v8, k_scale, v_scale, out_dtype, tiles):
    return triton_attention(q8, q_scale, k8, v8, k_scale, v_scale, out_dtype,
                            AttentionTiles.parse(tiles))


def _amax_kernel(q8, q_scale, k8, v8, k_scale, v_scale, out_dtype, tiles):
    H, T, _ = q8.shape
    amax = torch.empty((H, T), dtype=torch.float32, device=q8.device)
    out = triton_attention(q8, q_scale, k8, v8, k_scale, v_scale, out_dtype,
                           AttentionTiles.parse(tiles), amax=amax)
    return out, amax.t()


def _fake(q8, q_scale, k8, v8, k_scale, v_scale, out_dtype, tiles):
    H, T, D = q8.shape
    return q8.new_empty((T, H * D), dtype=out_dtype)


def _amax_fake(q8, q_scale, k8, v8, k_scale, v_scale, out_dtype, tiles):
    H, T, D = q8.shape
    return (q8.new_empty((T, H * D), dtype=out_dtype),
            q8.new_empty((H, T), dtype=torch.float32).t())


_SCHEMA = ("(Tensor q8, Tensor q_scale, Tensor k8, Tensor v8, Tensor k_scale, Tensor v_scale, "
           "ScalarType out_dtype, str tiles) -> ")
registry.register("fp8_attention", _SCHEMA + "Tensor",
                  lambda q8, qs, k8, v8, ks, vs, dt, tiles: reference(q8, qs, k8, v8, ks, vs, dt),
                  _kernel, _fake)
registry.register("fp8_attention_amax", _SCHEMA + "(Tensor, Tensor)",
                  lambda q8, qs, k8, v8, ks, vs, dt, tiles: reference_amax(q8, qs, k8, v8, ks,
                                                                           vs, dt),
                  _amax_kernel, _amax_fake)
