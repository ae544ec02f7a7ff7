"""A long LiveTalk session, unpaced, as charrun's rank runs it (the engine's config and
kernels where --engine is given, else a preset with random weights): per chunk its GPU (or
CPU) time, the memory in use and the positions the chunk's frames sit at. The position
reset keeps positions bounded, so step time and memory stay flat however long the session.

    python scripts/livetalk_long_session.py --preset tiny-livetalk --minutes 30 \\
        --out docs/results/livetalk_long_session_tiny-livetalk.json
    python scripts/livetalk_long_session.py --engine /path/to/h200-livetalk --minutes 5 \\
        --out docs/results/livetalk_long_session_livetalk-1.3b.json
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch

from charengine.assemble import rank_session
from charengine.config import preset
from charengine.family import family
from charengine.livetalk.spec import ARMS, arm_config
from charengine.mapping import Mapping
from charengine.timing import Span, median


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def load(args):
    if args.engine is not None:
        from charengine.runtime.engine import Engine
        from charengine.runtime.worker import Worker

        worker = Worker(Engine.load(args.engine))
        return worker.session, worker.spec, worker.device
    cfg = preset(args.preset)
    fam = family(cfg.family)
    cfg = arm_config(cfg, args.arm)
    device = torch.device(args.device)
    full = fam.random_weights(cfg.model, args.seed)
    state = fam.rank_state(cfg, full)
    session = rank_session(cfg, state, Mapping.single(args.device),
                           tables=fam.bake_tables(cfg, full))
    if device.type == "cuda":
        fam.warm_up(session)
    return session, cfg.model, device


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path)
    ap.add_argument("--preset", default="tiny-livetalk")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--minutes", type=float, default=30.0, help="of video at the model's fps")
    ap.add_argument("--arm", choices=ARMS, default="preset",
                    help="without --engine: the preset's switches and numerics, the plain "
                         "path in bf16, or every switch with bf16 GEMMs and cache")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    session, spec, device = load(args)
    fam = family(spec.FAMILY)
    chunks = int(args.minutes * 60 * spec.fps) // spec.frames_per_latent
    shapes = fam.step_shapes(spec)
    g = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    ms, mem, pos = [], [], set()
    with torch.inference_mode():
        session.start(torch.randn(shapes.reference, generator=g).to(device),
                      torch.randn(shapes.prompt, generator=g).to(device))
        for _ in range(chunks):
            noise = torch.randn(shapes.noise_shape, generator=g).to(device)
            feats = torch.randn(shapes.features, generator=g).to(device)
            with Span(device) as s:
                out = session.step(noise, feats)
            ms.append(s.ms)
            mem.append(torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda"
                       else rss_mb())
            pos.update(session.cache.positions.tolist())
            if not torch.isfinite(out).all():
                raise SystemExit(f"chunk {len(ms) - 1}: non-finite latent")
    tenth = max(chunks // 10, 1)
    summary = {
        "preset": spec.name, "device": str(device), "engine": str(args.engine or ""),
        "arm": "engine" if args.engine else args.arm,
        "chunks": chunks, "latent_frames": chunks * spec.chunk_frames,
        "video_minutes": chunks * spec.frames_per_latent / spec.fps / 60,
        "resets": sum(session.cache.is_reset(c) for c in range(chunks)),
        "positions": [min(pos), max(pos)],
        "step_ms_first_tenth_p50": median(ms[5:tenth + 5]),
        "step_ms_last_tenth_p50": median(ms[-tenth:]),
        "memory_mb_first_tenth_max": max(mem[5:tenth + 5]),
        "memory_mb_last_tenth_max": max(mem[-tenth:]),
        "wall_s": time.perf_counter() - t0,
        "date": time.strftime("%Y-%m-%d"),
        "step_ms": ms, "memory_mb": mem,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("step_ms", "memory_mb")},
                     indent=1))


if __name__ == "__main__":
    main()
