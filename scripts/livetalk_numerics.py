"""How far each LiveTalk switch that changes numerics moves the output, against the fp32 plain
path on the same weights: one process, random weights of the preset (block linears FP8 as the
engine stores them; the fp32 and bf16 arms run those weights dequantized), the same reference
latent, prompt features, noise and audio features for every arm (drawn on the CPU from one
seed), a session of --chunks chunks crossing position resets, eager steps (as charrun's rank
assembles its session, charengine/assemble.py). Per chunk, the relative L2 distance of the
chunk's clean latent from the fp32 reference's; median and max over the chunks after
--exclude.

    python scripts/livetalk_numerics.py --preset livetalk-1.3b --device cuda --chunks 60

Arms, each cumulative on the one before from `bf16` on (ARMS):
  fp32_plain        the reference: fp32 activations and cache, no FP8, every kernel switch off
                    (the position reset on: the session's positions are the same in every arm)
  bf16_plain        the same path in bf16
  bf16              every switch but the FP8 cache and the fused kernels, bf16 GEMMs
  fp8_gemm          + FP8 GEMMs (per-token activations, promoted sums)
  fp8_kv            + the FP8 KV cache and FP8 attention over it
  fused             + the fused kernels (FUSED: the fused_* switches of ORDER that change
                    roundings, and the bias in the GEMM's epilogue)
  production        the preset as it is (fast accumulation with it)
  production_again  the preset run again: the comparison's floor (run to run)
Writes docs/results/livetalk/numerics_<preset>_<gpu>_vs-fp32.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from charengine import fp8
from charengine.assemble import rank_session
from charengine.config import Numerics, preset
from charengine.engine_format import this_machine
from charengine.family import family
from charengine.livetalk.spec import FP8_CACHE, LiveTalkSwitches
from charengine.livetalk.weights import block_linears, device_random_weights
from charengine.mapping import Mapping


REFERENCE, CONTROL, PRODUCTION = "fp32_plain", "production_again", "production"
ARMS = (REFERENCE, "bf16_plain", "bf16", "fp8_gemm", "fp8_kv", "fused", PRODUCTION, CONTROL)
SEMANTIC = ("position_reset",)  # switches that change what is computed: on in every arm
# fused_* switches that compute the same products and sums as the unfused path (one GEMM of
# the concatenated q, k, v weights): on from the `bf16` arm
SAME_SUMS = ("fused_qkv",)
FP32 = Numerics(dtype="float32", fp8_gemm=False, fp8_attention=False, fast_accum=False)
BF16 = dataclasses.replace(FP32, dtype="bfloat16")


def fused_switches() -> tuple[str, ...]:
    """The switches of the `fused` arm, from ORDER as it is now."""
    return tuple(n for n in LiveTalkSwitches.ORDER
                 if n.startswith("fused_") and n not in SAME_SUMS) + ("gemm_bias",)


def arm_cfg(base, arm: str):
    """The config of numerics arm `arm` on the preset `base`."""
    if arm in (PRODUCTION, CONTROL):
        return base
    if arm in (REFERENCE, "bf16_plain"):
        switches = dataclasses.replace(LiveTalkSwitches.baseline(), **{n: True for n in SEMANTIC})
        return base.replace(switches=switches, numerics=FP32 if arm == REFERENCE else BF16)
    steps = ARMS[ARMS.index("bf16"):ARMS.index(arm) + 1]
    off = set() if "fused" in steps else set(fused_switches())
    if "fp8_kv" not in steps:
        off.add(FP8_CACHE)
    switches = dataclasses.replace(base.switches, **{n: False for n in off})
    numerics = dataclasses.replace(BF16, fp8_gemm="fp8_gemm" in steps,
                                   fp8_attention="fp8_kv" in steps)
    return base.replace(switches=switches, numerics=numerics)


def dequantized(spec, full: dict) -> dict:
    """`full` with each block linear's weight replaced by its FP8 quantization (the engine's,
    weights.rank_weights) dequantized to fp32: the weights the FP8 arms run."""
    out = dict(full)
    for base in block_linears(spec):
        q, scale = fp8.quantize_rows(full[f"{base}.weight"].float())
        out[f"{base}.weight"] = fp8.dequantize(q, scale)
    return out


def session_latents(cfg, full, device, inputs) -> tuple[torch.Tensor, list[int]]:
    """Every chunk's clean latent (fp32, on the CPU) of an eager session of `cfg` on the
    state made from `full`, and the chunks that were position resets; the session is freed
    after."""
    fam = family(cfg.family)
    state = fam.rank_state(cfg, full)
    session = rank_session(cfg, state, Mapping.single(str(device)),
                           tables=fam.bake_tables(cfg, full), graphed=False)
    ref, prompt, chunks = inputs
    session.start(ref, prompt)
    out = torch.stack([session.step(noise, audio).float().cpu() for noise, audio in chunks])
    resets = [c for c in range(len(chunks)) if session.cache.is_reset(c)]
    del session, state
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out, resets


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="livetalk-1.3b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--gpu-tag", default="h200")
    ap.add_argument("--chunks", type=int, default=60)
    ap.add_argument("--exclude", type=int, default=5,
                    help="chunks left out of the summary (the sink and the window filling)")
    ap.add_argument("--arms", default=",".join(ARMS[1:]),
                    help="the arms besides the reference, comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("docs/results/livetalk"))
    args = ap.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS or a == REFERENCE]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; known: {', '.join(ARMS[1:])}")
    if args.exclude >= args.chunks:
        raise SystemExit("--exclude leaves no chunk")
    # the fp32 reference in fp32 throughout (no TF32 in the patch embedding's convolution
    # or any matmul); the bf16 arms are unaffected
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False

    device = torch.device(args.device)
    base = preset(args.preset)
    spec = base.model
    shapes = family(base.family).step_shapes(spec)
    g = torch.Generator().manual_seed(args.seed + 1)  # CPU: the same inputs on any device
    inputs = (torch.randn(shapes.reference, generator=g).to(device),
              torch.randn(shapes.prompt, generator=g).to(device),
              [(torch.randn(shapes.noise_shape, generator=g).to(device),
                torch.randn(shapes.features, generator=g).to(device))
               for _ in range(args.chunks)])
    lat, walls = {}, {}
    with torch.inference_mode():
        t0 = time.perf_counter()
        full = device_random_weights(spec, args.seed, device)
        full_dq = dequantized(spec, full)
        weights_s = time.perf_counter() - t0
        for arm in [REFERENCE, *arms]:
            cfg = arm_cfg(base, arm)
            t = time.perf_counter()
            # the FP8 arms quantize the checkpoint's weights as the engine does; the others
            # run those FP8 weights dequantized
            lat[arm], resets_of = session_latents(cfg, full if cfg.numerics.fp8_gemm else full_dq,
                                                  device, inputs)
            if arm == REFERENCE:
                resets = resets_of
            walls[arm] = time.perf_counter() - t
            print(f"{arm:>16}: {walls[arm]:.1f} s", flush=True)
    if not resets:
        raise SystemExit(f"{args.chunks} chunks cross no position reset")

    ref = lat[REFERENCE]
    result = {"preset": args.preset, "gpu": args.gpu_tag, "device": str(device),
              "chunks": args.chunks, "exclude": args.exclude, "reset_chunks": resets,
              "reference": REFERENCE, "order": [REFERENCE, *arms],
              "machine": this_machine(), "date": time.strftime("%Y-%m-%d"),
              "weights_s": weights_s, "wall_s": sum(walls.values()), "arms": {}}
    for arm in result["order"]:
        err = ((lat[arm] - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)).tolist()
        kept = err[args.exclude:]
        cfg = arm_cfg(base, arm)
        result["arms"][arm] = {
            "rel_l2_median": statistics.median(kept), "rel_l2_max": max(kept),
            "rel_l2_reset_max": max(err[c] for c in resets if c >= args.exclude)
            if any(c >= args.exclude for c in resets) else None,
            "rel_l2_per_chunk": err, "wall_s": walls[arm],
            "switches_on": [n for n in LiveTalkSwitches.ORDER if getattr(cfg.switches, n)],
            "numerics": dataclasses.asdict(cfg.numerics)}
        print(f"{arm:>16} rel L2 vs {REFERENCE}: median {statistics.median(kept):.3e}, "
              f"max {max(kept):.3e} (chunks {args.exclude}-{args.chunks - 1})")
    a = result["arms"]
    if PRODUCTION in a and "bf16_plain" in a:
        print(f"production {a[PRODUCTION]['rel_l2_median']:.3e} beside the bf16 plain path's "
              f"{a['bf16_plain']['rel_l2_median']:.3e} (medians vs fp32)")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"numerics_{args.preset}_{args.gpu_tag}_vs-fp32.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
