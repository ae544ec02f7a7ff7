"""The characters family's configuration types: its cache geometry, schedule and switches
(its `config_types` in an EngineConfig), and its invalid combinations."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .. import fp8

LINEARS = ("w_in", "w_out")  # the block linears: input (q, k, v, gate, up) and output


@dataclass(frozen=True)
class CacheSpec:
    """Geometry of each (block, pass) KV cache: global slots + a window of latent frames.

    A window frame written at AR step k has temporal index window + 1 + (k mod reset_period);
    every reset_period steps the cached window keys move by -reset_period (the delta rotation),
    so indices stay in [2, window + reset_period]. Global tokens have temporal index 0.
    """

    window: int = 6
    reset_period: int = 42
    calibration_steps: int = 6  # FP8 KV scales are set on entering step calibration_steps + 1
    scale_margin: float = 1.5
    fp8_max: float = fp8.FP8_MAX  # e4m3's largest value, from the one place the kernels use

    @property
    def first_temporal_index(self) -> int:
        return self.window + 1

    @property
    def delta(self) -> int:
        return -self.reset_period


@dataclass(frozen=True)
class Schedule:
    """The fixed flow-matching schedule: one denoising pass per sigma, Euler steps to 0."""

    sigmas: tuple[float, ...] = (1.0, 0.75, 0.5, 0.25)

    @property
    def passes(self) -> int:
        return len(self.sigmas)

    def next_sigma(self, p: int) -> float:
        return self.sigmas[p + 1] if p + 1 < self.passes else 0.0


@dataclass(frozen=True)
class Switches:
    """One switch per optimization, in the order of the paper's Figure 2. All off is the
    paper's baseline; each plain path stays runnable and tested against the fast one."""

    baked_adaln: bool = True  # modulation table [pass, block, 3, d] instead of a per-call MLP
    rope_at_write: bool = True  # RoPE on new Q/K once, instead of the whole cache per call
    ring_cache: bool = True  # ring of window slots at a device write position, not shift-left
    fp8_kv: bool = True  # K/V stored FP8 with per-(block, head) scales, not requantized per call
    delta_rotation: bool = True  # rotate cached window keys by omega * delta at each reset
    conditioning_cache: bool = True  # RoPE tables and conditioning built once per step
    fused_pre_attention: bool = True  # norm + RoPE + quantize + ring write in one plugin op
    fused_act_quant: bool = True  # norm/modulate or SwiGLU + per-token FP8 quant in one kernel
    # These act where there is something to act on: an FP8 cache, a delta rotation.
    fp8_attention_kernel: bool = True  # FP8 dots over the FP8 ring, no per-call dequantization
    fused_delta_rotation: bool = True  # the reset's rotation of every FP8 cache in one kernel
    fused_residual: bool = True  # gated residual add inside the next block's norm + quant
    fused_calibration: bool = True  # FP8 KV calibration of every cache in two kernels
    fused_gemm_allreduce: bool = True  # output projection GEMM and TP all-reduce fused
    # The gated residual add in the output projection's epilogue (the C input of cuBLASLt or
    # QuACK, as the GEMM plan says; the AdaLN gate folded into the weight scale per pass),
    # taking over from fused_residual where the GEMMs are FP8 and AdaLN is baked. Off: with
    # cuBLASLt it moves time from activation quantization into the GEMMs and leaves the TP-3
    # step where it was (docs/PERFORMANCE_LOG.md, "The residual add in the GEMM epilogue"); on
    # with gemm_swiglu in the target h100-tp3-quack. Not a waterfall arm.
    gemm_residual: bool = False
    # SwiGLU in the input projection's epilogue, with each row's |max| (QuACK; the projection
    # split into a q/k/v GEMM and a (gate, up)-paired one), the FP8 attention kernel giving
    # its rows' |max| too, and the output projection's input quantized with no row reduction
    # (plugins/quack_gemm.py, plugins/act_quant.concat_quant_reference); measured with
    # gemm_residual in docs/PERFORMANCE_LOG.md, "The block's quantizations in the GEMM
    # epilogues". Needs quack-kernels on a GPU, an optional extra, so it is off but in the
    # target h100-tp3-quack; the plain path is the references, on any device. Not a
    # waterfall arm.
    gemm_swiglu: bool = False

    # Figure 2's order; the FP8 attention kernel and the fused delta rotation (the paper's
    # baseline already had FP8 attention, and it does not break out the reset) come last
    # before the fused all-reduce; the fused residual add and the fused calibration (ours, the
    # latter acting on the session's one calibration step) after them. Switches off by
    # default are not arms (cumulative leaves them at their default).
    ORDER = ("baked_adaln", "rope_at_write", "ring_cache", "fp8_kv", "conditioning_cache",
             "fused_pre_attention", "fused_act_quant", "fp8_attention_kernel",
             "fused_delta_rotation", "fused_residual", "fused_calibration",
             "fused_gemm_allreduce")

    @classmethod
    def baseline(cls) -> "Switches":
        return cls(**{f.name: False for f in dataclasses.fields(cls)})

    @classmethod
    def cumulative(cls, upto: str) -> "Switches":
        """Baseline plus every switch in ORDER up to and including `upto` (the waterfall arms).
        RoPE at write brings the delta rotation with it."""
        if upto == "baseline":
            return cls.baseline()
        on = cls.ORDER[: cls.ORDER.index(upto) + 1]
        kw = {name: name in on for name in cls.ORDER}
        kw["delta_rotation"] = kw["rope_at_write"]
        return cls(**kw)


def check_characters(cfg) -> None:
    """The characters family's invalid combinations, each one line saying what to change."""
    s, c = cfg.switches, cfg.cache
    if s.ring_cache and not s.rope_at_write:
        raise ValueError(
            "ring_cache=True needs rope_at_write=True: re-applying RoPE at read in slot order "
            "permutes the temporal positions of cached frames once the ring wraps "
            "(paper §4.1). Turn rope_at_write on or ring_cache off.")
    if s.rope_at_write != s.delta_rotation:
        raise ValueError(
            "rope_at_write and delta_rotation go together: keys cached after RoPE need the "
            "delta rotation at each reset, and without RoPE at write there is nothing to "
            f"rotate. Set both to {s.rope_at_write or s.delta_rotation}.")
    if s.fused_pre_attention and not s.rope_at_write:
        raise ValueError(
            "fused_pre_attention=True applies RoPE to keys at write: it needs "
            "rope_at_write=True (or set fused_pre_attention=False).")
    if s.fp8_kv and not cfg.numerics.fp8_attention:
        raise ValueError(
            "fp8_kv=True stores K/V for FP8 attention: set numerics.fp8_attention=True, "
            "or fp8_kv=False for a bf16 cache.")
    if c.window > c.reset_period:
        raise ValueError(
            f"cache.window {c.window} is longer than cache.reset_period {c.reset_period}: a "
            "key would be delta-rotated twice. Use a window <= the reset period.")
    unknown = [x for x in cfg.numerics.fast_accum_linears or () if x not in LINEARS]
    if unknown:
        raise ValueError(f"numerics.fast_accum_linears: unknown {unknown}; known: "
                         f"{', '.join(LINEARS)}")
    if c.calibration_steps < 1:
        raise ValueError("cache.calibration_steps must be at least 1")
    cfg.model.check_tp(cfg.tp)
