"""How far a numerics switch moves the output: one rank slice with random weights made on the
GPU, the same session (same weights, noise, audio, reference and prompt; eager steps) run under
each numerics variant, and each step's latent compared with the default numerics' by relative
L2 error. The default run is repeated to show the comparison's floor (run-to-run).

    python scripts/numerics_compare.py --preset characters-57b --tp 3 --steps 48

Variants: `precise` (FP8 GEMMs promoting their partial sums to fp32), `fast_accum` (without,
on both block linears), `fast_accum_w_in` (on the input projection only), `bf16_gemm` (the
block linears in bf16 over the dequantized FP8 weights: the error FP8 activations bring, for
scale), and the control `attention_rounding` (the FP8 attention kernel's other softmax
evaluation, AttentionTiles.fma flipped: only roundings move), which shows how far a change
that moves nothing but roundings moves the latents.
Writes docs/results/numerics_<preset>_<layout>_<gpu>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from charengine.assemble import rank_session
from charengine.characters.model import bake_adaln
from charengine.characters.spec import RankShape
from charengine.characters.weights import random_rank_state
from charengine.config import Numerics, preset
from charengine.characters.config import LINEARS, Switches
from charengine.engine_format import this_machine
from charengine.mapping import Mapping
from charengine.plugins.attention import AttentionTiles

CONTROLS = ("attention_rounding",)
FP32 = Numerics(dtype="float32", fp8_gemm=False, fp8_attention=False)
PLAIN_UPTO = "conditioning_cache"  # the last switch before the kernels (the cache in fp32)
VARIANTS = {
    "default": {},
    "precise": {"fast_accum": False},
    "fast_accum": {"fast_accum": True, "fast_accum_linears": LINEARS},
    "fast_accum_w_in": {"fast_accum": True, "fast_accum_linears": ("w_in",)},
    "bf16_gemm": {"fp8_gemm": False},
}


def session_latents(cfg, state, tables, mapping, inputs, attention_tiles=None) -> torch.Tensor:
    """The session of `cfg` on the rank's state, assembled as every rank is
    (charengine/assemble.py), eager; freed after."""
    session = rank_session(cfg, state, mapping, tables=tables, graphed=False,
                           attention_tiles=attention_tiles)
    ref, prompt, steps = inputs
    session.start(ref, prompt)
    return torch.stack([session.step(noise, audio).float().cpu() for noise, audio in steps])


def fp32_latents(base, spec, shape, seed, device, inputs) -> torch.Tensor:
    """The session under FP32 numerics: the same weights (the FP8 ones dequantized), fp32
    activations and cache, no FP8 activations or attention, and the plain path of every
    kernel switch (their parity with it is tested), in a model of its own that is freed
    after."""
    switches = dataclasses.replace(Switches.cumulative(PLAIN_UPTO), fp8_kv=False)
    cfg = base.replace(numerics=FP32, switches=switches)
    state, adaln_w = random_rank_state(spec, shape, seed, device, torch.float32,
                                       keep_adaln_weights=False)
    mapping = Mapping(base.tp, shape.rank, str(device), str(device), alone=True)
    return session_latents(cfg, state, bake_adaln(cfg, adaln_w), mapping, inputs)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="characters-57b")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--steps", type=int, default=48, help="crosses the reset at step 42")
    ap.add_argument("--exclude", type=int, default=6, help="steps left out of the summary")
    ap.add_argument("--variants", default="precise,fast_accum,bf16_gemm,attention_rounding")
    ap.add_argument("--reference", choices=("default", "fp32"), default="default",
                    help="what each run is compared with: the default numerics' run, or the "
                         "same weights in fp32 with no FP8 anywhere (and no kernels), the "
                         "model the quantized ones approximate")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gpu-tag", default="h200")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    args = ap.parse_args()

    device = torch.device(args.device)
    base = preset(args.preset, tp=args.tp)
    spec = base.model
    shape = RankShape.of(spec, args.tp, args.rank)
    g = torch.Generator().manual_seed(args.seed + 1)  # CPU: the same inputs on any device
    lat = (spec.latent_channels, spec.latent_h, spec.latent_w)
    inputs = (torch.randn(lat, generator=g).to(device),
              torch.randn(spec.prompt_tokens, spec.text_dim, generator=g).to(device),
              [(torch.randn(lat, generator=g).to(device),
                torch.randn(spec.audio_tokens, spec.audio_dim, generator=g).to(device))
               for _ in range(args.steps)])
    with torch.inference_mode():
        # the AdaLN weights (10.6B parameters at characters-57b) only to bake the tables
        state, adaln_w = random_rank_state(spec, shape, args.seed, device,
                                           getattr(torch, base.numerics.dtype),
                                           keep_adaln_weights=False)
        tables = bake_adaln(base, adaln_w)
        del adaln_w
        mapping = Mapping(args.tp, args.rank, str(device), str(device), alone=True)

        def run(cfg, tiles=None):
            return session_latents(cfg, state, tables, mapping, inputs, tiles)

        t0 = time.perf_counter()
        if args.reference == "fp32":
            ref = fp32_latents(base, spec, shape, args.seed, device, inputs)
            out = {"default": run(base)}
        else:
            ref = run(base)
            out = {"default_again": run(base)}
        for name in args.variants.split(","):
            if name in CONTROLS:  # the attention kernel's other softmax rounding
                out[name] = run(base, AttentionTiles(fma=not AttentionTiles().fma))
                continue
            if name not in VARIANTS or name == "default":
                raise SystemExit(f"unknown variant {name!r}; known: " + ", ".join(
                    [v for v in VARIANTS if v != "default"] + list(CONTROLS)))
            cfg = base.replace(numerics=dataclasses.replace(base.numerics, **VARIANTS[name]))
            out[name] = run(cfg)
        wall = time.perf_counter() - t0

    result = {"preset": args.preset, "layout": f"tp{args.tp}-rank{args.rank}",
              "gpu": args.gpu_tag, "steps": args.steps, "exclude": args.exclude,
              "machine": this_machine(), "date": time.strftime("%Y-%m-%d"), "wall_s": wall,
              "default_numerics": dataclasses.asdict(base.numerics), "reference": args.reference,
              "variants": {}}
    for name, lat_v in out.items():
        err = ((lat_v - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)).tolist()
        kept = err[args.exclude:]
        result["variants"][name] = {"rel_l2_median": statistics.median(kept),
                                    "rel_l2_max": max(kept), "rel_l2_per_step": err}
        print(f"{name:14s} rel L2 vs {args.reference}: median {statistics.median(kept):.3e}, "
              f"max {max(kept):.3e} (steps {args.exclude}-{args.steps - 1})")
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.reference == "default" else f"_vs-{args.reference}"
    path = args.out / f"numerics_{args.preset}_{result['layout']}_{args.gpu_tag}{suffix}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
