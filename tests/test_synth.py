"""The procedural clip generator: shapes, determinism, identities, and a mouth that follows
the speech (measured from the pixels, not from the generator's own labels)."""

import numpy as np

from tinychar.quality import mouth_opening as mouth_area
from tinychar.synth import clip, envelope


def test_clip_shapes_and_determinism():
    a = clip(3.0, 64, np.random.default_rng(1))
    b = clip(3.0, 64, np.random.default_rng(1))
    assert a.frames.shape == (72, 64, 64, 3) and a.frames.dtype == np.uint8
    assert a.audio.shape == (48000,) and np.abs(a.audio).max() <= 0.5 + 1e-6
    assert np.array_equal(a.frames, b.frames) and np.array_equal(a.audio, b.audio)
    c = clip(3.0, 64, np.random.default_rng(2))
    assert not np.allclose(a.identity.skin, c.identity.skin)


def _shift_agreement(a, b, k):
    """Fraction of frames where a[t + k] == b[t]."""
    if k >= 0:
        return np.mean(a[k:] == b[: len(b) - k])
    return np.mean(a[:k] == b[-k:])


def test_mouth_opens_with_the_speech_and_in_sync():
    rng = np.random.default_rng(3)
    for _ in range(6):
        c = clip(6.0, 64, rng)
        area = mouth_area(c.frames).astype(float)
        env = envelope(c.audio, 16000, 24, len(area))
        loud, quiet = env > 0.3, env < 0.02
        closed = np.median(area[quiet]) if quiet.any() else area.min()
        is_open = area > 1.5 * closed
        assert is_open[loud].mean() > 0.9  # speaking: the mouth is open
        if quiet.any():
            assert (~is_open[quiet]).mean() > 0.9  # pauses: a closed line
        speaking = env > 0.1
        agreement = {k: _shift_agreement(is_open, speaking, k) for k in range(-6, 7)}
        assert abs(max(agreement, key=agreement.get)) <= 1  # in sync, not shifted


def test_blinks_and_sway():
    c = clip(12.0, 64, np.random.default_rng(4))
    starts = np.flatnonzero(np.diff((c.blink > 0).astype(int)) == 1)
    assert 2 <= len(starts) <= 7  # every 2-5 s
    assert not np.array_equal(c.frames[0], c.frames[24])  # the head moves
