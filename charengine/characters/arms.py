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

from .config import LINEARS, Switches

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


# The numerics comparison (scripts/numerics_compare.py): the same session (weights, noise,
# audio, reference, prompt; eager steps) under each arm, compared with a reference arm.
#   fp32                the same weights (the FP8 ones dequantized) in fp32, no FP8 anywhere,
#                       the plain path of every kernel switch: the model the others approximate
#   default             the config as it is
#   precise             FP8 GEMMs promoting their partial sums to fp32
#   fast_accum          without, on both block linears
#   fast_accum_w_in     on the input projection only
#   bf16_gemm           the block linears in bf16 over the dequantized FP8 weights
#   attention_rounding  the FP8 attention kernel's other softmax evaluation (only roundings
#                       move): how far a change of roundings alone moves the latents
#   default_again       the config again: the comparison's floor (run to run)
NUMERICS = ("fp32", "default", "precise", "fast_accum", "fast_accum_w_in", "bf16_gemm",
            "attention_rounding", "default_again")
NUMERICS_REFERENCE = "default"  # the arms' default reference; fp32 the model's
PLAIN_UPTO = "conditioning_cache"  # the fp32 arm's switches: up to the kernels, cache in fp32
NUMERICS_VARIANTS = {
    "precise": {"fast_accum": False},
    "fast_accum": {"fast_accum": True, "fast_accum_linears": LINEARS},
    "fast_accum_w_in": {"fast_accum": True, "fast_accum_linears": ("w_in",)},
    "bf16_gemm": {"fp8_gemm": False},
}


def numerics_ladder() -> tuple[str, ...]:
    return NUMERICS


def numerics_weights(cfg, seed: int, device, rank: int) -> dict:
    """The rank's state made on the device and its tables (bench_rank's), with what the fp32
    arm makes its own from."""
    from .spec import RankShape

    state, tables = bench_rank(cfg, seed, device, rank)
    return {"state": state, "tables": tables, "seed": seed,
            "shape": RankShape.of(cfg.model, cfg.tp, rank)}


def numerics_session(cfg, name: str, weights: dict, device, rank: int):
    """An eager session of numerics arm `name` over `weights` (numerics_weights'), TP rank
    `rank` alone on the device."""
    import torch

    from ..assemble import rank_session
    from ..config import Numerics
    from ..mapping import Mapping
    from ..plugins.attention import AttentionTiles
    from .model import bake_adaln
    from .weights import random_rank_state

    if name not in NUMERICS:
        raise ValueError(f"unknown numerics arm {name!r}; known: {', '.join(NUMERICS)}")
    mapping = Mapping(cfg.tp, rank, str(device), str(device), alone=True)
    if name == "fp32":
        fp32 = Numerics(dtype="float32", fp8_gemm=False, fp8_attention=False)
        cfg32 = cfg.replace(numerics=fp32, switches=dataclasses.replace(
            Switches.cumulative(PLAIN_UPTO), fp8_kv=False))
        state, adaln_w = random_rank_state(cfg.model, weights["shape"], weights["seed"],
                                           device, torch.float32, keep_adaln_weights=False)
        return rank_session(cfg32, state, mapping, tables=bake_adaln(cfg32, adaln_w),
                            graphed=False)
    tiles = None
    if name == "attention_rounding":
        tiles = AttentionTiles(fma=not AttentionTiles().fma)
    elif name in NUMERICS_VARIANTS:
        cfg = cfg.replace(numerics=dataclasses.replace(cfg.numerics,
                                                       **NUMERICS_VARIANTS[name]))
    return rank_session(cfg, weights["state"], mapping, tables=weights["tables"],
                        graphed=False, attention_tiles=tiles)


# What the benchmarks count: a step's FLOPs and its kernels by kind (name fragment -> kind,
# the first match winning: pre-attention before attention)
KERNEL_GROUPS = (("nvjet", "fp8_gemm"), ("Memset", "fp8_gemm_memset"), ("gemm", "fp8_gemm"),
                 ("pre_attention", "pre_attention"), ("attention", "attention"),
                 ("swiglu", "act_quant"), ("norm_modulate", "act_quant"),
                 ("act_quant", "act_quant"), ("delta_rotation", "delta_rotation"))


def step_flops(cfg, rank: int) -> dict[str, float]:
    """FLOP of one AR step on TP rank `rank`: its block linears and its attention."""
    from .spec import RankShape

    spec, T = cfg.model, cfg.model.tokens_per_frame
    shape = RankShape.of(spec, cfg.tp, rank)
    calls = spec.n_blocks * cfg.schedule.passes
    gemm = 2 * T * spec.dim * (shape.in_proj_rows(spec) + shape.out_proj_cols(spec)) * calls
    slots = spec.global_tokens + cfg.cache.window * T
    return {"gemm": gemm, "attention": 4 * T * slots * shape.attn_width(spec) * calls}


def bench_rank(cfg, seed: int, device, rank: int) -> tuple[dict, dict]:
    """The rank's quantized state made directly on the device, one tensor at a time, and its
    AdaLN tables (the AdaLN weights, 10.6B parameters at characters-57b, kept only where
    the tables are not baked)."""
    import torch

    from .model import bake_adaln
    from .spec import RankShape
    from .weights import random_rank_state

    state, adaln_w = random_rank_state(cfg.model, RankShape.of(cfg.model, cfg.tp, rank), seed,
                                       device, getattr(torch, cfg.numerics.dtype),
                                       keep_adaln_weights=not cfg.switches.baked_adaln)
    return state, bake_adaln(cfg, adaln_w)
