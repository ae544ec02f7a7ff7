"""The one assembly of a TP rank, for any model family: its model, cache and session from a
rank state and a Mapping (charengine/family.py). The builder's warm-up, charrun's workers,
the benchmarks and the tests call this."""

from __future__ import annotations

from .config import EngineConfig
from .family import family_of
from .mapping import Mapping


def rank_session(cfg: EngineConfig, state, mapping: Mapping, tables=None, gemm_plan=None,
                 exchange=None, graphed: bool | None = None, **family_options):
    """Rank `mapping.rank` of `cfg` on `mapping.device`: `state` its engine state, `tables`
    the family's baked tables, `gemm_plan` the engine's GEMM choices for the rank, `exchange`
    the TP group's fused exchange; `graphed` steps replay CUDA graphs (default: on a GPU)."""
    return family_of(cfg).rank_session(cfg, state, mapping, tables=tables, gemm_plan=gemm_plan,
                                       exchange=exchange, graphed=graphed, **family_options)


def rank_state(cfg: EngineConfig, full_state, rank: int = 0, keep_adaln: bool = True):
    """TP rank `rank`'s engine state from a full-precision state (tests, benchmarks)."""
    return family_of(cfg).rank_state(cfg, full_state, rank, keep_adaln)
