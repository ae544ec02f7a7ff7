"""The characters family's rank assembly: one TP rank's model, cache and session from a rank
state, a Mapping, the engine's tables and GEMM plan, and the TP exchange. The builder's
warm-up, both workers, the benchmarks and the tests all assemble a rank here
(charengine/assemble.py is the family-agnostic entry)."""

from __future__ import annotations

from ..config import EngineConfig
from ..mapping import Mapping
from ..stepping import Session, session_of
from .cache import KVCache
from .model import CharacterDiT
from .spec import RankShape
from .step import FrameSteps, ar_step
from .weights import rank_weights


def rank_state(cfg: EngineConfig, full_state, rank: int = 0, keep_adaln: bool = True):
    """TP rank `rank`'s engine state (FP8 block linears cut to the rank) from a full state;
    with keep_adaln the AdaLN MLP weights too (the tables can then be baked from it)."""
    spec = cfg.model
    return rank_weights(spec, full_state, RankShape.of(spec, cfg.tp, rank), keep_adaln)


def rank_session(cfg: EngineConfig, state, mapping: Mapping, tables=None, gemm_plan=None,
                 exchange=None, graphed: bool | None = None, attention_tiles=None,
                 step_fn=None) -> Session:
    """Rank `mapping.rank`'s session on `mapping.device`. `state`: its engine state (the
    engine's rank file, or `rank_state`); `tables`: the baked AdaLN tables (baked from
    `state` when None); `gemm_plan`: the engine's per-shape GEMM choices for this rank (on a
    GPU); `exchange`: the TP group's fused GEMM + all-reduce (plugins/gemm_allreduce.py),
    given by a loader that has the group; `graphed`: steps replay captured CUDA graphs (by
    default on a GPU); `step_fn` another stepping of ar_step's signature (a compiled one)."""
    device = mapping.torch_device
    shape = RankShape.of(cfg.model, mapping.tp, mapping.rank)
    model = CharacterDiT(cfg, shape, state, mapping.all_reduce(), tables, device,
                         attention_tiles=attention_tiles, fused_gemm_allreduce=exchange,
                         gemm_plan=gemm_plan)
    return session_of(model, lambda: KVCache(cfg, shape.heads, device), FrameSteps(cfg),
                      ar_step, device, device.type == "cuda" if graphed is None else graphed,
                      step_fn)
