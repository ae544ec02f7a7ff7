"""The LiveTalk family's assembly of its one rank: model, cache and session from an engine
state, a Mapping, the baked tables and the GEMM plan; the GEMMs the builder chooses for;
the tables baked for the fixed schedule."""

from __future__ import annotations

import dataclasses

import torch

from ..family import GemmProblem
from ..mapping import Mapping
from ..stepping import Session, session_of
from .cache import ChunkCache
from .model import LiveTalkDiT, fuse_qkv
from .step import ChunkSteps, chunk_step, chunk_steps
from .weights import rank_weights

# linear kind -> a block's linears of that kind (each kind is one GEMM shape); with
# fused_qkv the self-attention's q, k, v are one linear of its own kind
KINDS = {"attn": ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q",
                  "cross_attn.o"),
         "ffn_up": ("ffn.0",), "ffn_down": ("ffn.2",)}
FUSED_KINDS = {"qkv": ("self_attn.qkv",),
               "attn": ("self_attn.o", "cross_attn.q", "cross_attn.o"),
               "ffn_up": ("ffn.0",), "ffn_down": ("ffn.2",)}


def kinds(cfg) -> dict[str, tuple[str, ...]]:
    return FUSED_KINDS if cfg.switches.fused_qkv else KINDS


def bake_tables(cfg, state) -> dict[str, torch.Tensor]:
    """Every pass's AdaLN and head modulation, computed by the plain path on the CPU from
    the full-precision state (the engine's ADALN file)."""
    dt = getattr(torch, cfg.numerics.dtype)
    plain = cfg.replace(switches=dataclasses.replace(cfg.switches, baked_adaln=False))
    weights = {k: v for k, v in state.items() if not k.startswith("blocks.") or
               k.endswith(".modulation")}
    model = LiveTalkDiT(plain, {k: v.to(dt) for k, v in weights.items()}, "cpu")
    return model.bake_tables()


def rank_session(cfg, state, mapping: Mapping, tables=None, gemm_plan=None,
                 graphed: bool | None = None, step_fn=None) -> Session:
    """The session on `mapping.device`: `state` the engine state (or rank_weights of a full
    state), `tables` the baked modulation (baked from `state` when None), `gemm_plan` the
    engine's GEMM choice per linear kind (on a GPU), `graphed` steady chunks replay CUDA
    graphs (by default on a GPU)."""
    device = mapping.torch_device
    dt = getattr(torch, cfg.numerics.dtype)
    model = LiveTalkDiT(cfg, state, device, tables, gemm_plan)
    return session_of(model, lambda: ChunkCache(cfg, device, dt), ChunkSteps(cfg), chunk_step,
                      device, device.type == "cuda" if graphed is None else graphed, step_fn,
                      batch_step=chunk_steps)


def gemm_problems(cfg, state, mapping) -> dict:
    """Each FP8 linear kind at the steady shape (M = a chunk's tokens) over every block's
    weights of that kind; none without FP8 GEMMs."""
    spec = cfg.model
    if not cfg.numerics.fp8_gemm:
        return {}
    if cfg.switches.fused_qkv:
        state = fuse_qkv(state, spec.n_blocks)
    return {kind: GemmProblem("plain", [(state[f"blocks.{i}.{n}.weight"],
                                         state[f"blocks.{i}.{n}.weight_scale"])
                                        for i in range(spec.n_blocks) for n in names],
                              spec.chunk_tokens, fast_accum=cfg.numerics.fast_accum)
            for kind, names in kinds(cfg).items()}


__all__ = ["bake_tables", "gemm_problems", "rank_session", "rank_weights"]
