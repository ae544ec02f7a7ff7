"""The KV caches of one rank: one allocation for all (block, pass) caches, each holding the
global slots and a window of latent frames; write position, temporal index and reset live on
the device. Both the paper's baseline handling and its write-time design are here.

Layout: [blocks * passes, heads, slots, head_dim], slots = global + window * tokens_per_frame.
Cache bp = block * passes + pass.

Baseline (all switches off): keys are cached before RoPE and every read re-ropes the whole
cache at positions taken from slot order; the window advances by copying (shift left); FP8
attention re-quantizes the whole cache per call with a per-tensor scale.
Write-time: RoPE is applied once before the write; a ring of `window` frames is written at
slot (step mod window) with index_copy_; at each reset the window keys are delta-rotated;
K and V are stored FP8 with per-(cache, head) scales set once per session.
"""

from __future__ import annotations

import torch

from .. import fp8
from ..config import EngineConfig
from .rope import RopeTables
from ..rope import cos_sin, rotate, rotate_temporal_f32


class KVCache(torch.nn.Module):
    def __init__(self, cfg: EngineConfig, heads: int, device="cpu"):
        super().__init__()
        spec, cc = cfg.model, cfg.cache
        self.cfg = cfg
        self.G, self.T, self.W = spec.global_tokens, spec.tokens_per_frame, cc.window
        self.S = self.G + self.W * self.T
        self.bp = spec.n_blocks * cfg.schedule.passes
        self.heads = heads
        self.ring = cfg.switches.ring_cache
        self.fp8_kv = cfg.switches.fp8_kv
        dtype = getattr(torch, cfg.numerics.dtype)
        shape = (self.bp, heads, self.S, spec.head_dim)
        # The unquantized cache: the baseline's, the bf16-cache arm's, and the FP8 arm's first
        # calibration_steps steps (scales come from its amax).
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        if self.fp8_kv:
            self.register_buffer("k8", torch.zeros(shape, dtype=fp8.FP8, device=device),
                                 persistent=False)
            # With the FP8 attention kernel, values are stored [heads, head_dim, slots] (slots
            # padded to TMA's 16-byte rows), so P V is an FP8 dot with V K-major; `v8` is
            # always the [bp, heads, slots, head_dim] view.
            from ..plugins.attention import TMA_ROW_BYTES

            self.v_transposed = cfg.switches.fp8_attention_kernel
            vshape = (self.bp, heads, spec.head_dim, self.S + (-self.S % TMA_ROW_BYTES)) \
                if self.v_transposed else shape
            self.register_buffer("v8_store", torch.zeros(vshape, dtype=fp8.FP8, device=device),
                                 persistent=False)
            self.register_buffer("scale", torch.ones(self.bp, 2, heads, 1, 1, device=device),
                                 persistent=False)
        self.register_buffer("step", torch.zeros((), dtype=torch.long, device=device),
                             persistent=False)
        self.register_buffer("frame_slots", torch.arange(self.T, device=device), persistent=False)
        self.register_buffer("window_frames", torch.arange(self.W, device=device),
                             persistent=False)
        # Host-side phase, changed once per session between steps (never read from the device).
        self.quantized = False
        from ..plugins import calibrate, delta_rotation
        self.rotate_fp8 = delta_rotation.select() \
            if cfg.switches.fused_delta_rotation and self.fp8_kv else delta_rotation.reference
        self.calibrate_fp8 = calibrate.select() \
            if cfg.switches.fused_calibration and self.fp8_kv else calibrate.reference

    @property
    def v8(self) -> torch.Tensor:
        """FP8 values [bp, heads, slots, head_dim], whatever the storage order."""
        if self.v_transposed:
            return self.v8_store[..., : self.S].transpose(-1, -2)
        return self.v8_store

    # ---- positions, all derived on the device from the AR step counter --------------------
    def write_frame(self) -> torch.Tensor:
        """Window frame slot the current step writes (ring: step mod window; shift: last)."""
        if self.ring:
            return self.step % self.W
        return torch.full_like(self.step, self.W - 1)

    def temporal_index(self) -> torch.Tensor:
        cc = self.cfg.cache
        return cc.first_temporal_index + self.step % cc.reset_period

    def slot_order_temporal(self) -> torch.Tensor:
        """Temporal index of each window frame slot as the baseline computes it at read: slot
        order is taken as chronological order (true only for the shift-left window)."""
        return self.temporal_index() - (self.W - 1 - self.window_frames)

    def valid_mask(self) -> torch.Tensor:
        """[S] bool: slots holding data while the window fills (the first window-1 steps)."""
        i = self.window_frames
        frames = i <= self.step if self.ring else i >= (self.W - 1 - self.step)
        return torch.cat([torch.ones(self.G, dtype=torch.bool, device=i.device),
                          frames.repeat_interleave(self.T)])

    # ---- session and step boundaries ------------------------------------------------------
    def new_session(self) -> None:
        self.k.zero_()
        self.v.zero_()
        self.step.zero_()
        if self.fp8_kv:
            self.k8.zero_()
            self.v8_store.zero_()
            self.scale.fill_(1.0)
        self.quantized = False

    def end_step(self) -> None:
        self.step.add_(1)

    def advance_window(self) -> None:
        """Baseline: shift every cache's window left by one frame (two overlapping copies)."""
        G, T = self.G, self.T
        self.k[:, :, G:-T] = self.k[:, :, G + T:].clone()
        self.v[:, :, G:-T] = self.v[:, :, G + T:].clone()

    def calibrate(self) -> None:
        """FP8 KV: scales from the amax of the unquantized cache (per cache, K/V and head)
        times the margin; the whole cache moves to FP8; values beyond saturate
        (plugins/calibrate.py: two kernels over every cache with fused_calibration)."""
        cc = self.cfg.cache
        self.calibrate_fp8(self.k, self.v, self.k8, self.v8, self.scale, cc.scale_margin,
                           cc.fp8_max)
        self.quantized = True

    def delta_rotate(self, rope: RopeTables) -> None:
        """At a reset, before any block reads: rotate every cached window key's temporal pairs
        by omega_j * delta, in fp32. FP8: dequantize with the head's scale, rotate, clamp,
        requantize with the same scale (plugins/delta_rotation.py: one kernel for every cache
        with fused_delta_rotation). Values and global keys are untouched. The unquantized
        cache goes one cache at a time, so fp32 temporaries stay one cache's size."""
        G, delta = self.G, float(self.cfg.cache.delta)
        if self.quantized:
            self.rotate_fp8(self.k8, self.scale[:, 0], G, rope.omega_t, delta)
            return
        for bp in range(self.bp):
            win = self.k[bp, :, G:].float()
            self.k[bp, :, G:] = rotate_temporal_f32(win, rope.omega_t, delta).to(self.k.dtype)

    # ---- writes and reads ------------------------------------------------------------------
    def write_global(self, bp: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[bp, :, : self.G] = k
        self.v[bp, :, : self.G] = v

    def frame_index(self) -> torch.Tensor:
        """Slot indices [T] of the frame the current step writes."""
        return self.G + self.write_frame() * self.T + self.frame_slots

    def write(self, bp: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the new frame's K/V [heads, T, D] at the device-side write position."""
        idx = self.frame_index()
        if self.quantized:
            fp8.index_copy_(self.k8[bp], 1, idx, fp8.quantize(k, self.scale[bp, 0]))
            fp8.index_copy_(self.v8[bp], 1, idx, fp8.quantize(v, self.scale[bp, 1]))
        else:
            fp8.index_copy_(self.k[bp], 1, idx, k)
            fp8.index_copy_(self.v[bp], 1, idx, v)

    def read(self, bp: int, key_cos_sin=None) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [heads, S, D] for attention, in the compute dtype.

        key_cos_sin: the baseline's per-read RoPE of the whole cache (cos, sin [S, D/2]).
        FP8 attention is emulated here by dequantizing (write-time: per-head scales) or by
        the baseline's per-call, per-tensor re-quantization."""
        if self.quantized:
            dt = self.k.dtype
            return (fp8.dequantize(self.k8[bp], self.scale[bp, 0], dt),
                    fp8.dequantize(self.v8[bp], self.scale[bp, 1], dt))
        k, v = self.k[bp], self.v[bp]
        if key_cos_sin is not None:
            k = rotate(k, *key_cos_sin)
        if self.cfg.numerics.fp8_attention and not self.fp8_kv:
            k, v = fp8.quant_dequant_per_tensor(k), fp8.quant_dequant_per_tensor(v)
        return k, v

    def key_angles(self, rope: RopeTables) -> torch.Tensor:
        """Baseline: angles [S, D/2] of every slot, window frames at slot-order positions."""
        return torch.cat([rope.global_angles(), rope.frames_angles(self.slot_order_temporal())])

    def key_cos_sin(self, rope: RopeTables):
        return cos_sin(self.key_angles(rope))
