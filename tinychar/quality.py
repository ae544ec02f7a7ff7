"""Quality measures for our characters (paper §7.3, Appendices C and H), in the spirit of the
paper's tools:

- lip sync: the mouth opening measured from the frames against the speech's loudness,
  cross-correlated over +-15 frames as SyncNet searches offsets. `offset` is the lag (frames)
  of the best match, positive when the audio leads the mouth; `confidence` is the best
  correlation minus the median over lags (like LSE-C, higher is better); `distance` is one
  minus the best correlation (like LSE-D, lower is better).
- PSNR and SSIM between two runs of a clip, overall and per 10 s window, over the frames that
  differ; identical frames are counted apart (the paper's Appendix H).
- bootstrap intervals over clips for the mean of any per-clip number.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .synth import MOUTH_COLOR, loudness

MOUTH_RGB = np.array(MOUTH_COLOR) * 255  # the synthetic characters' mouth colour
MAX_OFFSET = 15


def mouth_opening(frames: np.ndarray, soft: float = 150.0) -> np.ndarray:
    """[T, H, W, 3] uint8 -> [T]: how much of the lower half of each frame is mouth. A pixel
    counts 1 - d / soft, where d is its L1 RGB distance to the mouth colour (0 beyond
    `soft`): a decoded mouth's blurred edge counts in part instead of not at all."""
    lower = frames[:, frames.shape[1] // 2:].astype(np.float32)
    d = np.abs(lower - MOUTH_RGB).sum(-1)
    return np.clip(1 - d / soft, 0, 1).sum(axis=(1, 2)).astype(np.float64)


@dataclass
class LipSync:
    offset: int
    confidence: float
    distance: float
    near: float  # best correlation within `near` frames of zero lag (one latent's timing)


def _corr(a: np.ndarray, b: np.ndarray) -> float:
    if a.std() < 1e-9 or b.std() < 1e-9:
        return 0.0
    return float(np.corrcoef(a, b)[0, 1])


def lip_sync(frames: np.ndarray, audio: np.ndarray, sample_rate: int, fps: int,
             max_offset: int = MAX_OFFSET, near: int = 4) -> LipSync:
    mouth = mouth_opening(frames)
    loud = loudness(audio, sample_rate, fps, len(mouth))
    corr = {}
    for k in range(-max_offset, max_offset + 1):  # mouth at t + k against audio at t
        if k >= 0:
            corr[k] = _corr(mouth[k:], loud[: len(loud) - k])
        else:
            corr[k] = _corr(mouth[:k], loud[-k:])
    best = max(corr, key=corr.get)
    return LipSync(best, corr[best] - float(np.median(list(corr.values()))), 1 - corr[best],
                   max(corr[k] for k in range(-near, near + 1)))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else float(10 * np.log10(255.0 ** 2 / mse))


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    from skimage.metrics import structural_similarity

    return float(structural_similarity(a, b, channel_axis=-1, data_range=255))


def compare_runs(a: np.ndarray, b: np.ndarray, fps: int, window_s: float = 10.0) -> dict:
    """Two runs of one clip, frames [T, H, W, 3]: PSNR / SSIM over the frames that differ,
    overall and per window, with the identical frames counted apart."""
    same = np.array([np.array_equal(x, y) for x, y in zip(a, b)])
    per = fps * window_s

    def stats(idx):
        diff = [i for i in idx if not same[i]]
        return {"frames": len(idx), "identical": int(sum(same[i] for i in idx)),
                "psnr": float(np.mean([psnr(a[i], b[i]) for i in diff])) if diff else None,
                "ssim": float(np.mean([ssim(a[i], b[i]) for i in diff])) if diff else None}

    T = len(a)
    return {"overall": stats(range(T)),
            "windows": [stats(range(int(s), min(T, int(s + per)))) for s in np.arange(0, T, per)]}


def bootstrap(values, n: int = 2000, level: float = 0.95, seed: int = 0):
    """(mean, low, high): a percentile bootstrap interval of the mean over clips."""
    v = np.asarray([x for x in values if x is not None], dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = rng.choice(v, size=(n, len(v)), replace=True).mean(axis=1)
    lo, hi = np.percentile(means, [(1 - level) / 2 * 100, (1 + level) / 2 * 100])
    return float(v.mean()), float(lo), float(hi)
