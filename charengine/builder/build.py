"""build(): shard, quantize and bake a target's engine into a directory; for a GPU target,
compile every kernel a session runs on the target GPU into it."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from charengine.checkpoint import checkpoint_files
from charengine.config import config_to_dict
from charengine.engine_format import (ADALN, FORMAT_VERSION, MANIFEST, ONNX, QUACK_KERNELS,
                                      SIDE, TRITON_KERNELS, checksums, engine_files, gpu_arch,
                                      rank_file, sha256, this_machine)
from charengine.family import family_of
from charengine.lora import merge_lora, read_lora
from charengine.target import Target

from .build_config import BuildConfig
from .onnx_export import export_onnx, require_onnx
from .output import Staging
from .so_check import StaticLibstdcxx, check_shared_objects


class BuildError(ValueError):
    pass


def checkpoint_sha256(path: Path) -> str:
    """A checkpoint's digest for the manifest: its file's sha256, or for shards the sha256
    of the index's and each shard's sha256 in turn."""
    files = checkpoint_files(path)
    if len(files) == 1:
        return sha256(files[0])
    h = hashlib.sha256()
    for f in files:
        h.update(sha256(f).encode())
    return h.hexdigest()


def build_device(target: Target, kernels: bool) -> torch.device:
    """Where the builder quantizes and warms up: the target's GPU kind for a GPU target whose
    kernels are compiled (they are compiled for the GPU they run on), else the CPU."""
    if target.device != "cuda" or not kernels:
        return torch.device("cuda" if target.device == "cuda" and torch.cuda.is_available()
                            else "cpu")
    here = gpu_arch() if torch.cuda.is_available() else None
    if here != target.gpu_arch:
        has = f"a {torch.cuda.get_device_name(0)} ({here})" if here else "no CUDA GPU"
        raise BuildError(f"target {target.name} runs on {target.gpu_arch}: its kernels are "
                         f"compiled on that GPU and this machine has {has}; build it there, or "
                         "pass --no-kernels (charrun then compiles them at every start)")
    return torch.device("cuda")


def bake_kernels(engine: Path, rank: int, log) -> dict:
    """Compile the kernels of `rank`'s model into the engine (builder/bake.py, in a fresh
    process)."""
    r = subprocess.run([sys.executable, "-m", "charengine.builder.bake", str(engine), str(rank)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        tail = "\n".join(r.stderr.strip().splitlines()[-20:])
        raise BuildError(f"rank {rank}: the kernel warm-up failed:\n{tail}")
    result = json.loads(r.stdout.strip().splitlines()[-1])
    plan = ", ".join(f"{k} {c} ({result['gemm_us'][k][c]:.1f} us)"
                     for k, c in result["gemm_plan"].items())
    log(f"rank {rank}: {len(result['compiled'])} kernels compiled in a {result['steps']}-step "
        f"warm-up ({result['seconds']:.1f} s)" + (f"; GEMM per shape: {plan}" if plan else ""))
    return result


def uses_quack(cfg, warm) -> dict | None:
    """Where the engine runs QuACK's GEMMs (its plan names them, or gemm_swiglu is on): the
    quack-kernels version its objects were compiled with (charrun needs the same), else
    None."""
    planned = any(c.startswith("quack") for w in warm for c in w["gemm_plan"].values())
    if not (planned or family_of(cfg).quack_epilogues(cfg)):
        return None
    from importlib.metadata import version

    return {"dir": QUACK_KERNELS, "version": version("quack-kernels"),
            "cutlass_dsl": version("nvidia-cutlass-dsl")}


def manifest_of(target: Target, cfg, ranks, source, side_source, kernels, files) -> dict:
    spec, fam = cfg.model, family_of(cfg)
    return {
        "format_version": FORMAT_VERSION,
        "target": target.to_dict(),
        "config": config_to_dict(cfg),
        "tp": cfg.tp,
        "ranks": ranks,
        "rank_devices": target.rank_devices(),
        "built_with": this_machine(),
        "weights": source,
        "side_networks": side_source,
        "parameters": {"block_linears": fam.block_linear_params(spec),
                       "total_dit": sum(torch.Size(s).numel()
                                        for s in fam.param_shapes(spec).values())},
        "kernels": kernels,
        "files": files,
    }


def build(config: BuildConfig, log=print) -> dict:
    """Write the engine `config` describes (builder/build_config.py) and return its manifest;
    `log` gets a line per rank file and kernel warm-up. A checkpoint without side networks
    builds only with `random_side_networks` (random ones, seeded by `seed` or 0, and the
    manifest says so). The engine directory is replaced only once the new engine is
    complete."""
    target, out = config.load_target(), config.out
    weights, seed, preset_name = config.weights, config.seed, config.preset_name
    ranks, kernels = config.ranks, config.kernels
    random_side_networks = config.random_side_networks
    cfg = target.config(preset_name)
    spec, fam = cfg.model, family_of(cfg)
    ranks = sorted(set(range(cfg.tp) if ranks is None else ranks))
    if not ranks or ranks[0] < 0 or ranks[-1] >= cfg.tp:
        raise BuildError(f"ranks {ranks}: target {target.name} has ranks 0..{cfg.tp - 1}")
    staging = Staging(out)  # refuses an --out it must not replace, before any work
    if config.export_onnx:
        require_onnx()
    compile_kernels = kernels and target.device == "cuda"
    device = build_device(target, compile_kernels)
    side_seed = seed if seed is not None else 0
    files = dict(config.side_files)
    file_side = fam.load_side_files(spec, files, side_seed) if files else None
    if weights is not None:
        state, side = fam.load_checkpoint(weights, spec)
        if side:
            fam.check_side(spec, side, str(weights))
        elif file_side is not None:
            side = file_side
        elif not random_side_networks:
            raise BuildError(f"{weights}: holds no side networks (tensors under "
                             f"{', '.join(fam.side_prefixes)}){fam.side_files_hint}; pass "
                             "--random-side-networks to build with random ones (the frames are "
                             "then not the model's)")
        state = {k: v.to(device) for k, v in state.items()}
        source = {"checkpoint": str(weights), "sha256": checkpoint_sha256(weights)}
    else:
        state, side = fam.random_weights(spec, seed, device), file_side or {}
        source = {"random_seed": seed}
    if config.lora is not None:
        lora = read_lora(config.lora)
        state = merge_lora(state, lora, str(weights) if weights is not None else
                           f"the random {spec.name} weights")
        source |= lora.summary() | {"lora_sha256": sha256(config.lora)}
    if file_side is not None:
        named = ", ".join(f"{k} {v}" for k, v in files.items())
        side_source = f"files ({named}; the rest random, seed {side_seed})"
    elif side:
        side_source = "checkpoint"
    else:
        side_source = f"random (seed {side_seed})"
    if not side:
        side = fam.random_side_state(spec, side_seed)

    with staging as tmp:
        tables = fam.bake_tables(cfg, state)
        save_file({k: t.contiguous().cpu() for k, t in tables.items()}, str(tmp / ADALN))
        save_file({k: v.contiguous() for k, v in side.items()}, str(tmp / SIDE))
        onnx = export_onnx(cfg, side, tmp / ONNX, log) if config.export_onnx else None
        for r in ranks:
            rstate = fam.rank_weights(cfg, state, target.mapping(r))
            save_file({k: v.cpu() for k, v in rstate.items()}, str(tmp / rank_file(r)))
            del rstate
            log(f"rank {r}: {rank_file(r)}")
        del state
        kernels = {"compiled": False, "dir": None, "warm_up": {}}
        if compile_kernels:
            (tmp / MANIFEST).write_text(json.dumps(
                manifest_of(target, cfg, ranks, source, side_source, kernels, {})))
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the warm-up process loads the rank again

            shapes = {}
            for r in ranks:  # ranks of one shape share their kernels and GEMM choices
                shapes.setdefault(fam.rank_shape(cfg, r), r)
            warm = {r: bake_kernels(tmp, r, log) for r in shapes.values()}
            kernels = {"compiled": True, "dir": TRITON_KERNELS,
                       "warm_up": {str(r): w for r, w in warm.items()},
                       "gemm_plan": {str(r): warm[shapes[fam.rank_shape(cfg, r)]]["gemm_plan"]
                                     for r in ranks},
                       "quack": uses_quack(cfg, warm.values())}
            try:
                kernels["shared_objects_checked"] = check_shared_objects(tmp / TRITON_KERNELS)
            except StaticLibstdcxx as e:
                raise BuildError(str(e)) from None
        manifest = manifest_of(target, cfg, ranks, source, side_source, kernels,
                               checksums(tmp, engine_files(tmp)))
        if onnx is not None:
            manifest["onnx"] = onnx
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        staging.commit()
    return manifest
