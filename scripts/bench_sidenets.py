"""Time the side networks at a preset's size: the decoder (one latent -> 4 frames, causal
state carried across latents) for candidate channel widths, and the audio encoder per step.
The paper's decoder takes 114 ms per latent on an H100 in bf16, its audio encoder 9 ms.

    python scripts/bench_sidenets.py --preset characters-57b \\
        --decoder 384,384,192,96,96x1 --decoder 512,512,256,128,128x2
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from charengine.characters.audio import AudioEncoder, window_samples
from charengine.characters.spec import PRESETS
from charengine.characters.decoder import Decoder
from charengine.timing import cuda_ms, median


def time_ms(fn, device, reps: int) -> float:
    """Median milliseconds of fn() after two warm calls (CUDA events on a GPU)."""
    return median(cuda_ms(fn, reps, warmup=2, device=device))


def conv_tflop(spec) -> float:
    """FLOP of the decoder's convs for one latent (3x3x3 kernels), in TFLOP."""
    ch, n = spec.side.decoder_channels, spec.side.decoder_convs
    t, h, w = 1, spec.latent_h, spec.latent_w
    total = 2 * 27 * spec.latent_channels * ch[0] * t * h * w
    nt = spec.frames_per_latent.bit_length() - 1
    ns = spec.vae_stride.bit_length() - 1
    for i in range(len(ch) - 1):
        t, h, w = t * (2 if i < nt else 1), h * (2 if i < ns else 1), w * (2 if i < ns else 1)
        for j in range(n):
            total += 2 * 27 * (ch[i] if j == 0 else ch[i + 1]) * ch[i + 1] * t * h * w
    total += 2 * 27 * ch[-1] * 3 * t * h * w
    return total / 1e12


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="characters-57b")
    ap.add_argument("--decoder", action="append", default=[],
                    help="channels,...xconvs_per_stage (default: the preset's)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--channels-last", action="store_true")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = True
    base = PRESETS[args.preset]
    variants = []
    for v in args.decoder or [None]:
        side = base.side
        if v:
            chs, n = v.split("x")
            side = dataclasses.replace(side, decoder_channels=tuple(int(c) for c in chs.split(",")),
                                       decoder_convs=int(n))
        variants.append(dataclasses.replace(base, side=side))
    results = []
    with torch.inference_mode():
        for spec in variants:
            dec = Decoder(spec).to(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
            if args.channels_last:
                dec = dec.to(memory_format=torch.channels_last_3d)
            latent = torch.randn(spec.latent_channels, spec.latent_h, spec.latent_w, device=device)
            ms = time_ms(lambda d=dec: d(latent), device, args.reps)
            results.append({"decoder_channels": spec.side.decoder_channels,
                            "decoder_convs": spec.side.decoder_convs, "decoder_ms": ms,
                            "decoder_tflop": conv_tflop(spec),
                            "params_m": sum(p.numel() for p in dec.parameters()) / 1e6})
            print(json.dumps(results[-1]), flush=True)
            del dec
        enc = AudioEncoder(base).to(device)
        w = torch.randn(window_samples(base), device=device)
        print(json.dumps({"audio_encoder_ms": time_ms(lambda: enc(w), device, args.reps * 4)}))


if __name__ == "__main__":
    main()
