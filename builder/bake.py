"""Compile a GPU engine's kernels: a warm-up session of one rank, loaded from the engine
being built exactly as charrun loads it, with Triton's cache pointed into the engine.

Run by build() in a fresh process (`python -m charengine.builder.bake DIR RANK`), so that
nothing compiled earlier in the builder's process hides a kernel from the engine's cache.
Prints one JSON line: warm-up steps, kernels compiled and kernels found already there."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

from charengine.config import config_from_dict
from charengine.engine_format import ADALN, MANIFEST, TRITON_KERNELS, rank_file
from charengine.graphs import GraphedStep
from charengine.kernel_cache import KernelCache
from charengine.rank import make_session
from charengine.warmup import warm_up


def bake(engine: Path, rank: int) -> dict:
    cfg = config_from_dict(json.loads((engine / MANIFEST).read_text())["config"])
    t0 = time.perf_counter()
    with KernelCache(engine / TRITON_KERNELS) as cache:
        state = load_file(str(engine / rank_file(rank)), device="cuda")
        tables = load_file(str(engine / ADALN), device="cuda")
        session = make_session(cfg, state, rank, device="cuda", step_fn=GraphedStep(),
                               adaln_tables=(tables["adaln_table"], tables["final_table"]))
        steps = warm_up(session)
    return {"rank": rank, "steps": steps, "seconds": round(time.perf_counter() - t0, 2),
            "compiled": sorted(cache.compiled), "found": sorted(cache.loaded)}


if __name__ == "__main__":
    print(json.dumps(bake(Path(sys.argv[1]), int(sys.argv[2]))))
