"""A simulated hour on the tiny model, faster than real time: 21,600 AR steps (514 position
resets, 3,600 ring wraps). Four sessions step in lockstep on the same inputs:
  - the write-time path against the paper's plain path, both fp32 (should agree to ~1e-7);
  - production numerics (FP8 KV at write) against a bf16 cache (bounded, no growth).
It records the error per step, the process's resident memory, and writes a JSON summary.

    python scripts/long_session.py --steps 21600 --out docs/results/long_session_tiny.json
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch

from charengine.config import Numerics, preset
from charengine.characters.config import Switches
from charengine.assemble import rank_session, rank_state
from charengine.mapping import Mapping
from charengine.characters.weights import random_weights


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=21600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("docs/results/long_session_tiny.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    fp32 = Numerics(dtype="float32", fp8_gemm=False, fp8_attention=False)
    bf16 = Numerics(dtype="bfloat16", fp8_gemm=True, fp8_attention=False)
    arms = {
        "plain_fp32": preset("tiny", switches=Switches.baseline(), numerics=fp32),
        "write_time_fp32": preset("tiny", switches=Switches(fp8_kv=False), numerics=fp32),
        "bf16_cache": preset("tiny", switches=Switches(fp8_kv=False), numerics=bf16),
        "production": preset("tiny"),
    }
    full = random_weights(arms["production"].model, args.seed)
    sessions = {k: rank_session(c, rank_state(c, full), Mapping.single()) for k, c in arms.items()}
    spec = arms["production"].model
    g = torch.Generator().manual_seed(args.seed + 1)
    lat = (spec.latent_channels, spec.latent_h, spec.latent_w)
    ref, prompt = torch.randn(lat, generator=g), torch.randn(spec.prompt_tokens, spec.text_dim, generator=g)
    for s in sessions.values():
        s.start(ref, prompt)

    def rel(a, b):
        return float((a - b).norm() / a.norm())

    fp32_err, fp8_err, rss = [], [], []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for k in range(args.steps):
            noise = torch.randn(lat, generator=g)
            audio = torch.randn(spec.audio_tokens, spec.audio_dim, generator=g)
            out = {name: s.step(noise, audio) for name, s in sessions.items()}
            fp32_err.append(rel(out["plain_fp32"], out["write_time_fp32"]))
            fp8_err.append(rel(out["bf16_cache"], out["production"]))
            if k % 600 == 0:
                rss.append((k, rss_mb()))
                print(f"step {k}: fp32 {max(fp32_err[-600:]):.2e} fp8 {max(fp8_err[-600:]):.2e} "
                      f"rss {rss[-1][1]:.1f} MB ({time.perf_counter() - t0:.0f} s)", flush=True)
    rss.append((args.steps, rss_mb()))
    minute = 60 * 6
    resets = sum(1 for k in range(1, args.steps) if k % arms["production"].cache.reset_period == 0)
    summary = {
        "steps": args.steps, "simulated_minutes": args.steps / minute, "resets": resets,
        "wall_s": time.perf_counter() - t0,
        "fp32_write_time_vs_plain_max": max(fp32_err),
        "fp32_first_10min_max": max(fp32_err[: 10 * minute]),
        "fp32_last_10min_max": max(fp32_err[-10 * minute:]),
        "fp8_kv_vs_bf16_cache_max": max(fp8_err[6:]),
        "fp8_first_10min_max": max(fp8_err[6: 10 * minute]),
        "fp8_last_10min_max": max(fp8_err[-10 * minute:]),
        "rss_mb": rss, "rss_growth_after_first_10min_mb": rss[-1][1] - rss[min(10, len(rss) - 1)][1],
        "per_minute_max": {"fp32": [max(fp32_err[i: i + minute]) for i in range(0, args.steps, minute)],
                           "fp8": [max(fp8_err[max(i, 6): i + minute]) for i in range(0, args.steps, minute)]},
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, (list, dict))}, indent=1))


if __name__ == "__main__":
    main()
