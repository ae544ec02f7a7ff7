"""Procedural talking-character clips (numpy only, so it runs anywhere): formant-synthesized
speech of random syllables, and a cartoon face with a random identity whose mouth opens with
the speech's loudness and takes the shape of its vowel, with idle blinks and a small head
sway. Used for the demo's inputs and as training and evaluation data for the tiny model.

The per-frame ground truth (mouth opening, vowel, blink) comes with each clip, so a
lip-sync scorer can be checked against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VOWELS = {  # first three formants (Hz), roughly an adult voice
    "a": (730, 1090, 2440), "e": (530, 1840, 2480), "i": (270, 2290, 3010),
    "o": (570, 840, 2410), "u": (300, 870, 2240),
}
MOUTH_COLOR = (0.45, 0.08, 0.1)
# mouth shape per vowel: (relative width, relative height at full opening)
MOUTH_SHAPE = {"a": (1.0, 1.0), "e": (1.2, 0.6), "i": (1.3, 0.4), "o": (0.7, 0.9),
               "u": (0.55, 0.6), "": (1.0, 0.0)}


def resonator(x: np.ndarray, f: float, bw: float, sr: int) -> np.ndarray:
    """Two-pole resonance at f with bandwidth bw."""
    r = np.exp(-np.pi * bw / sr)
    a1, a2 = -2 * r * np.cos(2 * np.pi * f / sr), r * r
    y = np.zeros_like(x)
    y1 = y2 = 0.0
    g = 1 - r
    for n, xn in enumerate(x):
        y0 = g * xn - a1 * y1 - a2 * y2
        y[n], y2, y1 = y0, y1, y0
    return y


def speech(seconds: float, sr: int, rng: np.random.Generator,
           pause_prob: float = 0.2) -> tuple[np.ndarray, np.ndarray]:
    """Random syllables: (samples in [-0.5, 0.5], the vowel of each sample: '' in pauses)."""
    out, labels = [], []
    n_total = int(seconds * sr)
    f0_base = rng.uniform(100, 220)  # one voice per clip
    while sum(map(len, out)) < n_total:
        if rng.random() < pause_prob:
            n = int(sr * rng.uniform(0.1, 0.4))
            out.append(np.zeros(n))
            labels.append(np.full(n, ""))
            continue
        n = int(sr * rng.uniform(0.15, 0.3))
        vowel = str(rng.choice(list(VOWELS)))
        f0 = f0_base * rng.uniform(0.9, 1.1) * np.linspace(1.05, 0.95, n)
        source = (np.diff(np.floor(np.cumsum(f0 / sr)), prepend=0) > 0).astype(float)
        voiced = sum(resonator(source, f, 80 + 0.05 * f, sr) * w
                     for f, w in zip(VOWELS[vowel], (1.0, 0.6, 0.3)))
        burst = int(sr * 0.04)
        voiced[:burst] += rng.normal(0, 0.02, burst) * (rng.random() < 0.6)  # a consonant
        out.append(voiced * np.sin(np.linspace(0, np.pi, n)) ** 0.5)
        labels.append(np.full(n, vowel))
    x = np.concatenate(out)[:n_total]
    peak = np.abs(x).max()
    return (0.5 * x / peak if peak else x), np.concatenate(labels)[:n_total]


@dataclass
class Identity:
    background: np.ndarray
    skin: np.ndarray
    hair: np.ndarray
    face_w: float
    face_h: float
    eye_gap: float
    eye_size: float
    hair_len: float

    @classmethod
    def random(cls, rng: np.random.Generator) -> "Identity":
        return cls(background=rng.uniform(0.2, 0.9, 3), skin=rng.uniform([0.5, 0.3, 0.2], [1.0, 0.9, 0.8]),
                   hair=rng.uniform(0, 0.6, 3), face_w=rng.uniform(0.22, 0.32),
                   face_h=rng.uniform(0.28, 0.38), eye_gap=rng.uniform(0.08, 0.13),
                   eye_size=rng.uniform(0.035, 0.065), hair_len=rng.uniform(0.1, 0.3))


def face(size: int, who: Identity, mouth_open: float = 0.0, vowel: str = "",
         blink: float = 0.0, dx: float = 0.0, dy: float = 0.0) -> np.ndarray:
    """One frame [size, size, 3] uint8. mouth_open and blink in [0, 1]; dx, dy a head offset
    in image fractions."""
    yy, xx = np.mgrid[0:size, 0:size] / size
    img = np.empty((size, size, 3))
    img[:] = who.background
    cx, cy = 0.5 + dx, 0.55 + dy

    def ellipse(ex, ey, rx, ry):
        return ((xx - ex) / rx) ** 2 + ((yy - ey) / ry) ** 2 <= 1

    img[ellipse(cx, cy - who.face_h * 0.55, who.face_w * 1.15, who.hair_len)
        & (yy < cy - who.face_h * 0.3)] = who.hair
    img[ellipse(cx, cy, who.face_w, who.face_h)] = who.skin
    eye_h = who.eye_size * max(0.08, 1 - blink)
    for ex in (cx - who.eye_gap, cx + who.eye_gap):
        img[ellipse(ex, cy - 0.06, who.eye_size * 1.3, eye_h)] = 1.0
        if blink < 0.7:
            img[ellipse(ex, cy - 0.06, who.eye_size * 0.55, min(eye_h, who.eye_size * 0.55))] = 0.1
    w, h = MOUTH_SHAPE[vowel]
    mw = who.face_w * 0.38 * w
    mh = 0.012 + who.face_h * 0.22 * h * mouth_open
    img[ellipse(cx, cy + who.face_h * 0.5, mw, mh)] = MOUTH_COLOR
    return (img * 255).round().astype(np.uint8)


@dataclass
class Clip:
    frames: np.ndarray  # [T, H, W, 3] uint8
    audio: np.ndarray  # [N] float32 at sample_rate
    mouth: np.ndarray  # [T] opening in [0, 1], the ground truth
    vowel: np.ndarray  # [T] str
    blink: np.ndarray  # [T] in [0, 1]
    identity: Identity
    fps: int
    sample_rate: int


def loudness(audio: np.ndarray, sample_rate: int, fps: int, frames: int) -> np.ndarray:
    """RMS per video frame."""
    hop = sample_rate / fps
    return np.array([np.sqrt(np.mean(audio[int(i * hop): int((i + 1) * hop)] ** 2) + 1e-12)
                     for i in range(frames)])


def envelope(audio: np.ndarray, sr: int, fps: int, frames: int) -> np.ndarray:
    """Loudness per video frame, normalized to the clip's speaking level, in [0, 1]."""
    rms = loudness(audio, sr, fps, frames)
    return np.clip(rms / (np.percentile(rms, 95) + 1e-9), 0, 1)


def clip(seconds: float, size: int, rng: np.random.Generator, fps: int = 24,
         sr: int = 16000, who: Identity | None = None) -> Clip:
    who = who or Identity.random(rng)
    audio, labels = speech(seconds, sr, rng)
    T = int(round(seconds * fps))
    mouth = envelope(audio, sr, fps, T) ** 0.7
    mouth = np.convolve(mouth, [0.25, 0.5, 0.25], mode="same")  # lips move smoothly
    vowel = np.array([labels[min(len(labels) - 1, int((i + 0.5) * sr / fps))] for i in range(T)])
    blink = np.zeros(T)
    t = int(rng.uniform(0.5, 3) * fps)
    while t < T:
        for j, b in enumerate((0.5, 1.0, 1.0, 0.5)):
            if t + j < T:
                blink[t + j] = b
        t += int(rng.uniform(2, 5) * fps)
    phase, rate = rng.uniform(0, 2 * np.pi), rng.uniform(0.2, 0.5)
    k = np.arange(T) / fps
    dx = 0.02 * np.sin(2 * np.pi * rate * k + phase)
    dy = 0.01 * np.sin(2 * np.pi * rate * 0.7 * k + phase * 1.3)
    frames = np.stack([face(size, who, mouth[i], vowel[i] if mouth[i] > 0.05 else "", blink[i],
                            dx[i], dy[i]) for i in range(T)])
    return Clip(frames, audio.astype(np.float32), mouth, vowel, blink, who, fps, sr)
