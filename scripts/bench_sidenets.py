"""Time a preset's side networks, any family, random weights, through the family's own parts:
the decoder per step as a live session runs it (`session_decoder`: its causal state carried
from step to step; the first step, decoded from a cold state, reported apart from the steady
ones), for arms of dtype and layout, with each arm's FLOP count (torch's FlopCounterMode over
one steady step) and its largest frame difference from the first arm; and the audio encoder
over one step's window (`encode_audio`).

Arms (--arms, comma-separated): `preset` (the side networks as the engine loads them: the
family's dtypes and its decoder switches), `float32`, `bfloat16`, each with `-cl` for the
3-D convs' weights channels-last (cuDNN picks its algorithms). --side NAME=VALUE overrides a
field of the preset's side-network spec (a candidate decoder, e.g. the characters family's
--side decoder_channels=384,384,192,96,96 --side decoder_convs=1).

    python scripts/bench_sidenets.py --preset characters-57b --reps 9
    python scripts/bench_sidenets.py --preset livetalk-1.3b --arms preset,float32,float32-cl,bfloat16,bfloat16-cl \\
        --out docs/results/livetalk/sidenets_livetalk-1.3b.json
    python scripts/bench_sidenets.py --preset tiny-livetalk --device cpu --arms float32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from charengine.config import preset
from charengine.family import family_of
from charengine.timing import cuda_ms, median

# the step whose window the audio encoder is timed on: a steady one, its window whole in
# every preset (livetalk-1.3b's is from chunk 6 on)
AUDIO_STEP = 20


def side_override(spec, overrides: list[str]):
    """The spec with fields of its side-network spec replaced (NAME=VALUE, a comma list for
    a tuple field)."""
    fields = {}
    for o in overrides:
        name, _, value = o.partition("=")
        old = getattr(spec.side, name)
        parse = type(old[0]) if isinstance(old, tuple) else type(old)
        fields[name] = tuple(parse(v) for v in value.split(",")) if isinstance(old, tuple) \
            else parse(value)
    return dataclasses.replace(spec, side=dataclasses.replace(spec.side, **fields))


def arm_side(fam, cfg, state, device, arm: str):
    """The side networks loaded as the engine loads them, then cast and laid out for `arm`."""
    side = fam.load_side(cfg, state, device)
    dtype, _, layout = arm.partition("-")
    if dtype != "preset":
        side.to(getattr(torch, dtype))
    if layout == "cl":
        for prm in side.parameters():
            if prm.dim() == 5:  # the 3-D convs' weights
                prm.data = prm.data.contiguous(memory_format=torch.channels_last_3d)
    return side


def loaded_side(fam, cfg, state, device):
    """The side networks as a worker loads them: on a GPU warmed up (graphs captured)."""
    side = fam.load_side(cfg, state, device)
    if device.type == "cuda":
        fam.warm_up_side(side, cfg.model, device)
    return side


def encode_ms(fam, cfg, state, device, window, reps: int) -> float:
    """The median time of one steady step's audio encode (AUDIO_STEP's window), with the
    side networks as `cfg` loads them."""
    side = loaded_side(fam, cfg, state, device)
    return median(cuda_ms(lambda: fam.encode_audio(side, cfg.model, window, AUDIO_STEP),
                          reps, warmup=2, device=device))


def audio_diff(fam, cfg, other, state, device, window) -> float:
    """The largest difference between a steady step's audio features under two configs."""
    a, b = (fam.encode_audio(loaded_side(fam, c, state, device), c.model, window, AUDIO_STEP)
            for c in (cfg, other))
    return float((a.float() - b.float()).abs().max())


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="livetalk-1.3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--arms", default=None, help="default: preset,float32,bfloat16 on a GPU, "
                                                 "float32 on a CPU")
    ap.add_argument("--side", action="append", default=[], metavar="NAME=VALUE",
                    help="a field of the preset's side-network spec, overridden")
    ap.add_argument("--steps", type=int, default=6, help="steps decoded per timed run")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = True
    cfg = preset(args.preset)
    if args.side:
        cfg = dataclasses.replace(cfg, model=side_override(cfg.model, args.side))
    spec, fam = cfg.model, family_of(cfg)
    arms = (args.arms or ("preset,float32,bfloat16" if device.type == "cuda" else "float32"))
    state = fam.random_side_state(spec, args.seed)
    g = torch.Generator().manual_seed(args.seed)
    shapes = fam.step_shapes(spec)
    latents = [torch.randn(shapes.latent, generator=g).to(device) for _ in range(args.steps)]

    def decode(decoder, n: int):
        decoder.reset()
        return [decoder(z) for z in latents[:n]]

    results, ref = [], None
    with torch.inference_mode():
        for arm in arms.split(","):
            side = arm_side(fam, cfg, state, device, arm)
            decoder = fam.session_decoder(side)
            frames = decode(decoder, args.steps)  # warm: cuDNN's choice, workspaces
            frames = [f.float().cpu() for f in frames]
            ref = ref or frames
            diff = max(float((f - r).abs().max()) for f, r in zip(frames, ref))
            with FlopCounterMode(display=False) as flops:
                decode(decoder, 2)
            first = median(cuda_ms(lambda: decode(decoder, 1), args.reps, warmup=1,
                                   device=device))
            runs = cuda_ms(lambda: decode(decoder, args.steps), args.reps, warmup=1,
                           device=device)
            steady = (median(runs) - first) / (args.steps - 1)
            with FlopCounterMode(display=False) as one:
                decode(decoder, 1)
            step_tflop = (flops.get_total_flops() - one.get_total_flops()) / 1e12
            results.append({"arm": arm, "step_ms": steady, "first_step_ms": first,
                            "step_tflop": step_tflop,
                            "tflops": step_tflop / steady * 1e3 if steady > 0 else None,
                            "max_abs_diff_vs_first_arm": diff, "runs_ms": runs,
                            "frames_per_step": spec.frames_per_latent})
            print(json.dumps({k: v for k, v in results[-1].items() if k != "runs_ms"}),
                  flush=True)
            del side
        window = torch.randn(fam.window_samples(spec), generator=g).to(device)
        enc_ms = encode_ms(fam, cfg, state, device, window, args.reps * 4)
        # the same without the audio encoder's graph, where the family has one
        eager_ms, eager_diff = None, None
        if device.type == "cuda" and getattr(cfg.switches, "audio_graph", False):
            plain = cfg.replace(switches=dataclasses.replace(cfg.switches, audio_graph=False))
            eager_ms = encode_ms(fam, plain, state, device, window, args.reps * 4)
            eager_diff = audio_diff(fam, cfg, plain, state, device, window)
    audio = {"audio_encoder_step_ms": enc_ms, "audio_encoder_eager_step_ms": eager_ms,
             "audio_graph_max_abs_diff": eager_diff}
    print(json.dumps(audio))
    if args.out:
        summary = {"preset": spec.name, "side": args.side,
                   "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                   else "cpu", "date": time.strftime("%Y-%m-%d"), "decoder": results,
                   **audio}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
