"""LiveTalk's GPU memory, where it lies: a Worker made as charrun makes it (Engine.load, then
the Worker's load, warm-up and graph capture), then at ready the memory allocated and its
peak so far, what the DiT session's tensors, its K/V stores (the cache in the model's dtype
and the FP8 cache, apart or shared) and the side networks' tensors hold, and the peak a
decoder call adds on top (a session's first piece, two latents, and a steady piece, one
latent; each the largest of --reps calls).

    python scripts/livetalk_memory.py --engine /path/to/h200-livetalk \\
        --out docs/results/livetalk/memory_livetalk-1.3b_h200.json

Needs a GPU (the allocator's statistics are CUDA's)."""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path

import torch

from charengine.runtime.engine import Engine
from charengine.runtime.worker import Worker
from charengine.provenance import provenance

MB = 1 << 20


def cuda_tensors(objs, seen=None):
    """The CUDA tensors reachable from objs: through dicts, lists, tuples and objects'
    attributes (each object visited once)."""
    seen = set() if seen is None else seen
    for o in objs:
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            if o.is_cuda:
                yield o
        elif isinstance(o, dict):
            yield from cuda_tensors(o.values(), seen)
        elif isinstance(o, (list, tuple, set)):
            yield from cuda_tensors(o, seen)
        elif hasattr(o, "__dict__") and not isinstance(o, type) and not inspect.isroutine(o):
            yield from cuda_tensors(vars(o).values(), seen)


def tensors_mb(objs) -> float:
    """The bytes of the distinct storages the CUDA tensors among objs hold."""
    seen, total = set(), 0
    for t in cuda_tensors(objs):
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total / MB


def piece_peak_mb(worker: Worker, first: bool, reps: int) -> float:
    """The most a decoder call of a session's first piece (first) or of a steady piece adds
    above the memory allocated before it."""
    spec, dec = worker.spec, worker.side.decoder
    z = torch.zeros(spec.latent_channels, spec.chunk_frames, spec.latent_h, spec.latent_w,
                    device=worker.decoder_device)
    pieces = dec.per_latent(z)
    most = 0.0
    with torch.inference_mode():
        for _ in range(reps):
            dec.reset()
            if not first:
                dec(pieces[0])  # a steady piece runs with the decoder's state mid-session
            torch.cuda.synchronize(worker.decoder_device)
            base = torch.cuda.memory_allocated(worker.decoder_device)
            torch.cuda.reset_peak_memory_stats(worker.decoder_device)
            dec(pieces[0] if first else pieces[1])
            torch.cuda.synchronize(worker.decoder_device)
            most = max(most, (torch.cuda.max_memory_allocated(worker.decoder_device) - base) / MB)
        dec.reset()
    return most


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, required=True, help="a LiveTalk engine charbuild wrote")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, help="a .json file (default: print only)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("livetalk_memory: needs a GPU (the figures are CUDA's allocator's)", file=sys.stderr)
        return 2
    engine = Engine.load(args.engine)
    worker = Worker(engine)
    dev = worker.device
    torch.cuda.synchronize(dev)
    session, cache = worker.session, worker.session.cache
    # the cache in the model's dtype (the calibration chunks') and the FP8 cache; with
    # shared_kv_stores the second lies in the first's buffers
    kv = {"model_dtype": tensors_mb([cache.k, cache.v]),
          "fp8": tensors_mb([getattr(cache, "k8", None), getattr(cache, "v8", None)]),
          "stores": tensors_mb([cache.k, cache.v, getattr(cache, "k8", None),
                                getattr(cache, "v8", None)]),
          "shared": getattr(cache, "shared", False), "wide_slots": cache.wide_slots,
          "slots": cache.slots}
    dit = tensors_mb([session.model, cache])
    out = {
        "preset": engine.config.model.name,
        "target": engine.target.name,
        "gpu": torch.cuda.get_device_name(dev),
        **provenance(),
        "allocated_mb_at_ready": torch.cuda.memory_allocated(dev) / MB,
        "peak_allocated_mb_at_ready": torch.cuda.max_memory_allocated(dev) / MB,
        "reserved_mb_at_ready": torch.cuda.memory_reserved(dev) / MB,
        "startup_peaks_mb": {k: v for k, v in worker.startup["parts"].items() if "peak" in k},
        "dit_session_tensors_mb": dit,
        "kv_cache_mb": kv,
        "side_tensors_mb": tensors_mb([*worker.side.parameters(), *worker.side.buffers()]),
        "decoder_first_piece_peak_mb": piece_peak_mb(worker, True, args.reps),
        "decoder_piece_peak_mb": piece_peak_mb(worker, False, args.reps),
    }
    worker.close()
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
