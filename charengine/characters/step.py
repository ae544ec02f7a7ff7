"""The AR step (one latent frame, denoised in the schedule's passes) and the session driver.

`ar_step` takes and mutates only tensors: the write position, temporal index and valid mask
derive on the device from the cache's step counter. Its two static arguments select one of
three graphs: filling (the first window - 1 steps, masked), steady, and reset (delta rotation
first). The host knows which from its own loop counter; it never reads the device.
"""

from __future__ import annotations

import torch

from .cache import KVCache
from ..config import EngineConfig
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


class Session:
    """Drives one rank through a session: global slots, FP8 calibration, resets.

    `step_fn` is ar_step or a compiled / graph-captured equivalent with the same signature.
    """

    def __init__(self, model: CharacterDiT, cache: KVCache, step_fn=ar_step):
        self.model, self.cache, self.step_fn = model, cache, step_fn
        self.cfg: EngineConfig = model.cfg
        self.k = 0  # host-side AR step count: picks the phase, never read from the device

    def start(self, ref_latent: torch.Tensor, prompt: torch.Tensor) -> None:
        """New reference image latent [C, H, W] and prompt features [prompt_tokens, text_dim]."""
        self.cache.new_session()
        self.k = 0
        self.model.forward_global(patchify(ref_latent.float(), self.model.spec.patch), prompt,
                                  self.cache)

    def phase(self) -> tuple[bool, bool]:
        """(reset, masked) for the next step."""
        cc = self.cfg.cache
        reset = self.cfg.switches.delta_rotation and self.k > 0 and self.k % cc.reset_period == 0
        return reset, self.k < cc.window - 1

    def step(self, noise: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        cc = self.cfg.cache
        if self.cfg.switches.fp8_kv and self.k == cc.calibration_steps:
            self.cache.calibrate()
        reset, masked = self.phase()
        filled = self.k + 1 if masked else None
        out = self.step_fn(self.model, self.cache, noise, audio, reset=reset, masked=masked,
                           filled=filled)
        self.k += 1
        return out
