"""The AR step (one latent frame, denoised in the schedule's passes) and its phase rule.

`ar_step` takes and mutates only tensors: the write position, temporal index and valid mask
derive on the device from the cache's step counter. Its static arguments select one of
three kinds: filling (the first window - 1 steps, masked), steady, and reset (delta rotation
first). The host knows which from its own step count (FrameSteps); it never reads the
device. The session, the graphs and the warm-up are charengine/stepping.py's.
"""

from __future__ import annotations

import torch

from ..config import EngineConfig
from .cache import KVCache
from .model import CharacterDiT, patchify, unpatchify


def ar_step(model: CharacterDiT, cache: KVCache, noise: torch.Tensor, audio: torch.Tensor,
            reset: bool = False, masked: bool = False, filled: int | None = None) -> torch.Tensor:
    """Denoise one latent from `noise` [C, H, W] conditioned on `audio` features
    [audio_tokens, audio_dim]; returns the clean latent (fp32).

    While the window fills (`masked`), attention sees only the slots written so far. With
    the ring cache and `filled` (the frames written once this step's is, known to the
    host from its step count) those are the first G + filled * T slots: attention reads that
    prefix with no mask, so the fast SDPA backends serve it; otherwise a device-side mask."""
    cfg, spec = model.cfg, model.spec
    with model.scope("cache_upkeep"):
        if reset:
            cache.delta_rotate(model.rope)
        if not cfg.switches.ring_cache:
            cache.advance_window()
    prefix = masked and filled is not None and cfg.switches.ring_cache
    mask = cache.valid_mask() if masked and not prefix else None
    slots = cache.G + filled * cache.T if prefix else None
    x = patchify(noise.float(), spec.patch)
    cond = model.conditioning(audio, cache) if cfg.switches.conditioning_cache else None
    for p, sigma in enumerate(cfg.schedule.sigmas):
        c = cond if cond is not None else model.conditioning(audio, cache)
        v = model.forward_frame(x, p, c, cache, mask, slots)
        x = x + (cfg.schedule.next_sigma(p) - sigma) * v
    cache.end_step()
    return unpatchify(x, spec.latent_channels, spec.latent_h, spec.latent_w, spec.patch)


class FrameSteps:
    """The characters family's phase rule (charengine/stepping.py's StepRule): step k is
    masked while the window fills (the first window - 1 steps), a reset every reset_period
    steps with delta_rotation, and the FP8 calibration runs before step calibration_steps.
    The steady and reset steps replay their graphs once the cache is in its final
    precision."""

    def __init__(self, cfg: EngineConfig):
        cc, sw = cfg.cache, cfg.switches
        self.window, self.period, self.calibration = cc.window, cc.reset_period, \
            cc.calibration_steps
        self.rotates, self.fp8_kv = sw.delta_rotation, sw.fp8_kv
        self.warm_up_limit = max(cc.window, cc.calibration_steps) + 2
        self.steady_step = cc.window - 1
        self.graphed = True

    def start(self, model: CharacterDiT, cache: KVCache, reference, prompt) -> None:
        model.forward_global(patchify(reference.float(), model.spec.patch), prompt, cache)

    def before(self, cache: KVCache, k: int) -> None:
        if self.fp8_kv and k == self.calibration:
            cache.calibrate()

    def kind(self, k: int) -> dict:
        masked = k < self.window - 1
        return {"reset": self.rotates and k > 0 and k % self.period == 0, "masked": masked,
                "filled": k + 1 if masked else None}

    def resets_at(self, cache: KVCache, k: int) -> bool:
        return k > 0 and k % self.period == 0

    def batch_kind(self, cache: KVCache, kind: dict) -> None:
        """Every step runs alone: this family has no batched step."""
        return None

    def before_batch(self, cache: KVCache, kind: dict) -> None:
        raise TypeError("this family has no batched step")

    def steady(self, cache: KVCache, kind: dict) -> bool:
        return not kind["masked"] and (cache.quantized or not self.fp8_kv)

    def graph_key(self, cache: KVCache, kind: dict):
        return kind["reset"] if self.steady(cache, kind) else None

    def captures_at(self, cache: KVCache, kind: dict) -> bool:
        return self.steady(cache, kind)

    def captures(self, cache: KVCache, kind: dict):
        for reset in (False, True):
            yield reset, {"reset": reset}
