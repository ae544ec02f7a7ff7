"""Procedural talking-character clips for training and evaluation (tinychar.synth): random
identities, formant speech, mouths that follow the speech, blinks and head sway, at a preset's
output size and frame rate with 16 kHz audio. One safetensors file per split; optional MP4s.

    python scripts/make_clips.py --out data/clips --train 200 --heldout 20 --seconds 8
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from charengine.characters.spec import PRESETS
from tinychar.synth import clip


def write_split(path: Path, clips) -> None:
    tensors, meta = {}, []
    for i, c in enumerate(clips):
        tensors[f"{i}.frames"] = torch.from_numpy(c.frames)
        tensors[f"{i}.audio"] = torch.from_numpy(c.audio)
        tensors[f"{i}.mouth"] = torch.from_numpy(c.mouth.astype(np.float32))
        tensors[f"{i}.blink"] = torch.from_numpy(c.blink.astype(np.float32))
        meta.append({"vowel": "".join(v or "-" for v in c.vowel)})
    save_file(tensors, str(path), metadata={"clips": json.dumps(meta), "fps": str(clips[0].fps),
                                            "sample_rate": str(clips[0].sample_rate)})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("data/clips"))
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--train", type=int, default=200)
    ap.add_argument("--heldout", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mp4", type=int, default=0, help="also write this many clips as MP4")
    args = ap.parse_args()
    spec = PRESETS[args.preset]
    args.out.mkdir(parents=True, exist_ok=True)
    # held-out clips come from another seed stream: identities and speech never seen in training
    for split, n, seed in (("train", args.train, args.seed), ("heldout", args.heldout, args.seed + 10**6)):
        if n == 0:
            continue
        rng = np.random.default_rng(seed)
        clips = [clip(args.seconds, spec.out_h, rng, spec.fps, spec.side.sample_rate) for _ in range(n)]
        write_split(args.out / f"{split}.safetensors", clips)
        for i, c in enumerate(clips[: args.mp4]):
            from charengine.runtime.media import Mp4Writer

            w = Mp4Writer(args.out / f"{split}_{i}.mp4", spec.out_w, spec.out_h, spec.fps, c.sample_rate)
            w.write(torch.from_numpy(c.frames).permute(0, 3, 1, 2).float() / 255, torch.from_numpy(c.audio))
            w.close()
        print(f"{split}: {n} clips of {args.seconds} s -> {args.out / (split + '.safetensors')}")


if __name__ == "__main__":
    main()
