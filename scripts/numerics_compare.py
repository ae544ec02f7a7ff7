"""How far each change of numerics moves the output, any family: one process, random weights
of the preset made on the device, the same reference latent, prompt features, noise and
audio features for every arm (drawn on the CPU from one seed), a session of --steps steps
crossing position resets, eager steps (as charrun's rank assembles its session). Per step,
the relative L2 distance of the step's clean latent from the reference arm's; median and
max over the steps after --exclude, and the largest at a reset.

The arms are the family's numerics ladder (`Family.numerics_ladder`, each family's
`arms.py` says what each arm is): the characters family's fp32, default, precise,
fast_accum, fast_accum_w_in, bf16_gemm, attention_rounding (a change of roundings alone,
for scale) and default_again (the run-to-run floor); LiveTalk's fp32_plain, bf16_plain,
bf16, fp8_gemm, fp8_kv, fused, production and production_again, each cumulative on the one
before. --reference picks the arm the others are measured from (default: the ladder's
first, the fp32 model the others approximate).

    python scripts/numerics_compare.py --preset livetalk-1.3b --device cuda --steps 60
    python scripts/numerics_compare.py --preset characters-57b --tp 3 --rank 0 --steps 48 \\
        --reference default --arms default_again,precise,fast_accum,bf16_gemm,attention_rounding

Writes docs/results/numerics_<preset>_<layout>_<gpu>_vs-<reference>.json (--out: the folder).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from charengine.config import preset
from charengine.engine_format import this_machine
from charengine.family import family_of
from charengine.provenance import provenance


def session_latents(fam, cfg, name, weights, device, rank, inputs):
    """Every step's clean latent (fp32, on the CPU) of arm `name`'s eager session, the steps
    that reset positions, and the arm's config; the session is freed after."""
    session = fam.numerics_session(cfg, name, weights, device, rank)
    ref, prompt, steps = inputs
    session.start(ref, prompt)
    out = torch.stack([session.step(noise, audio).float().cpu() for noise, audio in steps])
    resets = [k for k in range(len(steps)) if session.rule.resets_at(session.cache, k)]
    arm_cfg = session.cfg
    del session
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out, resets, arm_cfg


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="livetalk-1.3b")
    ap.add_argument("--tp", type=int, default=1, help="the layout's TP degree (a rank slice)")
    ap.add_argument("--rank", type=int, default=0, help="the TP rank measured alone")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--gpu-tag", default="h200")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--exclude", type=int, default=5,
                    help="steps left out of the summary (the cache filling)")
    ap.add_argument("--reference", default=None,
                    help="the arm the others are compared with (default: the ladder's first)")
    ap.add_argument("--arms", default=None,
                    help="the arms besides the reference, comma-separated (default: the rest "
                         "of the ladder)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    args = ap.parse_args()
    base = preset(args.preset, tp=args.tp)
    fam = family_of(base)
    ladder = fam.numerics_ladder()
    reference = args.reference or ladder[0]
    arms = [a for a in args.arms.split(",") if a] if args.arms is not None else \
        [a for a in ladder if a != reference]
    unknown = [a for a in [reference, *arms] if a not in ladder]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; known: {', '.join(ladder)}")
    if args.exclude >= args.steps:
        raise SystemExit("--exclude leaves no step")
    # the fp32 reference in fp32 throughout (no TF32 in any convolution or matmul); the bf16
    # and FP8 arms are unaffected
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False

    device = torch.device(args.device)
    shapes = fam.step_shapes(base.model)
    g = torch.Generator().manual_seed(args.seed + 1)  # CPU: the same inputs on any device
    inputs = (torch.randn(shapes.reference, generator=g).to(device),
              torch.randn(shapes.prompt, generator=g).to(device),
              [(torch.randn(shapes.noise_shape, generator=g).to(device),
                torch.randn(shapes.features, generator=g).to(device))
               for _ in range(args.steps)])
    lat, walls, cfgs = {}, {}, {}
    with torch.inference_mode():
        t0 = time.perf_counter()
        weights = fam.numerics_weights(base, args.seed, device, args.rank)
        weights_s = time.perf_counter() - t0
        for arm in [reference, *arms]:
            t = time.perf_counter()
            lat[arm], resets_of, cfgs[arm] = session_latents(fam, base, arm, weights, device,
                                                             args.rank, inputs)
            if arm == reference:
                resets = resets_of
            walls[arm] = time.perf_counter() - t
            print(f"{arm:>18}: {walls[arm]:.1f} s", flush=True)

    layout = f"tp{args.tp}-rank{args.rank}" if args.tp > 1 else "tp1"
    switch_order = fam.config_types["switches"].ORDER
    ref = lat[reference]
    result = {"preset": args.preset, "family": fam.name, "layout": layout,
              "gpu": args.gpu_tag, "device": str(device), "steps": args.steps,
              "exclude": args.exclude, "reset_steps": resets, "reference": reference,
              "order": [reference, *arms], "machine": this_machine(),
              **provenance(), "weights_s": weights_s,
              "wall_s": sum(walls.values()), "arms": {}}
    for arm in result["order"]:
        err = ((lat[arm] - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)).tolist()
        kept = err[args.exclude:]
        cfg = cfgs[arm]
        result["arms"][arm] = {
            "rel_l2_median": statistics.median(kept), "rel_l2_max": max(kept),
            "rel_l2_reset_max": max(err[c] for c in resets if c >= args.exclude)
            if any(c >= args.exclude for c in resets) else None,
            "rel_l2_per_step": err, "wall_s": walls[arm],
            "switches_on": [n for n in switch_order if getattr(cfg.switches, n)],
            "numerics": dataclasses.asdict(cfg.numerics)}
        print(f"{arm:>18} rel L2 vs {reference}: median {statistics.median(kept):.3e}, "
              f"max {max(kept):.3e} (steps {args.exclude}-{args.steps - 1})")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"numerics_{args.preset}_{layout}_{args.gpu_tag}_vs-{reference}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
