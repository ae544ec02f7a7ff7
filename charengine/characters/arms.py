"""The characters family's benchmark arms: named variants of an EngineConfig that the
benchmarks run and compare (charengine/family.py, part 6).

- The waterfall (the paper's Figure 2): `baseline` (every switch off), then each switch of
  Switches.ORDER on in turn, the FP8 GEMMs at promoted sums throughout (as every bar was
  measured before fast accumulation became the default), and `production`, the config as it
  is, whose bar adds fast accumulation. The fused GEMM + all-reduce, the last switch, needs
  a TP group: it is an arm (`fused_gemm_allreduce`) but not a bar.
- Numerics: `fp32_plain` (the paper's plain path in fp32, no FP8), `fp32` (the write-time
  path in fp32), `bf16_cache` (the write-time path with a bf16 cache and FP8 GEMMs): a long
  session compares fp32 against fp32_plain (the write-time design's error alone) and
  production against bf16_cache (the FP8 cache's).
"""

from __future__ import annotations

import dataclasses

from .config import Switches

PRODUCTION, BASELINE = "production", "baseline"
NOT_A_BAR = ("fused_gemm_allreduce",)  # needs a TP group of GPUs
WATERFALL = (BASELINE, *(s for s in Switches.ORDER if s not in NOT_A_BAR), PRODUCTION)
OTHER = (*NOT_A_BAR, "fp32_plain", "fp32", "bf16_cache")
LABELS = {"baseline": "Baseline", "baked_adaln": "+AdaLN", "rope_at_write": "+RoPE@write",
          "ring_cache": "+Ring cache", "fp8_kv": "+FP8 KV", "conditioning_cache": "+Cond. cache",
          "fused_pre_attention": "+Fused pre-attn.", "fused_act_quant": "+Fused act. quant",
          "fp8_attention_kernel": "+FP8 attention", "fused_delta_rotation": "+Fused delta rot.",
          "fused_residual": "+Fused residual", "fused_calibration": "+Fused calib.",
          "production": "+Fast accum. = production"}


def waterfall() -> tuple[str, ...]:
    return WATERFALL


def arm_names() -> tuple[str, ...]:
    return WATERFALL + OTHER


def arm(cfg, name: str):
    """cfg (an EngineConfig of this family) as arm `name` runs it."""
    from ..config import Numerics

    if name == PRODUCTION:
        return cfg
    if name in (BASELINE, *Switches.ORDER):
        numerics = dataclasses.replace(cfg.numerics, fast_accum=False)
        return cfg.replace(switches=Switches.cumulative(name), numerics=numerics)
    fp32 = Numerics(dtype="float32", fp8_gemm=False, fp8_attention=False)
    if name == "fp32_plain":
        return cfg.replace(switches=Switches.baseline(), numerics=fp32)
    if name == "fp32":
        return cfg.replace(switches=Switches(fp8_kv=False), numerics=fp32)
    if name == "bf16_cache":
        return cfg.replace(switches=Switches(fp8_kv=False),
                           numerics=Numerics(dtype="bfloat16", fp8_gemm=True,
                                             fp8_attention=False))
    raise ValueError(f"unknown arm {name!r}; known: {', '.join(arm_names())}")


def label(name: str) -> str:
    return LABELS.get(name, f"+{name}")
