"""Shared by the tests: run a session of a config on given random weights and inputs."""

import torch

from charengine.config import EngineConfig, Numerics
from charengine.assemble import rank_session, rank_state
from charengine.mapping import Mapping
from charengine.characters.step import ar_step
from charengine.characters.weights import random_weights

FP32 = Numerics(dtype="float32", fp8_gemm=False, fp8_attention=False)


def session_inputs(spec, steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    lat = (spec.latent_channels, spec.latent_h, spec.latent_w)
    ref = torch.randn(lat, generator=g)
    prompt = torch.randn(spec.prompt_tokens, spec.text_dim, generator=g)
    noise = torch.randn((steps, *lat), generator=g)
    audio = torch.randn(steps, spec.audio_tokens, spec.audio_dim, generator=g)
    return ref, prompt, noise, audio


def rollout(cfg: EngineConfig, steps: int, weights_seed: int = 0, rank: int = 0,
            step_fn=ar_step, full_state=None, inputs_seed: int = 1):
    """`rank` of cfg.tp (over the default process group where cfg.tp > 1)."""
    full = full_state if full_state is not None else random_weights(cfg.model, weights_seed)
    s = rank_session(cfg, rank_state(cfg, full, rank), Mapping.single(tp=cfg.tp, rank=rank),
                     step_fn=step_fn)
    ref, prompt, noise, audio = session_inputs(cfg.model, steps, inputs_seed)
    s.start(ref, prompt)
    return torch.stack([s.step(noise[k], audio[k]) for k in range(steps)])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-step relative L2 error of b against a, [steps]."""
    return (a - b).flatten(1).norm(dim=1) / a.flatten(1).norm(dim=1)
