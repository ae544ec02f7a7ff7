"""The LiveTalk checkpoint layout (upstream's key names), random weights of its exact shapes,
loading and checking a released `model.safetensors`, and the engine's rank state.

    patch_embedding.{weight,bias}       Conv3d in_channels -> dim, kernel = stride (1, 2, 2)
    text_embedding.{0,2}.*              text_dim -> dim, GELU (tanh), dim -> dim
    time_embedding.{0,2}.*              freq_dim -> dim, SiLU, dim -> dim
    time_projection.1.*                 SiLU then dim -> 6 dim
    blocks.{i}.self_attn.{q,k,v,o}.*    dim -> dim (with biases); norm_q, norm_k [dim]
    blocks.{i}.cross_attn.*             the same ten tensors
    blocks.{i}.norm3.{weight,bias}      the cross-attention's LayerNorm
    blocks.{i}.ffn.{0,2}.*              dim -> ffn_dim, GELU (tanh), ffn_dim -> dim
    blocks.{i}.modulation               [1, 6, dim] added to the time projection
    head.head.*, head.modulation        dim -> 16 x 2 x 2, [1, 2, dim]
    audio_proj.proj.*, audio_proj.norm_out.*   4 x audio_dim -> audio_hidden, LayerNorm
    audio_cond_projs.{j}.*              audio_hidden -> dim, one per audio block
Only safetensors are read: no pickle is ever loaded. The engine keeps the block linears FP8
(e4m3, per-output-channel fp32 scales under `<name>.weight_scale`) when numerics.fp8_gemm is
on; everything else stays in the checkpoint's precision, cast to the model's dtype."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from .. import fp8
from ..checkpoint import check_tensors, read_safetensors, seeded_randn
from .spec import LiveTalkSpec


def _linear(name: str, n_out: int, n_in: int) -> dict[str, tuple[int, ...]]:
    return {f"{name}.weight": (n_out, n_in), f"{name}.bias": (n_out,)}


def param_shapes(spec: LiveTalkSpec) -> dict[str, tuple[int, ...]]:
    d, p = spec.dim, spec.patch
    shapes = {"patch_embedding.weight": (d, spec.in_channels, 1, p, p),
              "patch_embedding.bias": (d,)}
    shapes |= _linear("text_embedding.0", d, spec.text_dim) | _linear("text_embedding.2", d, d)
    shapes |= _linear("time_embedding.0", d, spec.freq_dim) | _linear("time_embedding.2", d, d)
    shapes |= _linear("time_projection.1", 6 * d, d)
    for i in range(spec.n_blocks):
        b = f"blocks.{i}"
        for attn in ("self_attn", "cross_attn"):
            for w in "qkvo":
                shapes |= _linear(f"{b}.{attn}.{w}", d, d)
            shapes |= {f"{b}.{attn}.norm_q.weight": (d,), f"{b}.{attn}.norm_k.weight": (d,)}
        shapes |= {f"{b}.norm3.weight": (d,), f"{b}.norm3.bias": (d,)}
        shapes |= _linear(f"{b}.ffn.0", spec.ffn_dim, d) | _linear(f"{b}.ffn.2", d, spec.ffn_dim)
        shapes |= {f"{b}.modulation": (1, 6, d)}
    shapes |= _linear("head.head", spec.latent_channels * p * p, d)
    shapes |= {"head.modulation": (1, 2, d)}
    shapes |= _linear("audio_proj.proj", spec.audio_hidden, spec.audio_rows // spec.chunk_frames
                      * spec.audio_dim)
    shapes |= {"audio_proj.norm_out.weight": (spec.audio_hidden,),
               "audio_proj.norm_out.bias": (spec.audio_hidden,)}
    for j in range(len(spec.audio_blocks)):
        shapes |= _linear(f"audio_cond_projs.{j}", d, spec.audio_hidden)
    return shapes


def block_linears(spec: LiveTalkSpec) -> list[str]:
    """The linears that run on every token of every pass (FP8 where numerics.fp8_gemm)."""
    names = []
    for i in range(spec.n_blocks):
        names += [f"blocks.{i}.self_attn.{w}" for w in "qkvo"]
        names += [f"blocks.{i}.cross_attn.{w}" for w in "qo"]
        names += [f"blocks.{i}.ffn.0", f"blocks.{i}.ffn.2"]
    return names


def random_tensor(name: str, shape: tuple[int, ...], seed: int, dtype=torch.bfloat16):
    """One tensor of a random checkpoint, seeded per name (any one tensor can be made alone),
    scaled like PyTorch's default initialization so a rollout stays bounded."""
    t = seeded_randn(name, shape, seed)
    if name.endswith(("norm_q.weight", "norm_k.weight", "norm3.weight", "norm_out.weight")):
        t = 1.0 + 0.1 * t
    elif name.endswith("bias"):
        t = 0.02 * t
    elif name.endswith("modulation"):
        t = t / shape[-1] ** 0.5
    else:
        fan_in = 1
        for n in shape[1:]:
            fan_in *= n
        t = t / fan_in ** 0.5
    return t.to(dtype)


def random_weights(spec: LiveTalkSpec, seed: int, dtype=torch.bfloat16,
                   device="cpu") -> dict[str, torch.Tensor]:
    """The random checkpoint: every tensor drawn on the host from its own seed
    (random_tensor), so the values are the same whatever `device` they are placed on."""
    return {n: random_tensor(n, s, seed, dtype).to(device) for n, s in param_shapes(spec).items()}


def device_random_weights(spec: LiveTalkSpec, seed: int, device,
                          dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """A random checkpoint of the same shapes and scales drawn fast on `device` (benchmarks
    at full size: random_weights draws 1.4B values on the host, tens of seconds): the block
    linears from one generator there, each scaled by 1/sqrt(fan_in) as random_tensor scales
    a linear's weight; the other tensors (norms, embeddings, modulation: a few million
    values) from random_tensor. Not random_weights' values."""
    device = torch.device(device)
    linears = {f"{n}.weight" for n in block_linears(spec)}
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in param_shapes(spec).items():
        if name in linears:
            t = torch.randn(shape, generator=g, device=device) / shape[1] ** 0.5
            out[name] = t.to(dtype)
        else:
            out[name] = random_tensor(name, shape, seed, dtype).to(device)
    return out


def load_checkpoint(path: Path, spec: LiveTalkSpec) -> dict[str, torch.Tensor]:
    """The DiT of a released LiveTalk `model.safetensors`, every tensor checked (one line
    naming the first that is missing, extra, misshapen, of a wrong dtype or non-finite)."""
    path = Path(path)
    state = read_safetensors(path)
    check_tensors(param_shapes(spec), state, str(path), f"{spec.name}'s DiT")
    return state


def rank_weights(spec: LiveTalkSpec, state: Mapping, fp8_gemm: bool,
                 dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """The engine's state: block linears FP8 with per-output-channel scales where
    `fp8_gemm`, everything else in `dtype`."""
    linears = set(block_linears(spec)) if fp8_gemm else set()
    out = {}
    for name in param_shapes(spec):
        t = state[name]
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and base in linears:
            q, scale = fp8.quantize_rows(t.float())
            out[name], out[f"{base}.weight_scale"] = q, scale[:, 0].contiguous()
        else:
            out[name] = t.to(dtype)
    return out


def engine_shapes(spec: LiveTalkSpec, fp8_gemm: bool) -> dict[str, tuple[int, ...]]:
    """Names and shapes of rank_weights' output (the engine's rank file)."""
    shapes = dict(param_shapes(spec))
    if fp8_gemm:
        for base in block_linears(spec):
            shapes[f"{base}.weight_scale"] = (shapes[f"{base}.weight"][0],)
    return shapes
