"""The write-time path against the paper's baseline, over long rollouts."""

import dataclasses

import pytest
import torch

from charengine.characters.cache import KVCache
from charengine.config import Numerics, preset
from charengine.characters.config import Switches
from charengine.characters.step import ar_step
from rollout import FP32, rel_err, rollout

STEPS = 100  # spans resets at steps 42 and 84 and 16 ring wraps


@pytest.fixture(scope="module")
def baseline_fp32():
    return rollout(preset("tiny", switches=Switches.baseline(), numerics=FP32), STEPS)


@pytest.mark.parametrize("upto", ["baked_adaln", "rope_at_write", "ring_cache",
                                  "conditioning_cache", "fused_pre_attention",
                                  "fused_residual", "fused_gemm_allreduce"])
def test_each_cumulative_arm_equals_baseline_in_fp32(baseline_fp32, upto):
    sw = Switches.cumulative(upto)
    sw = Switches(**{**sw.__dict__, "fp8_kv": False})  # fp32 numerics has no FP8 cache
    out = rollout(preset("tiny", switches=sw, numerics=FP32), STEPS)
    assert rel_err(baseline_fp32, out).max() < 1e-5


def test_the_fused_residual_add_is_the_same_sum():
    """With fused_residual the gated residual is added inside the next block's norm +
    quantization (its reference here: the same torch.addcmul), so production steps equal the
    unfused ones exactly (a lost residual, the last block's included, would show)."""
    fused = rollout(preset("tiny"), 12)
    unfused = rollout(preset("tiny", switches=Switches(fused_residual=False)), 12)
    assert torch.equal(fused, unfused)


def test_the_residual_add_in_the_gemm_epilogue_is_the_same_sum():
    """With gemm_residual the output projection adds h itself, the gate folded into its
    weight scale (plugins/gemm_residual.py). In fp32 with FP8 GEMMs that is the same sum
    as the unfused add up to fp32 rounding, which FP8 quantization can amplify where a value
    sits on an e4m3 rounding boundary; a gate from the wrong pass is far outside the bound.
    In bf16 it rounds once instead of twice (the measured distances: docs/PERFORMANCE_LOG.md,
    "The residual add in the GEMM epilogue")."""
    fp32 = Numerics(dtype="float32", fp8_attention=False)
    for numerics, bound in ((fp32, 2e-4), (Numerics(), 5e-3)):
        sw = Switches(fp8_kv=numerics.fp8_attention)
        off = rollout(preset("tiny", numerics=numerics, switches=sw), STEPS)
        on = rollout(preset("tiny", numerics=numerics,
                            switches=dataclasses.replace(sw, gemm_residual=True)), STEPS)
        assert rel_err(off, on).max() < bound


def test_swiglu_in_the_input_projection_epilogue_is_the_same_block():
    """With gemm_swiglu the input projection splits into q/k/v rows and (gate, up) row
    pairs, SwiGLU runs on the fp32 product (rounded once, not three times) and the output
    projection's input is quantized with the maxima the projection gives (on CPU, the
    references: plugins/quack_gemm.swiglu_reference, act_quant.concat_quant_reference). In
    fp32 that is the unfused block up to rounding that FP8 can amplify; in bf16 within the
    roundings it skips. Also with the residual in the output projection's epilogue; gate and
    up rows left unpaired are far outside the bound (the measured distances:
    docs/PERFORMANCE_LOG.md, "The block's quantizations in the GEMM epilogues")."""
    fp32 = Numerics(dtype="float32", fp8_attention=False)
    for numerics, bound in ((fp32, 2e-4), (Numerics(), 5e-3)):
        sw = Switches(fp8_kv=numerics.fp8_attention)
        off = rollout(preset("tiny", numerics=numerics, switches=sw), STEPS)
        for extra in ({}, {"gemm_residual": True}):
            on = rollout(preset("tiny", numerics=numerics, switches=dataclasses.replace(
                sw, gemm_swiglu=True, **extra)), STEPS)
            assert rel_err(off, on).max() < bound


def test_the_calibration_operator_is_the_torch_loop_on_cpu():
    """fused_calibration sends the FP8 calibration through its operator (on CPU the same
    torch loop): the same session, past calibration and a reset, bit for bit."""
    cfg = preset("tiny", switches=Switches(fused_calibration=True))
    assert KVCache(cfg, 2).calibrate_fp8 is torch.ops.charengine.calibrate_cache.default
    assert torch.equal(rollout(cfg, 44), rollout(preset("tiny"), 44))


def test_skipping_the_delta_rotation_breaks_parity(baseline_fp32):
    """The parity test can fail: without the reset's rotation, steps from 42 on differ."""
    def no_rotation(model, cache, noise, audio, reset=False, masked=False, filled=None):
        return ar_step(model, cache, noise, audio, reset=False, masked=masked, filled=filled)

    out = rollout(preset("tiny", switches=Switches(fp8_kv=False), numerics=FP32), STEPS,
                  step_fn=no_rotation)
    err = rel_err(baseline_fp32, out)
    assert err[:42].max() < 1e-5
    assert err[42] > 1e-4


def test_fp8_kv_error_against_bf16_cache_is_bounded():
    """FP8 KV (per-head scales at write) against the bf16 cache, both with bf16 activations
    and FP8 GEMMs, over 100 steps.

    Bound: every latent within 1e-2 relative L2 of the bf16-cache latent. One e4m3 rounding
    is up to 2^-4 = 6.25% of an element; the cache enters only through attention, which
    averages each output over hundreds of slots, so its latent error must sit far below one
    rounding: 1e-2 is a sixth of it. And FP8 KV may add no more error than the numerics the
    production path already carries (bf16 activations + FP8 GEMMs against fp32), and must not
    grow along the session (no drift through resets)."""
    bf16 = Numerics(dtype="bfloat16", fp8_gemm=True, fp8_attention=False)
    bf16_cache = rollout(preset("tiny", switches=Switches(fp8_kv=False), numerics=bf16), STEPS)
    fp8_cache = rollout(preset("tiny"), STEPS)
    fp32 = rollout(preset("tiny", switches=Switches(fp8_kv=False), numerics=FP32), STEPS)
    err = rel_err(bf16_cache, fp8_cache)
    assert err.max() < 1e-2
    assert err.max() < rel_err(fp32, bf16_cache).max()
    assert err[-10:].max() < 2 * err[6:16].max()
    assert err[6:].min() > 0  # FP8 really is on after calibration


def test_fp8_cache_rotates_each_window_key_at_most_once():
    """Over 100 steps, every cached frame's keys change after their write only at a reset
    that falls in their lifetime, exactly once there (window 6 < period 42)."""
    from charengine.assemble import rank_session, rank_state
    from charengine.mapping import Mapping
    from charengine.characters.weights import random_weights
    from rollout import session_inputs

    cfg = preset("tiny")
    s = rank_session(cfg, rank_state(cfg, random_weights(cfg.model, 0)), Mapping.single())
    ref, prompt, noise, audio = session_inputs(cfg.model, STEPS)
    s.start(ref, prompt)
    c, G, T, W = s.cache, s.cache.G, s.cache.T, s.cache.W
    changes: dict[int, int] = {}
    frame_in_slot = {}
    for k in range(STEPS):
        before = c.k8.view(torch.uint8).clone() if c.quantized else None
        written = int(c.write_frame())
        s.step(noise[k], audio[k])
        frame_in_slot[written] = k
        if before is None:
            continue
        after = c.k8.view(torch.uint8)
        for slot, frame in frame_in_slot.items():
            if slot == written:
                continue
            sl = slice(G + slot * T, G + (slot + 1) * T)
            if not torch.equal(before[:, :, sl], after[:, :, sl]):
                changes[frame] = changes.get(frame, 0) + 1
        assert torch.equal(before[:, :, :G], after[:, :, :G])  # global keys never move
    assert all(n == 1 for n in changes.values())
    assert set(changes) == {f for f in range(STEPS) if any(0 < r - f < W for r in (42, 84))}


def test_filling_steps_read_a_prefix_equal_to_the_masked_read():
    """While the window fills, the ring's written slots are a prefix of the cache: reading it
    without a mask gives the masked read's result (and could not if it were one frame off)."""
    cfg = preset("tiny", switches=Switches(fp8_kv=False), numerics=FP32)

    def device_mask(model, cache, noise, audio, reset=False, masked=False, filled=None):
        return ar_step(model, cache, noise, audio, reset=reset, masked=masked)

    steps = cfg.cache.window + 1
    assert rel_err(rollout(cfg, steps, step_fn=device_mask), rollout(cfg, steps)).max() < 1e-5
