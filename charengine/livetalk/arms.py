"""The LiveTalk family's benchmark arms (charengine/family.py, part 6), from spec.py's data:
the waterfall (spec.waterfall_arms: the plain path in bf16 without FP8, each switch of ORDER
on in turn, FP8 GEMMs right before the FP8 cache, the preset last as `production`) and the
benchmark arms of spec.ARMS (`preset`, `plain`: the same config as the waterfall's first
bar, `bf16`: every switch with bf16 GEMMs and cache)."""

from __future__ import annotations

from .spec import (ARMS, WATERFALL_FP8_GEMM, WATERFALL_PLAIN, WATERFALL_PRODUCTION, arm_config,
                   waterfall_arms, waterfall_config)

LABELS = {WATERFALL_PLAIN: "Plain (bf16)", "baked_adaln": "+AdaLN tables",
          "text_kv_once": "+Text K/V once", "ring_cache": "+Ring cache (graphs)",
          "rope_tables": "+RoPE tables", "position_reset": "+Position reset",
          WATERFALL_FP8_GEMM: "+FP8 GEMMs", "fp8_kv": "+FP8 KV + attention",
          "fused_qkv": "+Fused QKV", "fused_act_quant": "+Fused act. quant",
          "gemm_bias": "+Bias in GEMM", "fused_pre_attention": "+Fused pre-attn.",
          "fused_residual": "+Fused residual", "fused_gelu_quant": "+Fused GELU quant",
          "fused_q_norm": "+Fused q norm", "skip_commit_tail": "+Skip commit tail",
          "graph_fill_chunks": "+Graphed fill chunks", "shared_kv_stores": "+Shared K/V stores",
          "fused_wide_pre_attention": "+Fused bf16 pre-attn.",
          "fused_calibration": "+Fused calibration",
          "fused_delta_rotation": "+Fused delta rotation",
          "split_attention": "+Split attention grid",
          "pipelined_attention": "+Pipelined attention",
          "fp8_cross_attention": "+FP8 cross-attention",
          "patch_gemm": "+Patch embedding GEMM",
          WATERFALL_PRODUCTION: "+Fast accum. = production"}


def waterfall() -> tuple[str, ...]:
    return waterfall_arms()


def arm_names() -> tuple[str, ...]:
    return tuple(dict.fromkeys(waterfall_arms() + ARMS))


def arm(cfg, name: str):
    """cfg (an EngineConfig of this family) as arm `name` runs it."""
    if name in ARMS:
        return arm_config(cfg, name)
    if name in waterfall_arms():
        return waterfall_config(cfg, name)
    raise ValueError(f"unknown arm {name!r}; known: {', '.join(arm_names())}")


def label(name: str) -> str:
    """The bar's label; a switch added to ORDER since reads as its name."""
    return LABELS.get(name, f"+{name}")
