"""The LiveTalk family's benchmark arms (charengine/family.py, part 6), from spec.py's data:
the waterfall (spec.waterfall_arms: the plain path in bf16 without FP8, each switch of ORDER
on in turn, FP8 GEMMs right before the FP8 cache, the preset last as `production`) and the
benchmark arms of spec.ARMS (`preset`, `plain`: the same config as the waterfall's first
bar, `bf16`: every switch with bf16 GEMMs and cache), and the numerics comparison's ladder."""

from __future__ import annotations

import dataclasses

from .spec import (ARMS, FP8_CACHE, WATERFALL_FP8_GEMM, WATERFALL_PLAIN, WATERFALL_PRODUCTION,
                   LiveTalkSwitches, arm_config, waterfall_arms, waterfall_config)

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


# The numerics comparison (scripts/numerics_compare.py): how far each switch that changes
# numerics moves the output against the fp32 plain path on the same weights (block linears
# FP8 as the engine stores them; the arms without FP8 GEMMs run those weights dequantized).
# Each cumulative on the one before from `bf16` on:
#   fp32_plain        the reference: fp32 activations and cache, no FP8, every kernel switch
#                     off (the position reset on: the positions are the same in every arm)
#   bf16_plain        the same path in bf16
#   bf16              every switch but the FP8 cache and the fused kernels, bf16 GEMMs
#   fp8_gemm          + FP8 GEMMs (per-token activations, promoted sums)
#   fp8_kv            + the FP8 KV cache and FP8 attention over it
#   fused             + the fused kernels (the fused_* switches of ORDER that change
#                     roundings, and the bias in the GEMM's epilogue)
#   production        the preset as it is (fast accumulation with it)
#   production_again  the preset run again: the comparison's floor (run to run)
NUMERICS_REFERENCE, NUMERICS_CONTROL = "fp32_plain", "production_again"
NUMERICS = (NUMERICS_REFERENCE, "bf16_plain", "bf16", "fp8_gemm", "fp8_kv", "fused",
            WATERFALL_PRODUCTION, NUMERICS_CONTROL)
SEMANTIC = ("position_reset",)  # switches that change what is computed: on in every arm
# fused_* switches that compute the same products and sums as the unfused path (one GEMM of
# the concatenated q, k, v weights): on from the `bf16` arm
SAME_SUMS = ("fused_qkv",)


def numerics_ladder() -> tuple[str, ...]:
    return NUMERICS


def fused_switches() -> tuple[str, ...]:
    """The switches of the `fused` arm, from ORDER as it is now."""
    return tuple(n for n in LiveTalkSwitches.ORDER
                 if n.startswith("fused_") and n not in SAME_SUMS) + ("gemm_bias",)


def numerics_config(base, name: str):
    """The config of numerics arm `name` on the preset `base`."""
    from ..config import Numerics

    fp32 = Numerics(dtype="float32", fp8_gemm=False, fp8_attention=False, fast_accum=False)
    bf16 = dataclasses.replace(fp32, dtype="bfloat16")
    if name not in NUMERICS:
        raise ValueError(f"unknown numerics arm {name!r}; known: {', '.join(NUMERICS)}")
    if name in (WATERFALL_PRODUCTION, NUMERICS_CONTROL):
        return base
    if name in (NUMERICS_REFERENCE, "bf16_plain"):
        switches = dataclasses.replace(LiveTalkSwitches.baseline(), **{n: True for n in SEMANTIC})
        return base.replace(switches=switches, numerics=fp32 if name == NUMERICS_REFERENCE
                            else bf16)
    steps = NUMERICS[NUMERICS.index("bf16"):NUMERICS.index(name) + 1]
    off = set() if "fused" in steps else set(fused_switches())
    if "fp8_kv" not in steps:
        off.add(FP8_CACHE)
    switches = dataclasses.replace(base.switches, **{n: False for n in off})
    numerics = dataclasses.replace(bf16, fp8_gemm="fp8_gemm" in steps,
                                   fp8_attention="fp8_kv" in steps)
    return base.replace(switches=switches, numerics=numerics)


def numerics_weights(cfg, seed: int, device, rank: int) -> dict:
    """The random checkpoint made on the device, and its block linears' FP8 quantization
    dequantized (the weights the arms without FP8 GEMMs run)."""
    from .. import fp8
    from .weights import block_linears, device_random_weights

    full = device_random_weights(cfg.model, seed, device)
    dq = dict(full)
    for base in block_linears(cfg.model):
        q, scale = fp8.quantize_rows(full[f"{base}.weight"].float())
        dq[f"{base}.weight"] = fp8.dequantize(q, scale)
    return {"full": full, "dequantized": dq}


def numerics_session(cfg, name: str, weights: dict, device, rank: int):
    """An eager session of numerics arm `name` (one GPU: rank 0)."""
    from ..assemble import rank_session
    from ..mapping import Mapping
    from . import FAMILY

    arm_cfg = numerics_config(cfg, name)
    full = weights["full"] if arm_cfg.numerics.fp8_gemm else weights["dequantized"]
    return rank_session(arm_cfg, FAMILY.rank_state(arm_cfg, full), Mapping.single(str(device)),
                        tables=FAMILY.bake_tables(arm_cfg, full), graphed=False)


# What the benchmarks count: a chunk's FLOPs and its kernels by group (name fragment ->
# group, the first match winning)
KERNEL_GROUPS = (("pre_attention", "pre-attention"), ("attention_tma_kernel", "fp8 attention"),
                 ("attention_kernel", "fp8 attention"), ("attention_split", "fp8 attention"),
                 ("attention_merge", "fp8 attention"), ("attention_pipelined", "fp8 attention"),
                 ("flash", "sdpa attention"), ("fmha", "sdpa attention"),
                 ("cudnn", "sdpa attention"), ("nvjet", "gemm"), ("gemm", "gemm"),
                 ("sm90_xmma", "gemm"), ("cutlass", "gemm"), ("quant", "quantization"),
                 ("norm", "norms"), ("index", "cache write"), ("elementwise", "elementwise"),
                 ("reduce", "reductions"), ("cat", "copies"), ("copy", "copies"))


def step_flops(cfg, rank: int) -> dict[str, float]:
    """A steady chunk's GEMM and self-attention FLOP (its passes and the commit pass)."""
    spec = cfg.model
    T, d, f, L = spec.chunk_tokens, spec.dim, spec.ffn_dim, spec.n_blocks
    forwards = cfg.schedule.passes + 1
    gemm = 2 * T * L * (4 * d * d + 2 * d * d + 2 * d * f) * forwards
    S = spec.cache_frames * spec.frame_tokens
    return {"gemm": gemm, "attention": 4 * T * S * spec.head_dim * spec.n_heads * L * forwards}


def bench_rank(cfg, seed: int, device, rank: int) -> tuple[dict, dict]:
    """The engine state and tables of random weights drawn fast on the device."""
    from . import FAMILY
    from .weights import device_random_weights

    full = device_random_weights(cfg.model, seed, device)
    return FAMILY.rank_state(cfg, full), FAMILY.bake_tables(cfg, full)
