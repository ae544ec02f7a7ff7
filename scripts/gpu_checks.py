"""Every GPU test and the GPU run of each script, in order, as steps that one call runs within
a time budget and the next call resumes: how a tree whose GPU code changed, or a new GPU, is
checked before its figures are trusted.

    python scripts/gpu_checks.py --list                          # the steps and their commands
    python scripts/gpu_checks.py --engine /tmp/lt --budget-min 9 --resume \\
        --out docs/results/gpu_checks_h200.json                  # again until all have run
    python scripts/gpu_checks.py --only kernels,models --out /tmp/checks.json

After each step its outcome (passed, failed or timed out, its seconds, the commit, the tail
of its output) is written to --out; --resume skips the steps the file records as passed at
this commit. A step whose expected minutes do not fit what is left of --budget-min is not
started (the next call takes it); one that outruns the budget is stopped and recorded as
timed out. The engine step runs first whenever a step needs --engine and it holds no
engine. Steps that need more GPUs than the machine has are left for one that has them.
--base gives the compare-trees step a directory of the base commit's tree where this
checkout travels without its history.
--dry-run prints what a call would run (no GPU needed).

A step longer than any one call (a density run of 10 minutes where a call may take 9) needs
--detach: when the next step in order expects more than --budget-min, it is started once the
call's own steps have ended, in a process session of its own that outlives the call, its
output to a log beside --out; the call returns. Each later call first looks at it: while it
runs, the call runs nothing else (the GPU is its) and says so; once it has ended, its exit
code and the tail of its log are recorded as any step's, and the call goes on. One that
ended without an exit code (killed, or its machine restarted) is recorded as lost and runs
again; one still running at STALE_FACTOR times its expected minutes is stopped and recorded
as timed out.

    python scripts/gpu_checks.py --engine /tmp/lt --budget-min 9 --resume --detach \\
        --out docs/results/gpu_checks_h200.json          # again until all have run
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from charengine import provenance

ROOT = Path(__file__).resolve().parents[1]
TAIL_LINES = 40  # of a step's output kept in --out
PY = "{python}"  # the interpreter running this script
ENGINE = "{engine}"  # --engine: h200-livetalk with random weights, built by the first step
BASE = "{base}"  # --base: the commit (or a directory of its tree) compare_trees measures against
BASE_COMMIT = "8a2843f"  # the tree before the second family was reworked
DENSITY_SESSIONS = (1, 2, 4, 8)  # each served with single steps and with batches of all
KILLED_OUTPUT_S = 30.0  # to read a stopped step's last output
STALE_FACTOR = 3  # a detached step still running at this many times its minutes is stopped
# a detached step's shell: its command's output to its log, then its exit code to a file
# written whole (moved into place), so a reader never sees half of one
DETACHED_SHELL = '"$@"; rc=$?; echo $rc > "$0.part" && mv "$0.part" "$0"'


@dataclass(frozen=True)
class Step:
    name: str
    minutes: float  # expected on one H200, an estimate until --out records its seconds
    command: tuple[str, ...]
    gpus: int = 1
    makes_engine: bool = False


def _pytest(*files: str) -> tuple[str, ...]:
    return (PY, "-m", "pytest", "-q", "-m", "gpu", *(f"tests/{f}" for f in files))


def _script(name: str, *args: str) -> tuple[str, ...]:
    return (PY, f"scripts/{name}", *args)


def _density(sessions: int, batch: int) -> Step:
    return Step(f"density-{sessions}-batch-{batch}", 11,
                _script("bench_density.py", "--engine", ENGINE, "--sessions", str(sessions),
                        "--minutes", "10", "--batch", str(batch), "--netns", "--resume",
                        "--out", "docs/results/density/density_livetalk-1.3b_h200.json"))


STEPS = (
    Step("engine", 4, (PY, "-m", "charengine.builder.cli", "--target", "h200-livetalk",
                       "--random-weights", "--out", ENGINE), makes_engine=True),
    Step("telemetry", 4, _pytest("test_gpu_telemetry.py")),
    Step("kernels", 6, _pytest("test_kernels.py", "test_livetalk_kernels.py",
                               "test_act_quant.py", "test_pre_attention_width.py",
                               "test_custom_ops.py", "test_gemm_allreduce.py")),
    Step("models", 6, _pytest("test_gpu.py", "test_livetalk_model.py", "test_livetalk_vae.py",
                              "test_livetalk_audio.py", "test_startup.py")),
    Step("batches", 3, _pytest("test_batches.py")),
    Step("compare-trees", 9, _script("compare_trees.py", "--base", BASE, "--runs", "3",
                                     "--out", f"docs/results/compare_{BASE_COMMIT}_h200.json")),
    Step("session-batches", 3, _script("bench_session.py", "--engine", ENGINE, "--steps", "40",
                                       "--batches", "2,4,8")),
    Step("kernels-livetalk", 3, _script("bench_kernels.py", "--preset", "livetalk-1.3b")),
    Step("kernels-characters", 4, _script("bench_kernels.py", "--preset", "characters-57b",
                                          "--tp", "3")),
    Step("sidenets", 2, _script("bench_sidenets.py", "--preset", "livetalk-1.3b")),
    Step("numerics", 3, _script("numerics_compare.py", "--preset", "livetalk-1.3b",
                                "--device", "cuda")),
    Step("startup", 4, _script("bench_startup.py", "--engine", ENGINE)),
    Step("waterfall", 8, _script("bench_waterfall.py", "--preset", "livetalk-1.3b")),
    Step("latency", 3, _script("livetalk_latency.py", "--engine", ENGINE, "--chunks", "100",
                               "--turn-s", "4", "--pause-s", "3")),
    Step("latency-bursts", 3, _script("livetalk_latency.py", "--engine", ENGINE, "--chunks",
                                      "100", "--turn-s", "4", "--pause-s", "3", "--burst", "4")),
    Step("pipecat", 4, _script("bench_pipecat.py", "--engine", ENGINE, "--netns", "--out",
                               "docs/results/pipecat/turns_livetalk-1.3b_h200.json")),
    Step("soak", 6, _script("soak.py", "--engine", ENGINE, "--sessions", "4", "--batch", "4",
                            "--waves", "10", "--netns", "--out",
                            "docs/results/soak/soak_livetalk-1.3b_h200.json")),
    *(_density(n, b) for n in DENSITY_SESSIONS for b in sorted({1, n})),
    Step("multigpu", 5, _pytest("test_multigpu.py"), gpus=2),
)


@dataclass(frozen=True)
class Places:
    """What a call fills the steps' commands with."""
    engine: Path
    base: str = BASE_COMMIT


def command(step: Step, places: Places) -> list[str]:
    return [a.format(python=sys.executable, engine=places.engine, base=places.base)
            for a in step.command]


def plan(steps, record: dict, commit: str, engine: Path, budget_min: float | None, gpus: int,
         resume: bool, detach: bool = False) -> tuple[list[Step], Step | None, list[str]]:
    """The steps this call runs, in order; the step it then starts detached (--detach: the
    next in order when it expects more than the budget), if any; and a line for each it
    leaves and why."""
    chosen, detached, left, minutes, full = [], None, [], 0.0, False
    built = (engine / "manifest.json").is_file()
    if not built and any(ENGINE in s.command for s in steps):
        steps = [*(s for s in STEPS if s.makes_engine and s not in steps), *steps]
    for s in steps:
        done = record.get(s.name, {})
        passed = done.get("status") == "passed" and done.get("commit") == commit
        if resume and passed and (built or not s.makes_engine):
            continue
        if s.gpus > gpus:
            left.append(f"{s.name}: needs {s.gpus} GPUs, this call has {gpus}")
        elif detach and not full and budget_min is not None and s.minutes > budget_min:
            detached, full = s, True  # longer than any call: started at this call's end
        elif not detach and budget_min is not None and s.minutes > budget_min:
            left.append(f"{s.name}: expects {s.minutes:g} min, more than --budget-min "
                        f"{budget_min:g}")
        elif full or (budget_min is not None and minutes + s.minutes > budget_min):
            full = True  # the steps keep their order: the rest wait for the next call
            left.append(f"{s.name}: for the next call")
        else:
            chosen.append(s)
            minutes += s.minutes
    return chosen, detached, left


def run_step(step: Step, places: Places, timeout_s: float | None) -> dict:
    """Runs the step in a process session of its own: at its timeout the whole session is
    stopped (a script's servers and rank processes too, which would otherwise hold the GPU
    under the steps after it). Its output and error interleaved, as a reader saw them."""
    t0 = time.perf_counter()
    p = subprocess.Popen(command(step, places), cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                         errors="replace", start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout_s)
        status = "passed" if p.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        status = "timed out"
        os.killpg(p.pid, signal.SIGKILL)
        try:  # what it wrote before; a process that left the session may hold the pipe
            out, _ = p.communicate(timeout=KILLED_OUTPUT_S)
        except subprocess.TimeoutExpired:
            out = ""
            p.wait()
    return {"status": status, "seconds": round(time.perf_counter() - t0, 1),
            "tail": out.splitlines()[-TAIL_LINES:]}


def save(out: Path, record: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"steps": record}, indent=1) + "\n")


def made(step: Step, places: Places, commit: str, gpu: str) -> dict:
    """What a step's record says of its run besides its outcome."""
    return {"commit": commit, "gpu": gpu, "command": " ".join(command(step, places)),
            "at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def detached_paths(out: Path, step: Step) -> tuple[Path, Path]:
    """A detached step's log and exit-code file, beside --out."""
    return (out.with_name(f"{out.stem}.{step.name}.log"),
            out.with_name(f"{out.stem}.{step.name}.rc"))


def start_detached(step: Step, places: Places, out: Path) -> dict:
    """Starts the step in a process session of its own, which outlives this call; the record
    of it as running."""
    log, rc = detached_paths(out, step)
    rc.unlink(missing_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        p = subprocess.Popen(["sh", "-c", DETACHED_SHELL, str(rc), *command(step, places)],
                             cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    return {"status": "running", "pid": p.pid, "created": psutil.Process(p.pid).create_time(),
            "started": time.time(), "minutes": step.minutes, "log": str(log), "rc": str(rc)}


def _alive(entry: dict) -> bool:
    """Whether the detached shell still runs: its pid is there, not a zombie, and was created
    when it was (not a pid reused since)."""
    try:
        p = psutil.Process(entry["pid"])
        return p.create_time() == entry["created"] and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def collect(entry: dict, now: float) -> dict | None:
    """A detached step's outcome once it has ended (passed, failed, lost) or has run
    STALE_FACTOR times its minutes (timed out: `settle` stops it), or None while it runs.
    Reads only."""
    rc, log = Path(entry["rc"]), Path(entry["log"])
    if rc.is_file():
        status = "passed" if rc.read_text().strip() == "0" else "failed"
        ended = rc.stat().st_mtime
    elif not _alive(entry):
        status, ended = "lost", now  # gone with no exit code: killed, or a restart
    elif now - entry["started"] > STALE_FACTOR * entry["minutes"] * 60:
        status, ended = "timed out", now
    else:
        return None
    tail = log.read_text(errors="replace").splitlines()[-TAIL_LINES:] if log.is_file() else []
    return {"status": status, "seconds": round(ended - entry["started"], 1), "tail": tail}


def settle(entry: dict, outcome: dict) -> dict:
    """Stops a timed-out detached step, removes its exit-code file; its record as ended."""
    if outcome["status"] == "timed out":
        try:
            os.killpg(entry["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass  # it ended since
    Path(entry["rc"]).unlink(missing_ok=True)
    return {**{k: v for k, v in entry.items() if k not in ("pid", "created", "rc", "started")},
            **outcome}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, default=Path("/tmp/lt"))
    ap.add_argument("--base", default=BASE_COMMIT,
                    help="the base of the compare-trees step: a commit, or a directory of its "
                         "exported tree where this checkout has no history")
    ap.add_argument("--out", type=Path, help="the steps' outcomes (JSON), written after each")
    ap.add_argument("--resume", action="store_true", help="skip the steps --out has passed")
    ap.add_argument("--budget-min", type=float, help="minutes this call may take")
    ap.add_argument("--only", help="comma-separated step names")
    ap.add_argument("--detach", action="store_true",
                    help="start the next step detached when it expects more than --budget-min; "
                         "later calls record it once it has ended (needs --out)")
    ap.add_argument("--list", action="store_true", help="print every step and exit")
    ap.add_argument("--dry-run", action="store_true", help="print what would run and exit")
    a = ap.parse_args(argv)
    places = Places(a.engine, a.base)
    steps = STEPS
    if a.only:
        names = a.only.split(",")
        unknown = sorted(set(names) - {s.name for s in STEPS})
        if unknown:
            ap.error(f"unknown step(s) {', '.join(unknown)}; --list shows them")
        steps = tuple(s for s in STEPS if s.name in names)
    if a.list:
        for s in steps:
            gpus = f", {s.gpus} GPUs" if s.gpus > 1 else ""
            print(f"{s.name:20s} {s.minutes:4g} min{gpus}  {' '.join(command(s, places))}")
        return 0
    if a.resume and a.out is None:
        ap.error("--resume reads the outcomes of --out: give --out")
    if a.detach and (a.out is None or a.budget_min is None):
        ap.error("--detach starts a step longer than --budget-min and records it in --out: "
                 "give both")
    try:
        # the outcomes already there are kept (a step run again replaces its own)
        saved = json.loads(a.out.read_text()) if a.out is not None and a.out.is_file() else {}
    except (OSError, json.JSONDecodeError) as e:
        print(f"gpu_checks: cannot read {a.out} ({e}); give another --out or fix it",
              file=sys.stderr)
        return 2
    record, failed = saved.get("steps", {}), 0
    for name, entry in list(record.items()):  # detached steps started by earlier calls
        if entry.get("status") != "running":
            continue
        outcome = collect(entry, time.time())
        if outcome is None or a.dry_run:
            state = "running" if outcome is None else f"ended ({outcome['status']})"
            print(f"{name}: {state} detached (pid {entry['pid']}, "
                  f"{(time.time() - entry['started']) / 60:.1f} min since its start, expects "
                  f"{entry['minutes']:g}); " + ("this call runs nothing else" if outcome is None
                                                 else "a call records it first"), flush=True)
            return 0
        record[name] = settle(entry, outcome)
        failed += outcome["status"] != "passed"
        print(f"{name}: {outcome['status']} in {outcome['seconds']:.0f} s (detached)",
              flush=True)
        save(a.out, record)
    commit = provenance.commit()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not a.dry_run and gpus == 0:
        print("gpu_checks: needs a CUDA GPU and this machine has none; --list or --dry-run "
              "shows the steps", file=sys.stderr)
        return 2
    # a dry run on a machine without CUDA plans for one GPU
    chosen, detached, left = plan(steps, record, commit, a.engine, a.budget_min, max(gpus, 1),
                                  a.resume, a.detach)
    if not (chosen or detached or left):
        print(f"every step has passed at {commit}")
        return 1 if failed else 0
    if a.dry_run:
        for s in chosen:
            print(f"{s.name}: {' '.join(command(s, places))}")
        if detached is not None:
            print(f"{detached.name}: detached: {' '.join(command(detached, places))}")
        for line in left:
            print(f"left {line}")
        return 0
    t0 = time.perf_counter()
    gpu = torch.cuda.get_device_name(0)
    for s in chosen:
        left_s = None if a.budget_min is None else a.budget_min * 60 - (time.perf_counter() - t0)
        print(f"{s.name}: running (expects {s.minutes:g} min)", flush=True)
        outcome = run_step(s, places, left_s)
        record[s.name] = {**outcome, **made(s, places, commit, gpu)}
        failed += outcome["status"] != "passed"
        print(f"{s.name}: {outcome['status']} in {outcome['seconds']:.0f} s", flush=True)
        if a.out is not None:
            save(a.out, record)
        if outcome["status"] == "timed out":
            break
    else:
        if detached is not None:
            record[detached.name] = {**start_detached(detached, places, a.out),
                                     **made(detached, places, commit, gpu)}
            save(a.out, record)
            print(f"{detached.name}: started detached (expects {detached.minutes:g} min, "
                  f"log {record[detached.name]['log']}); call again once it has ended",
                  flush=True)
    for line in left:
        print(f"left {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
