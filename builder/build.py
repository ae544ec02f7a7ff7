"""build(): shard, quantize and bake a target's engine into a directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from charengine.config import RankShape, config_to_dict
from charengine.engine_format import (ADALN, FORMAT_VERSION, MANIFEST, SIDE, rank_file, sha256,
                                      this_machine)
from charengine.model import bake_adaln
from charengine.sidenets import PREFIXES, SideNets, random_side_state
from charengine.target import Target
from charengine.weights import (load_checkpoint, param_shapes, quantize_block_linears,
                                random_weights, shard)


def build(target: Target, out: Path, weights: Path | None = None, seed: int | None = None,
          preset_name: str | None = None, log=print) -> dict:
    """Write the engine for `target` to `out` and return its manifest. Exactly one of
    `weights` (a safetensors checkpoint) and `seed` (random weights) is given."""
    if (weights is None) == (seed is None):
        raise ValueError("give either a checkpoint or a seed for random weights")
    cfg = target.config(preset_name)
    spec = cfg.model
    if weights is not None:
        state, side = load_checkpoint(weights, spec, PREFIXES)
        source = {"checkpoint": str(weights), "sha256": sha256(weights)}
    else:
        state, side = random_weights(spec, seed), {}
        source = {"random_seed": seed}
    if side and set(side) != set(SideNets(spec).state_dict()):
        raise ValueError(f"{weights}: side-network tensors are incomplete; give all of "
                         f"{', '.join(PREFIXES)} or none")
    side_source = "checkpoint" if side else f"random (seed {seed if seed is not None else 0})"
    if not side:
        side = random_side_state(spec, seed if seed is not None else 0)

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    qstate = quantize_block_linears(spec, state)
    for r in range(cfg.tp):
        save_file(shard(spec, qstate, RankShape.of(spec, cfg.tp, r)), str(tmp / rank_file(r)))
        log(f"rank {r}: {rank_file(r)}")
    table, final = bake_adaln(cfg, state)
    save_file({"adaln_table": table.contiguous(), "final_table": final.contiguous()},
              str(tmp / ADALN))
    save_file({k: v.contiguous() for k, v in side.items()}, str(tmp / SIDE))
    files = sorted(p.name for p in tmp.iterdir())
    manifest = {
        "format_version": FORMAT_VERSION,
        "target": target.to_dict(),
        "config": config_to_dict(cfg),
        "tp": cfg.tp,
        "rank_devices": target.rank_devices(),
        "built_with": this_machine(),
        "weights": source,
        "side_networks": side_source,
        "parameters": {"block_linears": spec.block_linear_params(),
                       "total_dit": sum(torch.Size(s).numel() for s in param_shapes(spec).values())},
        "files": {name: sha256(tmp / name) for name in files},
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return manifest
