"""Start-up benchmark: process start to ready, and session start to first frame, each in a
fresh process, for two variants of one engine:

    engine   charrun's path: the engine's compiled kernels loaded, nothing compiled
    jit      the same engine with its kernels ignored: every kernel compiled at start, as a
             worker that compiles just in time does

Ready means: engine checked (checksums), weights on the GPU, side networks loaded, a
warm-up session run and the step graphs captured. First frame: a new reference image and
prompt (session start, caches reset) until the first decoded frames reach the sink.

    python scripts/bench_startup.py --target h100-tp3 --ranks 0 --runs 3   # one H200
    python scripts/bench_startup.py --target cpu-tiny --runs 3             # CPU, no kernels

A TP target is measured on one of its rank slices (--ranks, built with charbuild --ranks,
the all-reduce left out). Writes docs/results/startup_<preset>_<layout>_<gpu>_<variant>_<run>.json
and a summary; every run's child is a fresh Python process, variants in random order.
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

VARIANTS = ("engine", "jit")


def child(args) -> None:
    """One worker's start and two sessions; prints READY and DONE lines of JSON."""
    t_imp = time.time()
    import torch

    from charengine.characters import audio as audio_mod
    from charengine.runtime.engine import Engine
    from charengine.runtime.worker import Worker
    from charengine.timing import Span

    imported = time.time()
    t0 = time.perf_counter()
    engine = Engine.load(args.engine, ranks=[args.rank] if args.rank is not None else None,
                         verify_in_background=True)
    checked = time.perf_counter() - t0  # the manifest and machine; checksums run with the load
    worker = Worker(engine, rank_slice=args.rank, engine_kernels=args.child == "engine")
    ready = {"imported_at": imported, "import_s": imported - t_imp, "check_s": checked,
             **worker.startup, "compiles": worker.compiles,
             "compiled": sorted(set(worker.kernels.compiled)) if worker.kernels else []}
    print("READY " + json.dumps(ready), flush=True)
    spec = engine.config.model
    g = torch.Generator().manual_seed(0)
    sessions = []
    for s in range(args.sessions):
        image = torch.rand(3, spec.out_h, spec.out_w, generator=g)
        speech = 0.1 * torch.randn(spec.side.sample_rate * 2, generator=g)
        steps = min(args.steps, audio_mod.steps_for(spec, speech.numel()))
        first = []

        def sink(i, frames):
            if not first:
                first.append(time.perf_counter())

        t0 = time.perf_counter()
        worker.start(image, f"session {s}")
        worker.run(speech, steps, sink, seed=s)
        sessions.append({"first_frame_s": first[0] - t0, "steps": steps,
                         "session_s": time.perf_counter() - t0})
    # One more session, stepped by hand and synchronized per step: what each step costs
    # from the first (filling) steps through calibration into the steady state.
    dev = worker.device
    lat = (spec.latent_channels, spec.latent_h, spec.latent_w)
    step_ms = []
    with torch.inference_mode():
        worker.session.start(torch.randn(lat, device=dev),
                             torch.randn(spec.prompt_tokens, spec.text_dim, device=dev))
        for _ in range(args.steps):
            noise, feats = (torch.randn(lat, device=dev),
                            torch.randn(spec.audio_tokens, spec.audio_dim, device=dev))
            with Span(dev, wall=True) as span:
                worker.session.step(noise, feats)
            step_ms.append(span.ms)
    print("DONE " + json.dumps({"sessions": sessions, "step_ms": step_ms,
                                "compiles": worker.compiles}), flush=True)
    worker.close()


def drop_page_cache() -> bool:
    """Drop the OS page cache so weights come from disk (needs root); False if refused."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def run_child(args, variant: str) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--engine", str(args.engine),
           "--steps", str(args.steps), "--sessions", str(args.sessions)]
    if args.rank is not None:
        cmd += ["--rank", str(args.rank)]
    cold = drop_page_cache() if args.drop_caches else False
    t_start, t0 = time.time(), time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    out = {"variant": variant, "page_cache_dropped": cold}
    for line in p.stdout:
        if line.startswith("READY "):
            out["ready_s"] = time.perf_counter() - t0
            out["ready"] = json.loads(line[6:])
            out["ready"]["python_start_s"] = out["ready"].pop("imported_at") - t_start \
                - out["ready"]["import_s"]
        elif line.startswith("DONE "):
            done = json.loads(line[5:])
            out["sessions"] = done["sessions"]
            out["step_ms"] = done["step_ms"]
            out["first_frame_s"] = done["sessions"][0]["first_frame_s"]
            out["compiles_after_sessions"] = done["compiles"]
    if p.wait() != 0 or "first_frame_s" not in out:
        raise SystemExit(f"{variant}: the worker failed (exit {p.returncode})")
    return out


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
    ap.add_argument("--steps", type=int, default=10, help="steps per session")
    ap.add_argument("--sessions", type=int, default=2)
    ap.add_argument("--drop-caches", action="store_true",
                    help="drop the page cache before each start (root only; recorded)")
    ap.add_argument("--gpu-tag", default="h200")
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
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
    if tp > 1 and args.rank is None:
        raise SystemExit(f"{args.target} is TP-{tp}: measure one rank's slice with --ranks R")
    layout = f"tp{tp}-rank{args.rank}" if tp > 1 else "tp1"
    gpu = args.gpu_tag if manifest["target"]["device"] == "cuda" else "cpu"
    variants = [v for v in args.variants.split(",")]
    if not manifest["kernels"]["compiled"]:
        variants = ["engine"]  # nothing compiled into it: the JIT variant is the same run
    order = [(v, r) for r in range(1, args.runs + 1) for v in variants]
    random.shuffle(order)
    results = {v: [] for v in variants}
    args.out.mkdir(parents=True, exist_ok=True)
    for v, r in order:
        res = run_child(args, v)
        res.update(preset=preset, layout=layout, gpu=gpu, run=r, build_s=build_s,
                   target=manifest["target"]["name"], built_with=manifest["built_with"],
                   date=time.strftime("%Y-%m-%d"))
        (args.out / f"startup_{preset}_{layout}_{gpu}_{v}_{r}.json").write_text(
            json.dumps(res, indent=1) + "\n")
        results[v].append(res)
        print(f"{v} run {r}: ready {res['ready_s']:.2f} s (import {res['ready']['import_s']:.2f}, "
              f"check {res['ready']['check_s']:.2f}, load and verify {res['ready']['load_s']:.2f}, "
              f"warm-up {res['ready']['warm_up_s']:.2f}; {res['ready']['compiles']} compiled), "
              f"first frame {res['first_frame_s']:.3f} s, next session "
              f"{res['sessions'][-1]['first_frame_s']:.3f} s; steps (ms) "
              + " ".join(f"{t:.0f}" for t in res["step_ms"]), flush=True)
    summary = {v: {k: statistics.median(x[k] for x in rs) for k in ("ready_s", "first_frame_s")}
               | {"compiles": statistics.median(x["ready"]["compiles"] for x in rs),
                  "runs": len(rs)} for v, rs in results.items()}
    (args.out / f"startup_{preset}_{layout}_{gpu}_summary.json").write_text(
        json.dumps({"build_s": build_s, "variants": summary}, indent=1) + "\n")
    for v, s in summary.items():
        print(f"{v}: ready {s['ready_s']:.2f} s, first frame {s['first_frame_s']:.3f} s "
              f"(median of {s['runs']}), {s['compiles']:.0f} kernels compiled at start")


if __name__ == "__main__":
    main()
