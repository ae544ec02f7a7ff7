"""Start-up, any family's engine, the way charrun starts it: process start to ready (its parts,
the kernels compiled at start, peak GPU memory), then sessions (first frame, and the next
session's), and one more session stepped by hand and synchronized per step (what each step
costs from the cache-filling steps into the steady state). Every run is a fresh Python
process.

Variants (--variants): `engine`, charrun's path (the engine's compiled kernels loaded,
nothing compiled); `jit`, the same engine with its kernels ignored (every kernel compiled at
start, as a worker that compiles just in time does); an engine with no compiled kernels (a
CPU engine) runs `engine` alone. A TP target is measured on one of its rank slices (--ranks,
built with charbuild --ranks, its all-reduce left out).

Page cache (--cache): `cold` (the default) writes back and evicts every file of the engine
before each run (posix_fadvise DONTNEED, no privileges needed), so the engine comes from the
disk while Python and its libraries stay as the system has them, and a probe first reads the
evicted engine once for the disk's own rate; `warm` leaves the cache as it is. As charrun
does, the child asks for the engine's files to be read ahead in the background before it
imports torch (runtime/prefetch.py; --no-readahead: without).

    python scripts/bench_startup.py --target h200-livetalk --runs 5            # one H200
    python scripts/bench_startup.py --target h100-tp3 --ranks 0 --runs 3 --variants engine
    python scripts/bench_startup.py --target cpu-tiny --runs 3                   # CPU
    python scripts/bench_startup.py --target cpu-tiny-livetalk --runs 2 --cache warm

Writes one JSON (default docs/results/startup/startup_<preset>_<layout>_<gpu>_<n>.json, the
next free n) with every run and, per variant, the medians of ready and first frame.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from charengine.provenance import provenance

VARIANTS = ("engine", "jit")
READ_BYTES = 1 << 24  # the disk probe's read size
MB = 1 << 20
SPEECH_S = 2  # seconds of speech per session
DEFAULT_OUT = Path("docs/results/startup")


def engine_paths(engine: Path) -> list[Path]:
    return sorted(p for p in engine.rglob("*") if p.is_file())


def evict(engine: Path) -> int:
    """Write back and drop every file of the engine from the page cache; returns the bytes."""
    total = 0
    for p in engine_paths(engine):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped: a fresh build's are written first
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def disk_probe(engine: Path) -> dict:
    """The evicted engine read once, file by file (the disk's sequential rate), then evicted
    again."""
    n = evict(engine)
    buf = bytearray(READ_BYTES)
    t0 = time.perf_counter()
    for p in engine_paths(engine):
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    s = time.perf_counter() - t0
    evict(engine)
    return {"bytes": n, "seconds": round(s, 3), "gb_per_s": round(n / s / 1e9, 3)}


def gpu_memory(torch, device) -> dict:
    """Peak memory the process's allocator held, and the device's memory in use (CUDA's
    context included); {} off a GPU."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"max_allocated_mb": torch.cuda.max_memory_allocated(device) / MB,
            "max_reserved_mb": torch.cuda.max_memory_reserved(device) / MB,
            "device_used_mb": (total - free) / MB}


def child(args) -> None:
    """charrun's path to ready, then the sessions; prints READY and DONE lines of JSON."""
    imports_at = time.time()
    if args.readahead:  # as charrun does before it imports torch
        from charengine.runtime.prefetch import readahead_in_background

        readahead_in_background(args.engine)
    import torch

    from charengine.runtime.distributed import open_worker
    from charengine.runtime.engine import Engine
    from charengine.runtime.worker import Worker
    from charengine.timing import Span

    imported = time.time()
    t0 = time.perf_counter()
    engine = Engine.load(args.engine, ranks=[args.rank] if args.rank is not None else None,
                         verify_in_background=True)
    checked = time.perf_counter() - t0  # the manifest and machine; checksums run with the load
    if args.rank is not None or args.child == "jit":
        worker = Worker(engine, rank_slice=args.rank, engine_kernels=args.child == "engine")
    else:
        worker = open_worker(engine)
    ready_in_process = time.perf_counter() - t0
    kernels = getattr(worker, "kernels", None)
    # a worker whose ranks run in processes of their own compiles and holds its DiT there:
    # its device here is its side networks', and it compiles nothing of its own
    device = worker.device
    compiles = getattr(worker, "compiles", 0)
    print("READY " + json.dumps({
        "imports_at": imports_at, "import_s": imported - imports_at, "check_s": checked,
        "ready_in_process_s": ready_in_process, **worker.startup,
        "compiles": compiles,
        "compiled": sorted(set(kernels.compiled)) if kernels is not None else [],
        "memory_at_ready": gpu_memory(torch, device)}), flush=True)

    spec, fam = engine.config.model, worker.family
    g = torch.Generator().manual_seed(0)
    sessions = []
    for s in range(args.sessions):
        image = torch.rand(3, spec.out_h, spec.out_w, generator=g)
        speech = 0.1 * torch.randn(spec.side.sample_rate * SPEECH_S, generator=g)
        steps = min(args.steps, fam.steps_for(spec, speech.numel()))
        first = []

        def sink(i, frames):
            if not first:
                first.append(time.perf_counter())

        t0 = time.perf_counter()
        worker.start(image, f"session {s}")
        worker.run(speech, steps, sink, seed=s)
        sessions.append({"first_frame_s": first[0] - t0, "steps": steps,
                         "session_s": time.perf_counter() - t0})
    # one more session, stepped by hand and synchronized per step (a worker whose ranks run
    # in processes of their own has no session here)
    step_ms = []
    session = getattr(worker, "session", None)
    if session is not None and args.steps:
        dev, shapes = device, fam.step_shapes(spec)
        with torch.inference_mode():
            session.start(torch.randn(shapes.reference, device=dev),
                          torch.randn(shapes.prompt, device=dev))
            for _ in range(args.steps):
                noise = torch.randn(shapes.noise_shape, device=dev)
                feats = torch.randn(shapes.features, device=dev)
                with Span(dev, wall=True) as span:
                    session.step(noise, feats)
                step_ms.append(span.ms)
    print("DONE " + json.dumps({"sessions": sessions, "step_ms": step_ms,
                                "compiles": getattr(worker, "compiles", 0),
                                "memory_after_sessions": gpu_memory(torch, device)}),
          flush=True)
    worker.close()


def run_child(args, variant: str) -> dict:
    evicted = evict(args.engine) if args.cache == "cold" else 0
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", variant, "--engine",
           str(args.engine), "--steps", str(args.steps), "--sessions", str(args.sessions)] \
        + (["--rank", str(args.rank)] if args.rank is not None else []) \
        + ([] if args.readahead else ["--no-readahead"])
    t_start, t0 = time.time(), time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    out = {"variant": variant, "evicted_bytes": evicted}
    for line in p.stdout:
        if line.startswith("READY "):
            out["ready_s"] = time.perf_counter() - t0
            ready = json.loads(line[6:])
            ready["python_start_s"] = ready.pop("imports_at") - t_start
            out["ready"] = ready
        elif line.startswith("DONE "):
            done = json.loads(line[5:])
            out.update(sessions=done["sessions"], step_ms=done["step_ms"],
                       compiles_after_sessions=done["compiles"],
                       memory_after_sessions=done["memory_after_sessions"],
                       first_frame_s=done["sessions"][0]["first_frame_s"]
                       if done["sessions"] else None)
    if p.wait() != 0 or "sessions" not in out:
        raise SystemExit(f"{variant}: the worker failed (exit {p.returncode})")
    return out


def next_result(out: Path, stem: str) -> Path:
    if out.suffix == ".json":
        return out
    n = 1
    while (out / f"{stem}_{n}.json").exists():
        n += 1
    return out / f"{stem}_{n}.json"


def line(r: dict) -> str:
    rd, parts = r["ready"], r["ready"].get("parts", {})
    split = "".join(f", {k.removesuffix('_s')} {v:.2f}" for k, v in parts.items())
    sessions = r["sessions"]
    return (f"ready {r['ready_s']:.2f} s (python {rd['python_start_s']:.2f}, imports "
            f"{rd['import_s']:.2f}, check {rd['check_s']:.2f}, load {rd['load_s']:.2f}, warm-up "
            f"{rd['warm_up_s']:.2f}{split}); {rd['compiles']} compiled"
            + (f"; first frame {sessions[0]['first_frame_s']:.3f} s, next session "
               f"{sessions[-1]['first_frame_s']:.3f} s" if sessions else "")
            + ("; steps (ms) " + " ".join(f"{t:.0f}" for t in r["step_ms"])
               if r["step_ms"] else ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="cpu-tiny")
    ap.add_argument("--preset", default=None, help="model preset, overriding the target's")
    ap.add_argument("--ranks", type=int, default=None, help="measure this TP rank's slice")
    ap.add_argument("--engine", type=Path, default=None,
                    help="an engine already built (default: build one under --work)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/charengine-startup"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=10, help="steps per session (0: none)")
    ap.add_argument("--sessions", type=int, default=2)
    ap.add_argument("--cache", choices=("cold", "warm"), default="cold",
                    help="the engine's files evicted from the page cache before each run, "
                         "or left as they are")
    ap.add_argument("--no-readahead", dest="readahead", action="store_false",
                    help="start without charrun's background read of the engine's files "
                         "(runtime/prefetch.py)")
    ap.add_argument("--gpu-tag", default="h200")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="a .json file, or a directory for startup_<...>_<n>.json")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    build_s = None
    if args.engine is None:
        args.engine = args.work / "engine"
        cmd = [sys.executable, "-m", "charengine.builder.cli", "--target", args.target,
               "--random-weights", "--out", str(args.engine)]
        cmd += ["--preset", args.preset] if args.preset else []
        cmd += ["--ranks", str(args.ranks)] if args.ranks is not None else []
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        build_s = time.perf_counter() - t0
    manifest = json.loads((args.engine / "manifest.json").read_text())
    tp, preset = manifest["tp"], manifest["config"]["model"]["name"]
    args.rank = args.ranks if tp > 1 else None
    layout = f"tp{tp}-rank{args.rank}" if args.rank is not None else f"tp{tp}"
    gpu = args.gpu_tag if manifest["target"]["device"] == "cuda" else "cpu"
    variants = args.variants.split(",")
    if not manifest["kernels"]["compiled"]:
        variants = ["engine"]  # nothing compiled into it: the JIT variant is the same run
    probe = disk_probe(args.engine) if args.cache == "cold" else None
    if probe:
        print(f"disk: {probe['bytes'] / 1e9:.2f} GB of engine read cold in "
              f"{probe['seconds']:.2f} s ({probe['gb_per_s']:.2f} GB/s)", flush=True)
    order = [(v, r) for r in range(1, args.runs + 1) for v in variants]
    random.shuffle(order)  # variants interleaved
    runs = {v: [] for v in variants}
    for v, r in order:
        res = run_child(args, v)
        runs[v].append(res)
        print(f"{v} run {r}: {line(res)}", flush=True)
    summary = {}
    for v, rs in runs.items():
        firsts = [x["first_frame_s"] for x in rs if x["first_frame_s"] is not None]
        summary[v] = {
            "ready_s": statistics.median(x["ready_s"] for x in rs),
            "ready_s_runs": [x["ready_s"] for x in rs],
            "first_frame_s": statistics.median(firsts) if firsts else None,
            "compiles": max(x["ready"]["compiles"] for x in rs),
            "peak_allocated_mb": max(x["memory_after_sessions"].get("max_allocated_mb", 0.0)
                                     for x in rs),
            "peak_device_used_mb": max(x["memory_after_sessions"].get("device_used_mb", 0.0)
                                       for x in rs),
            "runs": len(rs)}
    result = {"preset": preset, "target": manifest["target"]["name"], "layout": layout,
              "gpu": gpu, **provenance(), "build_s": build_s,
              "built_with": manifest["built_with"], "cache": args.cache,
              "readahead": args.readahead, "disk_probe": probe, "variants": summary,
              "runs": runs}
    path = next_result(args.out, f"startup_{preset}_{layout}_{gpu}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    for v, s in summary.items():
        print(f"{preset} {v}: ready {s['ready_s']:.2f} s (median of {s['runs']}, page cache "
              f"{args.cache}), {s['compiles']} kernels compiled at start"
              + (f", first frame {s['first_frame_s']:.3f} s" if s["first_frame_s"] is not None
                 else "")
              + f", peak GPU memory {s['peak_allocated_mb']:.0f} MB allocated -> {path}")


if __name__ == "__main__":
    main()
