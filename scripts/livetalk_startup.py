"""LiveTalk start-up benchmark: process start to ready from a cold page cache, what each part
of the load took, kernels compiled at start, peak GPU memory, and a first session's first
frames, for a LiveTalk engine run the way `charrun` runs it (Engine.load with background
checksums, then open_worker: weights, side networks, warm-up session, graph capture).

Before each run every file of the engine directory is written back (fsync) and evicted from
the page cache with posix_fadvise(POSIX_FADV_DONTNEED), which needs no privileges: the
engine comes from the disk, while Python, torch and the other installed libraries stay as
the system has them. Every run is a fresh Python process. A probe first reads the evicted
engine once (sequential 16 MiB reads) to give the disk's own rate beside the start-up. As
charrun does, the child asks for the engine's files to be read into the page cache in the
background before it imports torch (runtime/prefetch.py; --no-readahead: without).

    python scripts/livetalk_startup.py --target h200-livetalk --runs 5      # one H200: builds
    python scripts/livetalk_startup.py --engine DIR --runs 3                # an engine built
    python scripts/livetalk_startup.py --target cpu-tiny-livetalk --runs 2  # CPU, tiny

Writes one JSON (default docs/results/livetalk/startup_<preset>_<gpu>_<n>.json, the next free
n) with every run and `ready_s`, the median of the runs' process-start-to-ready seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

READ_BYTES = 1 << 24  # the disk probe's read size
MB = 1 << 20
SPEECH_S = 3  # seconds of speech for the first session
DEFAULT_OUT = Path("docs/results/livetalk")


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
    """charrun's path to ready (as `charrun --check`), then one session; prints READY and
    DONE lines of JSON."""
    imports_at = time.time()
    if args.readahead:  # as charrun does before it imports torch
        from charengine.runtime.prefetch import readahead_in_background

        readahead_in_background(args.engine)
    import torch

    from charengine.runtime.distributed import open_worker
    from charengine.runtime.engine import Engine

    imported = time.time()
    t0 = time.perf_counter()
    engine = Engine.load(args.engine, verify_in_background=True)
    checked = time.perf_counter() - t0
    worker = open_worker(engine)
    ready_in_process = time.perf_counter() - t0
    kernels = getattr(worker, "kernels", None)
    print("READY " + json.dumps({
        "imports_at": imports_at, "import_s": imported - imports_at, "check_s": checked,
        "ready_in_process_s": ready_in_process, **worker.startup,
        "compiles": worker.compiles,
        "compiled": sorted(set(kernels.compiled)) if kernels is not None else [],
        "memory_at_ready": gpu_memory(torch, worker.device)}), flush=True)

    if args.steps == 0:  # the start alone
        print("DONE " + json.dumps({"first_frame_s": None, "steps": 0, "session_s": None,
                                    "compiles": worker.compiles,
                                    "memory_after_session": gpu_memory(torch, worker.device)}),
              flush=True)
        worker.close()
        return
    spec, fam = engine.config.model, worker.family
    g = torch.Generator().manual_seed(0)
    image = torch.rand(3, spec.out_h, spec.out_w, generator=g)
    speech = 0.1 * torch.randn(spec.side.sample_rate * SPEECH_S, generator=g)
    steps = min(args.steps, fam.steps_for(spec, speech.numel()))
    first = []

    def sink(i, frames):
        if not first:
            first.append(time.perf_counter())

    t0 = time.perf_counter()
    worker.start(image, "a person talking")
    worker.run(speech, steps, sink)
    session_s = time.perf_counter() - t0
    print("DONE " + json.dumps({"first_frame_s": first[0] - t0, "steps": steps,
                                "session_s": session_s, "compiles": worker.compiles,
                                "memory_after_session": gpu_memory(torch, worker.device)}),
          flush=True)
    worker.close()


def run_child(args) -> dict:
    evicted = evict(args.engine)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--engine",
           str(args.engine), "--steps", str(args.steps)] \
        + ([] if args.readahead else ["--no-readahead"])
    t_start, t0 = time.time(), time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    out = {"evicted_bytes": evicted}
    for line in p.stdout:
        if line.startswith("READY "):
            out["ready_s"] = time.perf_counter() - t0
            ready = json.loads(line[6:])
            ready["python_start_s"] = ready.pop("imports_at") - t_start
            out["ready"] = ready
        elif line.startswith("DONE "):
            out["session"] = json.loads(line[5:])
    if p.wait() != 0 or "session" not in out:
        raise SystemExit(f"the worker failed (exit {p.returncode})")
    return out


def next_result(out: Path, preset: str, gpu: str) -> Path:
    if out.suffix == ".json":
        return out
    n = 1
    while (out / f"startup_{preset}_{gpu}_{n}.json").exists():
        n += 1
    return out / f"startup_{preset}_{gpu}_{n}.json"


def line(r: dict) -> str:
    rd, parts = r["ready"], r["ready"].get("parts", {})
    first = r["session"]["first_frame_s"]
    split = ", ".join(f"{k.removesuffix('_s')} {v:.2f}" for k, v in parts.items())
    return (f"ready {r['ready_s']:.2f} s (python {rd['python_start_s']:.2f}, imports "
            f"{rd['import_s']:.2f}, check {rd['check_s']:.2f}, load {rd['load_s']:.2f}, warm-up "
            f"{rd['warm_up_s']:.2f}; {split}); {rd['compiles']} compiled"
            + (f"; first frame {first:.3f} s" if first is not None else ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="h200-livetalk")
    ap.add_argument("--engine", type=Path, default=None,
                    help="an engine already built (default: build one under --work)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/charengine-livetalk-startup"))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2,
                    help="steps of the first session (0: none, the start alone)")
    ap.add_argument("--gpu-tag", default="h200")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="a .json file, or a directory for startup_<preset>_<gpu>_<n>.json")
    ap.add_argument("--no-readahead", dest="readahead", action="store_false",
                    help="start without charrun's background read of the engine's files "
                         "(runtime/prefetch.py)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    build_s = None
    if args.engine is None:
        args.engine = args.work / "engine"
        cmd = [sys.executable, "-m", "charengine.builder.cli", "--target", args.target,
               "--random-weights", "--out", str(args.engine)]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        build_s = time.perf_counter() - t0
    manifest = json.loads((args.engine / "manifest.json").read_text())
    preset = manifest["config"]["model"]["name"]
    gpu = args.gpu_tag if manifest["target"]["device"] == "cuda" else "cpu"
    probe = disk_probe(args.engine)
    print(f"disk: {probe['bytes'] / 1e9:.2f} GB of engine read cold in {probe['seconds']:.2f} s "
          f"({probe['gb_per_s']:.2f} GB/s)", flush=True)
    runs = []
    for r in range(args.runs):
        res = run_child(args)
        runs.append(res)
        print(f"run {r + 1}: {line(res)}", flush=True)
    ready = [r["ready_s"] for r in runs]
    firsts = [r["session"]["first_frame_s"] for r in runs if r["session"]["steps"]]
    result = {
        "preset": preset, "target": manifest["target"]["name"], "gpu": gpu,
        "date": time.strftime("%Y-%m-%d"), "engine_bytes": probe["bytes"],
        "build_s": build_s, "built_with": manifest["built_with"],
        "page_cache": "every engine file fsynced and evicted (posix_fadvise DONTNEED) before "
                      "each run",
        "readahead": args.readahead,
        "ready_s": statistics.median(ready), "ready_s_runs": ready,
        "ready_in_process_s": statistics.median(r["ready"]["ready_in_process_s"] for r in runs),
        "compiles": max(r["ready"]["compiles"] for r in runs),
        "first_frame_s": statistics.median(firsts) if firsts else None,
        "peak_allocated_mb": max((r["session"]["memory_after_session"].get(
            "max_allocated_mb", 0.0) for r in runs), default=0.0),
        "peak_device_used_mb": max((r["session"]["memory_after_session"].get(
            "device_used_mb", 0.0) for r in runs), default=0.0),
        "disk_probe": probe, "runs": runs}
    path = next_result(args.out, preset, gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{preset}: ready {result['ready_s']:.2f} s (median of {len(runs)} cold starts; "
          f"{min(ready):.2f}-{max(ready):.2f}), {result['compiles']} kernels compiled at start, "
          + (f"first frame {result['first_frame_s']:.3f} s, " if firsts else "")
          + f"peak GPU memory {result['peak_allocated_mb']:.0f} MB allocated -> {path}")


if __name__ == "__main__":
    main()
