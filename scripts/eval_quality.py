"""Quality of the tiny character on held-out clips (docs/QUALITY.md): identities and speech
made from a seed the training never used, animated from each clip's first frame and its
speech by the engine's step (tinychar.offline), on the CPU.

    python scripts/eval_quality.py --clips 20 --seconds 8

Lip sync (tinychar.quality.lip_sync) for the trained model, a random-weight model and the
ground-truth clips; PSNR / SSIM between arms of the trained model (baseline, production,
bf16 cache, fp32) against the run-to-run floor (production with another noise seed), each
with 95% bootstrap intervals over clips. Writes docs/results/quality_tiny_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from charengine.config import Numerics, preset
from charengine.characters.config import Switches
from tinychar.offline import animate, random_model_side
from tinychar.quality import bootstrap, compare_runs, lip_sync
from charengine.assemble import rank_session, rank_state
from charengine.mapping import Mapping
from charengine.characters.sidenets import PREFIXES, load_side
from tinychar.synth import clip
from charengine.characters.weights import load_checkpoint, random_weights
from charengine.provenance import provenance

HELD_OUT_SEED = 10**6 + 7  # train_tiny.py draws its clips from seed 0 (and vae 10**6 held-out)
FP32 = Numerics(dtype="float32", fp8_gemm=False, fp8_attention=False)
ARMS = {
    "production": dict(),
    "baseline": dict(switches=Switches.baseline()),
    "bf16_cache": dict(switches=Switches(fp8_kv=False), numerics=Numerics(fp8_attention=False)),
    "fp32": dict(switches=Switches(fp8_kv=False), numerics=FP32),
}


def interval(values):
    """Bootstrap interval over the clips that have a value (None: every frame identical)."""
    values = [x for x in values if x is not None]
    return bootstrap(values) if values else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path,
                    default=Path("charengine/checkpoints/tiny.safetensors"))
    ap.add_argument("--clips", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--out", type=Path, default=Path("docs/results/quality_tiny_cpu.json"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    t0 = time.time()
    spec = preset("tiny").model
    state, side_state = load_checkpoint(args.checkpoint, spec, PREFIXES)
    side = load_side(spec, side_state)
    rand_side = random_model_side(spec, side_state)
    cfgs = {arm: preset("tiny", **kw) for arm, kw in ARMS.items()}
    sessions = {arm: rank_session(cfg, rank_state(cfg, state), Mapping.single()) for arm, cfg in cfgs.items()}
    random_session = rank_session(preset("tiny"), rank_state(preset("tiny"), random_weights(spec, 0)),
                                  Mapping.single())
    rng = np.random.default_rng(HELD_OUT_SEED)
    sync = {k: [] for k in ("ground_truth", "random_weights", *ARMS)}
    pairs = {k: [] for k in ("floor_production_seed0_vs_seed1", "production_vs_baseline",
                             "production_vs_bf16_cache", "production_vs_fp32", "bf16_cache_vs_fp32")}
    for i in range(args.clips):
        c = clip(args.seconds, spec.out_h, rng)
        image = torch.from_numpy(c.frames[0]).permute(2, 0, 1).float() / 255
        speech = torch.from_numpy(c.audio)
        out = {arm: animate(s, side, image, speech, seed=i) for arm, s in sessions.items()}
        again = animate(sessions["production"], side, image, speech, seed=i + 10**4)
        rnd = animate(random_session, rand_side, image, speech, seed=i)
        n = len(c.frames)
        for name, frames in (("ground_truth", c.frames), ("random_weights", rnd), *out.items()):
            sync[name].append(lip_sync(frames[:n], c.audio, c.sample_rate, c.fps).__dict__)
        for key, (a, b) in (("floor_production_seed0_vs_seed1", (out["production"], again)),
                            ("production_vs_baseline", (out["production"], out["baseline"])),
                            ("production_vs_bf16_cache", (out["production"], out["bf16_cache"])),
                            ("production_vs_fp32", (out["production"], out["fp32"])),
                            ("bf16_cache_vs_fp32", (out["bf16_cache"], out["fp32"]))):
            pairs[key].append(compare_runs(a[:n], b[:n], c.fps))
        print(f"clip {i}: confidence trained {sync['production'][-1]['confidence']:.3f}, "
              f"random {sync['random_weights'][-1]['confidence']:.3f}, "
              f"truth {sync['ground_truth'][-1]['confidence']:.3f} ({time.time() - t0:.0f} s)",
              flush=True)
    result = {
        "checkpoint": str(args.checkpoint), "clips": args.clips, "seconds": args.seconds,
        "held_out_seed": HELD_OUT_SEED, **provenance(),
        "lip_sync": {k: {"confidence": bootstrap([r["confidence"] for r in v]),
                         "near": bootstrap([r["near"] for r in v]),
                         "distance": bootstrap([r["distance"] for r in v]),
                         "offset_median": float(np.median([r["offset"] for r in v])),
                         "offsets": [r["offset"] for r in v]} for k, v in sync.items()},
        "pairs": {k: {"psnr": interval([p["overall"]["psnr"] for p in v]),
                      "ssim": interval([p["overall"]["ssim"] for p in v]),
                      "identical_frames": int(sum(p["overall"]["identical"] for p in v)),
                      "frames": int(sum(p["overall"]["frames"] for p in v))}
                  for k, v in pairs.items()},
        "wall_s": time.time() - t0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items()}, indent=1)[:4000])


if __name__ == "__main__":
    main()
