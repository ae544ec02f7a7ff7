"""A LoRA merged into a checkpoint's weights before the engine quantizes them (charbuild
--lora): each adapted linear's weight W becomes W + (alpha / rank) * B @ A, summed in fp32
and rounded once to W's dtype, so the engine holds one weight per linear and steps exactly
as the base does.

A LoRA file is safetensors, in either of the two layouts adapters are saved in: PEFT's and
diffusers' (`<module>.lora_A.weight` [rank, in], `<module>.lora_B.weight` [out, rank]) or
kohya's (`<module>.lora_down.weight`, `<module>.lora_up.weight`), with alpha as a scalar
tensor `<module>.alpha` or the file's metadata (`lora_alpha`, `alpha`, or PEFT's saved
`adapter_config`); absent everywhere, alpha is the rank (a scale of one), as diffusers
saves them. A module's name is matched to the checkpoint's `<module>.weight` with the
prefixes that trainers add (`diffusion_model.`, `base_model.model.`, `transformer.`,
`model.`) taken off. Whatever does not fit the base is one CheckpointError line naming the
tensor: a module the base lacks (a LoRA for another base), a shape that does not fit, an A
and a B of different ranks, a non-finite value."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from .checkpoint import CheckpointError
from .paths import not_a_file

# (down, up) suffixes of the two layouts, and the prefixes trainers put before module names
LAYOUTS = ((".lora_A.weight", ".lora_B.weight"), (".lora_down.weight", ".lora_up.weight"))
PREFIXES = ("diffusion_model.", "base_model.model.", "transformer.", "model.")
ALPHA_SUFFIX = ".alpha"
ALPHA_METADATA = ("lora_alpha", "alpha")


@dataclass
class Adapter:
    """One adapted module: its down (A, [rank, in]) and up (B, [out, rank]) matrices and
    alpha."""

    down: torch.Tensor
    up: torch.Tensor
    alpha: float

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass
class LoRA:
    path: Path
    adapters: dict[str, Adapter]  # module name as the file gives it -> its adapter

    def summary(self) -> dict:
        """What an engine's manifest records of it."""
        ranks = sorted({a.rank for a in self.adapters.values()})
        alphas = sorted({a.alpha for a in self.adapters.values()})
        return {"lora": str(self.path), "modules": len(self.adapters), "ranks": ranks,
                "alphas": alphas}


def _metadata_alpha(meta: dict[str, str] | None) -> float | None:
    meta = meta or {}
    for key in ALPHA_METADATA:
        if key in meta:
            return float(meta[key])
    if "adapter_config" in meta:  # PEFT's own
        config = json.loads(meta["adapter_config"])
        if "lora_alpha" in config:
            return float(config["lora_alpha"])
    return None


def read_lora(path: Path) -> LoRA:
    """The adapters of a LoRA file; one line for a file that is not one."""
    path = Path(path)
    if (why := not_a_file(path)) is not None:
        raise CheckpointError(f"{path}: {why}")
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            default_alpha = _metadata_alpha(f.metadata())
    except (ValueError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable LoRA file ({e})") from None
    except Exception as e:  # safetensors' own error types for a damaged header
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    adapters: dict[str, Adapter] = {}
    used = set()
    for down_suffix, up_suffix in LAYOUTS:
        for name in sorted(k for k in tensors if k.endswith(down_suffix)):
            module = name.removesuffix(down_suffix)
            up_name = module + up_suffix
            if up_name not in tensors:
                raise CheckpointError(f"{path}: {name!r} has no {up_suffix[1:]!r} beside it")
            down, up = tensors[name], tensors[up_name]
            if down.dim() != 2 or up.dim() != 2:
                raise CheckpointError(f"{path}: {name!r} is {down.dim()}-D and {up_name!r} "
                                      f"{up.dim()}-D: only linears' adapters merge")
            if up.shape[1] != down.shape[0]:
                raise CheckpointError(f"{path}: {up_name!r} has rank {up.shape[1]} and "
                                      f"{name!r} rank {down.shape[0]}")
            alpha_t = tensors.get(module + ALPHA_SUFFIX)
            alpha = float(alpha_t) if alpha_t is not None else default_alpha
            adapters[module] = Adapter(down, up, float(down.shape[0]) if alpha is None
                                       else alpha)
            used |= {name, up_name, module + ALPHA_SUFFIX}
    if not adapters:
        raise CheckpointError(f"{path}: no LoRA tensors (*{LAYOUTS[0][0]} and "
                              f"*{LAYOUTS[0][1]}, or *{LAYOUTS[1][0]} and *{LAYOUTS[1][1]})")
    extra = sorted(set(tensors) - used)
    if extra:
        raise CheckpointError(f"{path}: tensor {extra[0]!r} is no part of a LoRA's layout")
    for module, a in adapters.items():
        for what, t in (("down", a.down), ("up", a.up)):
            if not torch.isfinite(t).all():
                raise CheckpointError(f"{path}: the {what} matrix of {module!r} holds "
                                      "non-finite values")
    return LoRA(path, adapters)


def base_name(module: str, state) -> str | None:
    """The checkpoint tensor a LoRA module adapts: `<module>.weight` with at most one known
    trainer prefix taken off; None where the base has no such tensor."""
    for name in (module, *(module.removeprefix(p) for p in PREFIXES if module.startswith(p))):
        if f"{name}.weight" in state:
            return f"{name}.weight"
    return None


def merge_lora(state: dict, lora: LoRA, where: str) -> dict:
    """`state` with every adapter of `lora` merged into its weight (a new dict; the tensors
    not adapted are the same objects). `where` names the checkpoint in messages."""
    out = dict(state)
    for module, a in lora.adapters.items():
        name = base_name(module, state)
        if name is None:
            raise CheckpointError(f"{lora.path}: adapts {module!r}, which {where} does not "
                                  "have: a LoRA for another base")
        w = state[name]
        want = (a.up.shape[0], a.down.shape[1])
        if tuple(w.shape) != want:
            raise CheckpointError(f"{lora.path}: adapts {name!r} of shape {list(w.shape)} "
                                  f"with a product of shape {list(want)}: a LoRA for another "
                                  "base")
        delta = a.up.to(w.device, torch.float32) @ a.down.to(w.device, torch.float32)
        merged = w.float() + a.scale * delta
        if not torch.isfinite(merged).all():
            raise CheckpointError(f"{lora.path}: merging into {name!r} gives non-finite "
                                  "values")
        out[name] = merged.to(w.dtype)
    return out
