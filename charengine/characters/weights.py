"""Checkpoint layout: tensor names and shapes, random weights of the exact shapes, loading and
checking a safetensors checkpoint, FP8 quantization of the block linears, TP sharding.

The checkpoint is full precision (float32, bfloat16 or float16), unsharded:
    patch_embed.{weight,bias}     [d, patch_dim], [d]         latent patch -> token
    audio_proj.{weight,bias}      [d, audio_dim], [d]         audio feature -> token
    text_proj.{weight,bias}       [d, text_dim], [d]          prompt feature -> token
    time_mlp.{0,2}.{weight,bias}  [d, time_freq_dim], [d, d]  sigma embedding -> c
    blocks.{i}.w_in               [3d + 2h, d]   rows: q | k | v (head-major) | gate | up
    blocks.{i}.w_out              [d, d + h]     columns: attention (head-major) | MLP hidden
    blocks.{i}.{q_norm,k_norm}    [head_dim]     QK RMS-norm weights
    blocks.{i}.adaln.{weight,bias} [3d, d], [3d] shift | scale | gate from silu(c)
    final_adaln.{weight,bias}     [2d, d], [2d]  shift | scale of the final norm
    final.{weight,bias}           [patch_dim, d], [patch_dim]
A rank's engine weights hold the block linears as FP8 (`.q`, e4m3) with per-output-channel
fp32 scales (`.scale`), cut to the rank's heads and MLP channels; the rest is replicated.
Only safetensors are read: no pickle is ever loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from .. import fp8
from ..checkpoint import check_tensors, read_safetensors, seeded_randn
from .spec import ModelSpec, RankShape



def param_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    d = spec.dim
    shapes = {
        "patch_embed.weight": (d, spec.patch_dim), "patch_embed.bias": (d,),
        "audio_proj.weight": (d, spec.audio_dim), "audio_proj.bias": (d,),
        "text_proj.weight": (d, spec.text_dim), "text_proj.bias": (d,),
        "time_mlp.0.weight": (d, spec.time_freq_dim), "time_mlp.0.bias": (d,),
        "time_mlp.2.weight": (d, d), "time_mlp.2.bias": (d,),
        "final_adaln.weight": (2 * d, d), "final_adaln.bias": (2 * d,),
        "final.weight": (spec.patch_dim, d), "final.bias": (spec.patch_dim,),
    }
    for i in range(spec.n_blocks):
        shapes |= {
            f"blocks.{i}.w_in": (spec.in_proj_dim, d),
            f"blocks.{i}.w_out": (d, spec.out_proj_dim),
            f"blocks.{i}.q_norm": (spec.head_dim,), f"blocks.{i}.k_norm": (spec.head_dim,),
            f"blocks.{i}.adaln.weight": (3 * d, d), f"blocks.{i}.adaln.bias": (3 * d,),
        }
    return shapes


def block_linear_names(spec: ModelSpec) -> list[str]:
    return [f"blocks.{i}.{w}" for i in range(spec.n_blocks) for w in ("w_in", "w_out")]


def random_tensor(name: str, shape: tuple[int, ...], seed: int, dtype=torch.float32,
                  device="cpu"):
    """One tensor of the random checkpoint; seeded per name, so a builder can make any one
    tensor without the rest (the stream differs between CPU and CUDA generators). Scaled so
    the AR rollout stays bounded."""
    t = seeded_randn(name, shape, seed, device)
    if name.endswith("norm"):
        t = 1.0 + 0.1 * t
    elif name.endswith("bias"):
        t = 0.02 * t
    else:
        gain = 0.5 if name.endswith(("w_out", "adaln.weight")) else 1.0
        t = t * (gain / shape[1] ** 0.5)
    return t.to(dtype)


def random_weights(spec: ModelSpec, seed: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    return {name: random_tensor(name, shape, seed, dtype)
            for name, shape in param_shapes(spec).items()}


class RandomWeights(Mapping):
    """The random checkpoint of random_weights, made one tensor at a time on `device` when
    asked for (a builder at full size never holds the whole fp32 model)."""

    def __init__(self, spec: ModelSpec, seed: int, device="cpu"):
        self.shapes, self.seed, self.device = param_shapes(spec), seed, device

    def __getitem__(self, name: str) -> torch.Tensor:
        return random_tensor(name, self.shapes[name], self.seed, torch.float32, self.device)

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def check_state(spec: ModelSpec, state: dict[str, torch.Tensor], where: str) -> None:
    check_tensors(param_shapes(spec), state, where, spec.name)


def load_checkpoint(path: str | Path, spec: ModelSpec, side_prefixes: tuple[str, ...] = ()):
    """Read and check a safetensors checkpoint against `spec`. Tensors under `side_prefixes`
    (the side networks) are returned apart: (model state, side state)."""
    path = Path(path)
    state = read_safetensors(path)
    side = {k: state.pop(k) for k in list(state) if k.startswith(side_prefixes)}
    check_state(spec, state, str(path))
    return state, side


def quantize_block_linears(spec: ModelSpec, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full-precision checkpoint -> block linears as FP8 + per-output-channel scales."""
    out = {}
    linears = set(block_linear_names(spec))
    for name, t in state.items():
        if name in linears:
            q, s = fp8.quantize_rows(t.float())
            out[f"{name}.q"], out[f"{name}.scale"] = q, s[:, 0].contiguous()
        else:
            out[name] = t.float()
    return out


def _in_rows(spec: ModelSpec, r: RankShape) -> torch.Tensor:
    d, D, h = spec.dim, spec.head_dim, spec.mlp_hidden
    a0, a = r.head_offset * D, r.heads * D
    parts = [torch.arange(a0, a0 + a) + k * d for k in range(3)]
    parts += [3 * d + torch.arange(r.mlp_offset, r.mlp_offset + r.mlp) + k * h for k in range(2)]
    return torch.cat(parts)


def _out_cols(spec: ModelSpec, r: RankShape) -> torch.Tensor:
    D = spec.head_dim
    a0, a = r.head_offset * D, r.heads * D
    return torch.cat([torch.arange(a0, a0 + a),
                      spec.dim + torch.arange(r.mlp_offset, r.mlp_offset + r.mlp)])


def shard(spec: ModelSpec, qstate: dict[str, torch.Tensor], r: RankShape) -> dict[str, torch.Tensor]:
    """Cut a quantized state to one rank: input projection rows (column-parallel) and output
    projection columns (row-parallel) of the rank's heads and MLP channels. Scales are of the
    full rows, so the ranks' partial sums add up to the TP-1 result."""
    rows, cols = _in_rows(spec, r), _out_cols(spec, r)
    out = {}
    for name, t in qstate.items():
        if name.endswith("w_in.q") or name.endswith("w_in.scale"):
            out[name] = t[rows].contiguous()
        elif name.endswith("w_out.q"):
            out[name] = t[:, cols].contiguous()
        else:
            out[name] = t
    return out


def is_adaln_weight(name: str) -> bool:
    """The AdaLN MLPs' weights: needed to bake the tables, and at run time only without them."""
    return "adaln" in name


def rank_weights(spec: ModelSpec, state: Mapping, r: RankShape,
                 keep_adaln: bool = True) -> dict[str, torch.Tensor]:
    """One rank's engine weights from a full-precision state, one tensor at a time: block
    linears quantized to FP8 with per-output-channel scales and cut to the rank (the same
    result as shard(quantize_block_linears(state))), the rest in fp32; the AdaLN MLP weights
    only with keep_adaln (engines with baked tables do not need them)."""
    out = {}
    linears = set(block_linear_names(spec))
    for name in param_shapes(spec):
        if not keep_adaln and is_adaln_weight(name):
            continue
        t = state[name]
        if name in linears:
            q, s = fp8.quantize_rows(t.float())
            if name.endswith("w_in"):
                rows = _in_rows(spec, r).to(t.device)
                q, s = q[rows], s[rows]
            else:
                q = q[:, _out_cols(spec, r).to(t.device)]
            out[f"{name}.q"], out[f"{name}.scale"] = q.contiguous(), s[:, 0].contiguous()
        else:
            out[name] = t.float()
        del t
    return out


def random_rank_state(spec: ModelSpec, rank: RankShape, seed: int, device, dtype=torch.bfloat16,
                      keep_adaln_weights: bool = True) -> tuple[dict, dict]:
    """A rank's quantized state made directly on `device`, one tensor at a time (for
    benchmarks at full size, where the fp32 checkpoint would not fit in host memory).
    Returns (rank state, the full-precision AdaLN weights needed to bake the tables)."""
    rows, cols = _in_rows(spec, rank).to(device), _out_cols(spec, rank).to(device)
    state, adaln = {}, {}
    for name, shape in param_shapes(spec).items():
        t = random_tensor(name, shape, seed, torch.float32, device)
        if name.endswith("w_in") or name.endswith("w_out"):
            q, s = fp8.quantize_rows(t)
            if name.endswith("w_in"):
                q, s = q[rows], s[rows]
            else:
                q = q[:, cols]
            state[f"{name}.q"], state[f"{name}.scale"] = q.contiguous(), s[:, 0].contiguous()
        else:
            if "adaln" in name or name.startswith("time_mlp"):
                adaln[name] = t.to(dtype)
            if keep_adaln_weights or "adaln" not in name:
                state[name] = t.to(dtype)
        del t
    return state, adaln
