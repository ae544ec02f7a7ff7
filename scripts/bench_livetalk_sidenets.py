"""Time LiveTalk's side networks at a preset's size on one GPU, random weights: the Wan VAE's
streaming decoder per steady chunk (3 latents -> 12 frames, its causal cache carried), in fp32
and bf16, contiguous and channels-last 3-D (cuDNN picks its algorithms), with each variant's
largest frame difference from fp32; and the wav2vec2 window per chunk.

    python scripts/bench_livetalk_sidenets.py --preset livetalk-1.3b \\
        --out docs/results/livetalk/sidenets_livetalk-1.3b.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from charengine.livetalk import audio
from charengine.livetalk.sidenets import load_side, random_side_state
from charengine.livetalk.spec import PRESETS
from charengine.timing import cuda_ms, median

VARIANTS = (("float32", False), ("float32", True), ("bfloat16", False), ("bfloat16", True))


def decode_chunks(side, latents: list[torch.Tensor]) -> list[torch.Tensor]:
    side.decoder.reset()
    return [side.decoder(z) for z in latents]


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="livetalk-1.3b")
    ap.add_argument("--chunks", type=int, default=6, help="chunks decoded per timed run")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    spec = PRESETS[args.preset]
    dev = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    state = random_side_state(spec, args.seed)
    g = torch.Generator().manual_seed(args.seed)
    latents = [torch.randn(spec.latent_channels, spec.chunk_frames, spec.latent_h,
                           spec.latent_w, generator=g).to(dev) for _ in range(args.chunks)]
    results, ref = [], None
    with torch.inference_mode():
        for dtype, cl in VARIANTS:
            side = load_side(spec, state, dev)
            side.vae.to(getattr(torch, dtype))
            if cl:  # the 3-D convs' weights (the only 5-D tensors) channels-last
                for prm in side.vae.parameters():
                    if prm.dim() == 5:
                        prm.data = prm.data.contiguous(memory_format=torch.channels_last_3d)
            side.ready()
            frames = decode_chunks(side, latents)  # warm: cuDNN's choice, workspaces
            if ref is None:
                ref = [f.cpu() for f in frames]
            diff = max(float((f.cpu() - r).abs().max()) for f, r in zip(frames, ref))
            per_run = cuda_ms(lambda: decode_chunks(side, latents), args.reps, warmup=1,
                              device=dev)
            # the first chunk decodes 9 frames from a cold cache: report the steady chunks
            first = median(cuda_ms(lambda: decode_chunks(side, latents[:1]), args.reps,
                                   warmup=1, device=dev))
            steady = (median(per_run) - first) / (args.chunks - 1)
            results.append({"dtype": dtype, "channels_last": cl, "chunk_ms": steady,
                            "first_chunk_ms": first, "max_abs_diff_vs_fp32": diff,
                            "runs_ms": per_run})
            print(json.dumps({k: v for k, v in results[-1].items() if k != "runs_ms"}),
                  flush=True)
            del side
        side = load_side(spec, state, dev)
        window = torch.randn(audio.window_samples(spec.audio), generator=g).to(dev)
        enc_ms = median(cuda_ms(lambda: audio.chunk_features(spec.audio, side.audio_encoder,
                                                             window, 5),
                                args.reps * 4, warmup=2, device=dev))
    summary = {"preset": spec.name, "gpu": torch.cuda.get_device_name(dev),
               "date": time.strftime("%Y-%m-%d"), "decoder": results,
               "audio_encoder_chunk_ms": enc_ms}
    print(json.dumps({"audio_encoder_chunk_ms": enc_ms}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
