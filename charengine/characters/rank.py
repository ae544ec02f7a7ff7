"""One TP rank's model, cache and session from a full-precision state (for tests, benchmarks
and the builder's checks; engines load prebuilt rank states instead)."""

from __future__ import annotations

from .cache import KVCache
from .config import EngineConfig, RankShape
from .model import CharacterDiT, identity
from .step import Session, ar_step
from .weights import quantize_block_linears, shard


def rank_state(cfg: EngineConfig, full_state, rank: int = 0):
    spec = cfg.model
    return shard(spec, quantize_block_linears(spec, full_state), RankShape.of(spec, cfg.tp, rank))


def make_session(cfg: EngineConfig, state, rank: int = 0, all_reduce=identity, device="cpu",
                 step_fn=ar_step, adaln_tables=None, gemm_plan=None) -> Session:
    """`state` is a rank state (rank_state)."""
    shape = RankShape.of(cfg.model, cfg.tp, rank)
    model = CharacterDiT(cfg, shape, state, all_reduce, adaln_tables, device,
                         gemm_plan=gemm_plan)
    return Session(model, KVCache(cfg, shape.heads, device), step_fn)
