"""The quality scorer: the right lip-sync offset on clips made with a known audio shift, a
higher confidence for a talking mouth than for a still one, PSNR / SSIM with identical frames
counted apart, bootstrap intervals."""

import numpy as np
import pytest

from tinychar.quality import bootstrap, compare_runs, lip_sync, psnr
from tinychar.synth import clip

FPS, SR = 24, 16000


def shifted(c, frames):
    """Delay the video by `frames` against the audio (negative: the video leads)."""
    if frames >= 0:
        return np.concatenate([np.repeat(c.frames[:1], frames, 0), c.frames[: len(c.frames) - frames]])
    return np.concatenate([c.frames[-frames:], np.repeat(c.frames[-1:], -frames, 0)])


@pytest.mark.parametrize("shift", [-5, 0, 3, 8])
def test_offset_of_a_known_shift(shift):
    rng = np.random.default_rng(10)
    got = [lip_sync(shifted(c, shift), c.audio, SR, FPS).offset
           for c in (clip(8.0, 64, rng) for _ in range(5))]
    assert np.median(got) == shift
    assert sum(abs(g - shift) <= 1 for g in got) >= 4


def test_a_still_mouth_scores_lower_confidence():
    rng = np.random.default_rng(11)
    talking, still = [], []
    for _ in range(5):
        c = clip(8.0, 64, rng)
        talking.append(lip_sync(c.frames, c.audio, SR, FPS).confidence)
        frozen = np.repeat(c.frames[:1], len(c.frames), 0)  # a character that does not talk
        still.append(lip_sync(frozen, c.audio, SR, FPS).confidence)
    assert min(talking) > max(still) + 0.2


def test_compare_runs_counts_identical_frames_apart():
    rng = np.random.default_rng(12)
    a = clip(12.0, 64, rng).frames
    b = a.copy()
    b[100:] = np.clip(b[100:].astype(int) + rng.integers(-8, 9, b[100:].shape), 0, 255)
    r = compare_runs(a, b, FPS)
    assert r["overall"]["identical"] == 100 and r["overall"]["frames"] == len(a)
    assert 25 < r["overall"]["psnr"] < 40 and 0 < r["overall"]["ssim"] < 1
    first, second = r["windows"]
    assert first["frames"] == 240 and first["identical"] == 100
    assert second["identical"] == 0
    assert psnr(a[0], a[0]) == float("inf")


def test_bootstrap_interval_contains_the_mean():
    mean, lo, hi = bootstrap(np.random.default_rng(0).normal(1.0, 0.5, 50))
    assert lo < mean < hi and hi - lo < 0.5
    assert lo < 1.0 < hi
