"""Make the demo's inputs: a cartoon face (assets/face.png) and formant-synthesized speech of
random syllables (assets/speech.wav, 16 kHz mono). Deterministic for a seed; numpy only."""

from __future__ import annotations

import argparse
import wave
from pathlib import Path

import numpy as np

VOWELS = {  # first three formants (Hz), roughly an adult voice
    "a": (730, 1090, 2440), "e": (530, 1840, 2480), "i": (270, 2290, 3010),
    "o": (570, 840, 2410), "u": (300, 870, 2240),
}


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


def speech(seconds: float, sr: int, rng: np.random.Generator) -> np.ndarray:
    out = []
    while sum(map(len, out)) < seconds * sr:
        if rng.random() < 0.2:  # a pause between words
            out.append(np.zeros(int(sr * rng.uniform(0.1, 0.3))))
            continue
        n = int(sr * rng.uniform(0.15, 0.3))
        f0 = rng.uniform(110, 180) * np.linspace(1.05, 0.95, n)
        phase = np.cumsum(f0 / sr)
        source = (np.diff(np.floor(phase), prepend=0) > 0).astype(float)  # glottal pulses
        voiced = sum(resonator(source, f, 80 + 0.05 * f, sr) * w
                     for f, w in zip(VOWELS[rng.choice(list(VOWELS))], (1.0, 0.6, 0.3)))
        burst = int(sr * 0.04)
        voiced[:burst] += rng.normal(0, 0.02, burst) * (rng.random() < 0.6)  # a consonant
        env = np.sin(np.linspace(0, np.pi, n)) ** 0.5
        out.append(voiced * env)
    x = np.concatenate(out)[: int(seconds * sr)]
    return 0.5 * x / np.abs(x).max()


def face(size: int, rng: np.random.Generator) -> np.ndarray:
    yy, xx = np.mgrid[0:size, 0:size] / size
    img = np.zeros((size, size, 3))
    img[:] = rng.uniform(0.3, 0.9, 3)  # background
    skin = rng.uniform([0.6, 0.4, 0.3], [1.0, 0.85, 0.7])

    def ellipse(cx, cy, rx, ry):
        return ((xx - cx) / rx) ** 2 + ((yy - cy) / ry) ** 2 <= 1

    img[ellipse(0.5, 0.38, 0.33, 0.22) & (yy < 0.4)] = rng.uniform(0, 0.5, 3)  # hair
    img[ellipse(0.5, 0.55, 0.28, 0.34)] = skin
    for cx in (0.39, 0.61):
        img[ellipse(cx, 0.5, 0.06, 0.04)] = 1.0
        img[ellipse(cx, 0.5, 0.025, 0.025)] = 0.1
    img[ellipse(0.5, 0.72, 0.1, 0.03)] = (0.5, 0.1, 0.1)  # mouth
    return (img * 255).round().astype(np.uint8)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("assets"))
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    sr = 16000
    pcm = (speech(args.seconds, sr, rng) * 32767).astype("<i2")
    with wave.open(str(args.out / "speech.wav"), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sr)
        w.writeframes(pcm.tobytes())
    from charengine.runtime.media import write_png

    write_png(args.out / "face.png", face(256, rng))
    print(f"wrote {args.out}/speech.wav ({args.seconds} s) and {args.out}/face.png")


if __name__ == "__main__":
    main()
