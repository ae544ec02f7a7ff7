"""Make the demo's inputs (tinychar.synth): a cartoon face (assets/face.png) and
formant-synthesized speech of random syllables (assets/speech.wav, 16 kHz mono)."""

from __future__ import annotations

import argparse
import wave
from pathlib import Path

import numpy as np

from tinychar.synth import Identity, face, speech


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("assets"))
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    sr = 16000
    audio, _ = speech(args.seconds, sr, rng)
    with wave.open(str(args.out / "speech.wav"), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sr)
        w.writeframes((audio * 32767).astype("<i2").tobytes())
    from charengine.runtime.media import write_png

    write_png(args.out / "face.png", face(256, Identity.random(rng)))
    print(f"wrote {args.out}/speech.wav ({args.seconds} s) and {args.out}/face.png")


if __name__ == "__main__":
    main()
