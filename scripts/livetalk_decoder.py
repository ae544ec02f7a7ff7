"""LiveTalk's streaming decoder, arm by arm, as the runtime runs it: the side networks loaded
onto the GPU by load_side (bf16, cuDNN's default algorithm choice), a session's pieces decoded
one after the other (the first two latents together, then one latent: 4 frames). Each arm's
decoder (a fresh load of the same random weights) is timed on a steady piece, a session's
first piece and a whole 3-latent chunk (CUDA events, median), profiled (its kernels grouped by
name, ms per steady piece), and compared with the plain arm's frames.

  plain         the 3-D convs over [C, T, H, W] and the unfused norms (every switch off)
  fused         + each RMS norm and its SiLU as one kernel (vae_fused_norm)
  frames        the frames layout (vae_frames_layout: 2-D convs over stacked taps)
                with the unfused norms
  frames_fused  the frames layout with the fused norms writing the taps
  preset        + the resize and block-end kernels over pixel rows (vae_row_kernels)

(At a07bdc6 the frames layout always ran the row kernels: that JSON's frames arms are this
one's with them.)

    python scripts/livetalk_decoder.py --preset livetalk-1.3b \\
        --out docs/results/livetalk/decoder_livetalk-1.3b_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from charengine.livetalk.sidenets import load_side, random_side_state
from charengine.livetalk.spec import PRESETS, LiveTalkSwitches
from charengine.timing import cuda_ms, median
from charengine.provenance import provenance

# each arm's decoder switches on (LiveTalkSwitches.DECODER; the rest off)
ARMS = {"plain": (), "fused": ("vae_fused_norm",), "frames": ("vae_frames_layout",),
        "frames_fused": ("vae_frames_layout", "vae_fused_norm"),
        "preset": LiveTalkSwitches.DECODER}
TOP_KERNELS = 8


def kernel_ms(fn, calls: int) -> dict[str, float]:
    """ms per call of fn's GPU kernels, grouped by name (the first 70 characters)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    groups: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        if e.self_device_time_total > 0:
            groups[e.key[:70]] += e.self_device_time_total / calls / 1000
    top = sorted(groups.items(), key=lambda kv: -kv[1])
    return {"total": round(sum(groups.values()), 2),
            **{k: round(v, 2) for k, v in top[:TOP_KERNELS]}}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="livetalk-1.3b")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of " + ", ".join(ARMS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    spec, dev = PRESETS[args.preset], torch.device("cuda")
    state = random_side_state(spec, args.seed)
    g = torch.Generator().manual_seed(args.seed)
    lat = [torch.randn(spec.latent_channels, 1, spec.latent_h, spec.latent_w,
                       generator=g).to(dev) for _ in range(4)]
    first, chunk = torch.cat(lat[:2], 1), torch.cat(lat[1:], 1)
    results, ref = {}, None
    with torch.inference_mode():
        for name in args.arms.split(","):
            switches = dataclasses.replace(
                LiveTalkSwitches(), **{n: n in ARMS[name] for n in LiveTalkSwitches.DECODER})
            side = load_side(spec, state, dev, switches)
            dec = side.decoder
            dec.reset()
            dec(first)
            frames = dec(lat[2]).clone()
            ref = frames if ref is None else ref
            r = {"max_abs_diff_vs_first_arm": float((frames - ref).abs().max()),
                 "piece_ms": median(cuda_ms(lambda: dec(lat[2]), args.reps, 3, dev)),
                 "first_piece_ms": median(cuda_ms(lambda: (dec.reset(), dec(first)),
                                                  args.reps // 2, 2, dev)),
                 "chunk_ms": median(cuda_ms(lambda: dec(chunk), args.reps // 2, 2, dev)),
                 "piece_kernels_ms": kernel_ms(lambda: dec(lat[2]), 3)}
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            dec(lat[2])
            torch.cuda.synchronize()
            r["piece_peak_mb"] = (torch.cuda.max_memory_allocated(dev) - base) / (1 << 20)
            results[name] = r
            print(name, json.dumps(r), flush=True)
            side = dec = None  # freed before the next arm loads
            torch.cuda.empty_cache()
    doc = {"preset": spec.name, "gpu": torch.cuda.get_device_name(dev),
           **provenance(), "arms": results}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
