"""Time a preset's side networks, any family, random weights, through the family's own parts:
the decoder per step as a live session runs it (`session_decoder`: its causal state carried
from step to step; the first step, decoded from a cold state, reported apart from the steady
ones), for arms of dtype and layout, with each arm's FLOP count (torch's FlopCounterMode over
one steady step) and its largest frame difference from the first arm; and the audio encoder
over one steady step's window (`encode_audio`) as the engine loads it, then with each of the
family's audio switches off in turn (on a GPU), each with its features' error against the
plain encoder.

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
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from charengine.config import preset
from charengine.family import family_of
from charengine.timing import cuda_ms, median
from charengine.provenance import provenance

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


def audio_arms(cfg, device) -> list[tuple[str, object]]:
    """The audio encoder's arms: the preset, then its family's audio switches (AUDIO) turned
    off one more at a time from the last, down to the plain encoder (on a GPU; on a CPU they
    change nothing, so the preset alone)."""
    names = getattr(type(cfg.switches), "AUDIO", ()) if device.type == "cuda" else ()
    arms = [("preset", cfg)]
    for i in range(len(names)):
        off = names[len(names) - 1 - i:]
        arms.append(("without " + ",".join(off), cfg.replace(switches=dataclasses.replace(
            cfg.switches, **{n: False for n in off}))))
    return arms


def audio_results(fam, cfg, state, device, window, reps: int) -> list[dict]:
    """Each audio arm's steady step time and its features' error against the last arm (the
    plain encoder): relative L2 and largest difference."""
    out, feats = [], []
    for name, c in audio_arms(cfg, device):
        side = loaded_side(fam, c, state, device)
        ms = median(cuda_ms(lambda: fam.encode_audio(side, c.model, window, AUDIO_STEP), reps,
                            warmup=2, device=device))
        feats.append(fam.encode_audio(side, c.model, window, AUDIO_STEP).float())
        out.append({"arm": name, "step_ms": ms})
    for r, f in zip(out, feats):
        r["rel_l2_vs_plain"] = float((f - feats[-1]).norm() / feats[-1].norm())
        r["max_abs_diff_vs_plain"] = float((f - feats[-1]).abs().max())
    return out


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
        audio = {"audio_encoder": audio_results(fam, cfg, state, device, window,
                                                args.reps * 4)}
    print(json.dumps(audio))
    if args.out:
        summary = {"preset": spec.name, "side": args.side,
                   "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                   else "cpu", **provenance(), "decoder": results,
                   **audio}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
