"""The per-block KV caches of a LiveTalk session: sink slots (the first chunks, kept for the
session) then a window of the last chunks, for every block; the prompt's cross-attention
K/V; and where the current chunk writes and at which positions.

Plain path (ring_cache off): as upstream, the window slides by copying its chunks left and
the current chunk writes after them; write offsets and positions come from the host's chunk
count. Ring path: the window's chunks are a ring, the write offset and the positions derive
on the device from the cache's chunk counter, so a chunk's work replays from a CUDA graph.

Positions (position_reset on): a window chunk sits one chunk after the previous, starting
right after the sink; every cache.reset_period chunks the cached window keys are rotated
back by that many chunks (the delta rotation), so positions stay bounded. Off: chunk c's
frames sit at c * chunk_frames, as upstream (unbounded).

FP8 KV (fp8_kv): the first cache.calibration_chunks chunks write the bf16 cache; then the
per-(block, head) scales are set from its |max| (with cache.scale_margin), the cache is
quantized once, and later chunks write and read FP8. The FP8 values are stored [blocks,
heads, head_dim, slots] (the layout the FP8 attention kernel's P V dot reads fast,
plugins/attention.py), the keys [blocks, heads, slots, head_dim]."""

from __future__ import annotations

import math

import torch

from .. import fp8
from ..plugins import calibrate, delta_rotation
from ..plugins.attention import TMA_ROW_BYTES
from .rope import ChunkRope, rotate_temporal


def first_steady_chunk(cfg) -> int:
    """The first chunk of the steady shape: the window full and, with fp8_kv, the FP8 cache
    in use; the chunks before it fill the cache (and give the calibration)."""
    spec = cfg.model
    full = spec.sink_chunks + spec.window_chunks - 1
    return max(full, cfg.cache.calibration_chunks) if cfg.switches.fp8_kv else full


class ChunkCache:
    def __init__(self, cfg, device, dtype):
        spec, sw = cfg.model, cfg.switches
        self.cfg, self.spec = cfg, spec
        self.device, self.dtype = torch.device(device), dtype
        self.F, self.ct = spec.chunk_frames, spec.chunk_tokens
        self.S, self.W, self.R = spec.sink_chunks, spec.window_chunks, cfg.cache.reset_period
        self.sink_slots = spec.sink_frames * spec.frame_tokens
        self.slots = spec.cache_frames * spec.frame_tokens
        self.ring, self.reset_on, self.fp8_kv = sw.ring_cache, sw.position_reset, sw.fp8_kv
        shape = (spec.n_blocks, spec.n_heads, self.slots, spec.head_dim)
        dev = self.device
        # shared_kv_stores: the cache in the model's dtype holds only the slots the
        # calibration chunks write, in the FP8 cache's bytes (where those hold it)
        calibration_slots = self.valid_slots(cfg.cache.calibration_chunks - 1)
        self.shared = self.fp8_kv and sw.shared_kv_stores and \
            self.slots * fp8.FP8.itemsize <= calibration_slots * dtype.itemsize
        self.wide_slots = calibration_slots if self.shared else self.slots
        wide = (spec.n_blocks, spec.n_heads, self.wide_slots, spec.head_dim)
        if self.shared:
            # one buffer each for k and v: the wide cache the calibration chunks write, and
            # over the same bytes the FP8 cache that replaces it (calibrate: block b's FP8
            # bytes lie within blocks 0..b's wide bytes, so the blocks still to quantize
            # stay intact)
            stores = [torch.zeros(math.prod(wide) * dtype.itemsize, dtype=torch.uint8,
                                  device=dev) for _ in range(2)]
            self.byte_stores = stores
            self.k, self.v = (b.view(dtype).view(wide) for b in stores)
            n8 = math.prod(shape)
            self.k8 = stores[0][:n8].view(fp8.FP8).view(shape)
            self.v8 = stores[1][:n8].view(fp8.FP8).view(  # [blocks, heads, head_dim, slots]
                spec.n_blocks, spec.n_heads, spec.head_dim, self.slots)
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=dev)
            self.v = torch.zeros(shape, dtype=dtype, device=dev)
        if self.fp8_kv and not self.shared:
            self.k8 = torch.zeros(shape, dtype=fp8.FP8, device=dev)
            self.v8 = torch.zeros(shape, dtype=fp8.FP8, device=dev).transpose(2, 3) \
                .contiguous()  # [blocks, heads, head_dim, slots]
        if self.fp8_kv:
            self.scale = torch.ones(spec.n_blocks, 2, spec.n_heads, 1, 1, device=dev)
        self.quantized = False  # host: the FP8 cache is in use (after calibration)
        self.chunk = torch.zeros((), dtype=torch.long, device=dev)  # chunks committed
        self.lanes = torch.arange(self.ct, device=dev)
        self.frames = torch.arange(self.F, device=dev)
        self.write_index = torch.zeros(self.ct, dtype=torch.long, device=dev)
        self.positions = torch.zeros(self.F, dtype=torch.long, device=dev)
        self.rope = ChunkRope(spec, dev)
        self.text_k = self.text_v = None  # [blocks, heads, prompt_tokens, head_dim]
        # the session's conditioning (LiveTalkDiT.start): the reference latent, the
        # conditioning inputs of the first and later chunks, the prompt's text context
        self.ref = self.y_first = self.y_next = self.context = None
        # with fp8_cross_attention: the same K/V in e4m3 (values stored [blocks, heads,
        # head_dim, slots], as the attention kernel reads them) and their scales [blocks,
        # heads, 1, 1]
        self.text8: tuple[torch.Tensor, ...] | None = None
        # the FP8 cache's calibration and delta rotation, chosen once: the fused kernels or
        # their plain references (the plugins')
        self.calibrate_fp8 = calibrate.select() if sw.fused_calibration \
            else calibrate.reference
        self.rotate_fp8 = delta_rotation.select() if sw.fused_delta_rotation \
            else delta_rotation.reference

    def kv_bytes(self) -> int:
        """Bytes the K/V stores hold (shared: the FP8 cache inside the wide one's buffers)."""
        wide = 2 * self.k.numel() * self.k.element_size()
        return wide + 2 * self.k8.numel() if self.fp8_kv and not self.shared else wide

    def state(self, quantized: bool) -> list:
        """Every tensor of a session's state with its FP8 store in use or not: the K/V store
        in use (shared stores before the calibration: the bytes under both), the scales,
        counters and conditioning; None for conditioning not kept yet."""
        if quantized:
            kv = [self.k8, self.v8]
        else:
            kv = self.byte_stores if self.shared else [self.k, self.v]
        return [*kv, *([self.scale] if self.fp8_kv else []), self.chunk, self.write_index,
                self.positions, self.text_k, self.text_v, *(self.text8 or (None,) * 4),
                self.ref, self.y_first, self.y_next, self.context]

    def copy_from(self, other: ChunkCache) -> None:
        """This cache made a copy of `other`'s session (same config), in this cache's own
        buffers (made at the first copy where `other` has conditioning this one lacks)."""
        mine, theirs = self.state(other.quantized), other.state(other.quantized)
        if any(a is None and b is not None for a, b in zip(mine, theirs)):
            for name in ("text_k", "text_v", "ref", "y_first", "y_next", "context"):
                if getattr(self, name) is None and getattr(other, name) is not None:
                    setattr(self, name, torch.empty_like(getattr(other, name)))
            if self.text8 is None and other.text8 is not None:
                self.text8 = tuple(torch.empty_like(t) for t in other.text8)
            mine = self.state(other.quantized)
        for a, b in zip(mine, theirs):
            if b is not None:
                a.copy_(b)
        self.quantized = other.quantized

    def new_session(self) -> None:
        self.chunk.zero_()
        self.quantized = False

    def keep(self, name: str, value: torch.Tensor) -> None:
        """The session's tensor `name` (one of the conditioning's above), in the same buffer
        every session once it exists: captured graphs read these buffers."""
        if getattr(self, name) is None:
            setattr(self, name, value.contiguous())
        else:
            getattr(self, name).copy_(value)

    def keep_text(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """The session's cross-attention K/V, in the same buffers every session (captured
        graphs read them)."""
        if self.text_k is None:
            self.text_k, self.text_v = k.contiguous(), v.contiguous()
        else:
            self.text_k.copy_(k)
            self.text_v.copy_(v)

    def keep_text_fp8(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """The session's cross-attention K/V [blocks, heads, prompt_tokens, head_dim]
        quantized with one scale per block and head (amax / FP8_MAX), into the same buffers
        every session."""
        ks, vs = fp8.amax_scale(k, (2, 3)), fp8.amax_scale(v, (2, 3))
        k8, v8 = fp8.quantize(k, ks), fp8.quantize(v, vs).transpose(2, 3)
        if self.text8 is None:
            S = k.shape[2]
            store = torch.empty((*v8.shape[:3], S + (-S % TMA_ROW_BYTES)), dtype=fp8.FP8,
                                device=k.device)
            self.text8 = (torch.empty_like(k8), store, torch.empty_like(ks),
                          torch.empty_like(vs))
        t_k, store, t_ks, t_vs = self.text8
        t_k.copy_(k8)
        store[..., : k.shape[2]].copy_(v8)
        t_ks.copy_(ks)
        t_vs.copy_(vs)

    def text_fp8(self, b: int):
        """Block b's FP8 prompt K/V as the attention takes them: k8 [heads, S, D], v8
        [heads, S, D] (a view of the [heads, D, S] store), their scales [heads, 1, 1]."""
        k8, store, ks, vs = self.text8
        S = k8.shape[2]
        return k8[b], store[b, ..., :S].transpose(1, 2), ks[b], vs[b]

    # ---- what the host knows from its chunk count -------------------------------------
    def valid_slots(self, c: int) -> int:
        """Slots chunk c attends over (every written one, its own included)."""
        return (min(c, self.S + self.W - 1) + 1) * self.ct

    def base_frame(self, c: int) -> int:
        """Position of chunk c's first frame."""
        if not self.reset_on or c <= self.S:
            return c * self.F
        return self.F * (self.S + 1 + (c - self.S - 1) % self.R)

    def first_steady(self) -> int:
        return first_steady_chunk(self.cfg)

    def quantized_at(self, c: int) -> bool:
        """Chunk c reads and writes the FP8 cache (the calibration ran before it)."""
        return self.fp8_kv and c >= self.cfg.cache.calibration_chunks

    def is_reset(self, c: int) -> bool:
        """Chunk c starts with the delta rotation of the cached window keys."""
        return self.reset_on and c > self.S + 1 and (c - self.S - 1) % self.R == 0

    # ---- per chunk ---------------------------------------------------------------------
    def begin_chunk(self, c: int) -> None:
        """Set the write slots and positions of chunk c (the host's count; the ring path
        computes both on the device from its own counter and ignores c) and, at a reset,
        rotate the window's cached keys."""
        if self.ring:
            n = self.chunk
            window = self.sink_slots + torch.remainder(n - self.S, self.W) * self.ct
            self.write_index.copy_(torch.where(n < self.S, n * self.ct, window) + self.lanes)
            if self.reset_on:
                wrapped = self.F * (self.S + 1 + torch.remainder(n - self.S - 1, self.R))
                base = torch.where(n <= self.S, n * self.F, wrapped)
            else:
                base = n * self.F
            self.positions.copy_(base + self.frames)
        else:
            if c >= self.S + self.W:  # slide the window left by one chunk
                lo = self.sink_slots
                for cache in self._stores():
                    cache[:, :, lo: self.slots - self.ct] = cache[:, :, lo + self.ct:].clone()
            off = min(c, self.S + self.W - 1) * self.ct
            self.write_index.copy_(self.lanes + off)
            self.positions.copy_(self.frames + self.base_frame(c))
        if self.is_reset(c):
            self.delta_rotate()

    def _stores(self):
        """The caches in use, each seen [blocks, heads, slots, head_dim]."""
        return (self.k8, self.v8.transpose(2, 3)) if self.quantized else (self.k, self.v)

    def delta_rotate(self) -> None:
        """Turn every cached window key back by reset_period chunks of positions: the FP8
        cache's by rotate_fp8 (its plain reference goes a block at a time, so the fp32
        temporaries are one block's window), the wide cache's one block at a time."""
        delta = -float(self.R * self.F)
        lo = self.sink_slots
        if self.quantized:
            self.rotate_fp8(self.k8, self.scale[:, 0], lo, self.rope.omega_t, delta)
            return
        for b in range(self.spec.n_blocks):
            self.k[b, :, lo:] = rotate_temporal(self.k[b, :, lo:], self.rope.omega_t, delta)

    def end_chunk(self) -> None:
        self.chunk += 1

    # ---- per block ---------------------------------------------------------------------
    def write(self, b: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Chunk tokens' k, v [ct, heads, head_dim] (k after RoPE) into block b's slots."""
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        if self.quantized:
            fp8.index_copy_(self.k8[b], 1, self.write_index, fp8.quantize(k, self.scale[b, 0]))
            fp8.index_copy_(self.v8[b], 2, self.write_index,
                            fp8.quantize(v, self.scale[b, 1]).transpose(1, 2))
        else:
            self.k[b].index_copy_(1, self.write_index, k.to(self.dtype))
            self.v[b].index_copy_(1, self.write_index, v.to(self.dtype))

    def read(self, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block b's first n slots' k, v [heads, n, head_dim] in the model's dtype."""
        if self.quantized:
            k8, v8, ks, vs = self.read_fp8(b, n)
            return fp8.dequantize(k8, ks, self.dtype), fp8.dequantize(v8, vs, self.dtype)
        return self.k[b, :, :n], self.v[b, :, :n]

    def stores(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block b's stores in the model's dtype as the fused pre-attention writes them: k, v
        [heads, slots, head_dim]."""
        return self.k[b], self.v[b]

    def stores_fp8(self, b: int):
        """Block b's FP8 stores as the fused pre-attention writes them: k8, v8 [heads, slots,
        head_dim] views and their per-head scales [heads, 1, 1]."""
        return self.k8[b], self.v8[b].transpose(1, 2), self.scale[b, 0], self.scale[b, 1]

    def read_fp8(self, b: int, n: int):
        """Block b's first n slots as they lie in the FP8 cache: k8, v8 [heads, n, head_dim]
        views (v8's slots contiguous) and their per-head scales [heads, 1, 1]."""
        k8, v8, ks, vs = self.stores_fp8(b)
        return k8[:, :n], v8[:, :n], ks, vs

    def calibrate(self, n: int) -> None:
        """Set the FP8 scales from the first n slots of every block and quantize them, one
        block at a time (the fp32 temporaries are one block's, not the whole cache's)."""
        margin = self.cfg.cache.scale_margin
        for b in range(self.spec.n_blocks):
            self._calibrate_block(b, n, margin)
        self.quantized = True

    def _calibrate_block(self, b: int, n: int, margin: float) -> None:
        """Block b's scales from its first n slots, and those slots quantized, by
        calibrate_fp8 (the fused kernels or their reference; the slots past n are written by
        every chunk before it reads them). With shared stores a block whose FP8 bytes reach
        into its own wide bytes is copied out first."""
        k, v = self.k[b:b + 1, :, :n], self.v[b:b + 1, :, :n]
        if self.shared and (b + 1) * self.k8[b].nbytes > b * self.k[b].nbytes:
            k, v = k.clone(), v.clone()
        self.calibrate_fp8(k, v, self.k8[b:b + 1, :, :n], self.v8[b:b + 1, :, :, :n]
                           .transpose(2, 3), self.scale[b:b + 1], margin, fp8.FP8_MAX)
