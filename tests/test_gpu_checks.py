"""scripts/gpu_checks.py: its steps hold every file with GPU tests, and a call runs what its
record and budget leave (--dry-run, which needs no GPU); without a GPU it refuses in one
line and writes nothing; a step longer than a call runs detached, and is recorded as it
ended by the calls after it."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from charengine.builder.build_config import find_target
from charengine.family import all_presets
from charengine.provenance import commit

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_checks.py"


def checks(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True)


def names(out: str) -> list[str]:
    return [line.split(":")[0] for line in out.splitlines() if not line.startswith("left ")]


def test_the_steps_run_every_file_with_gpu_tests_once():
    listed = checks("--list")
    assert listed.returncode == 0, listed.stderr
    run = re.findall(r"tests/(test_\w+\.py)", listed.stdout)
    marked = sorted(p.name for p in (ROOT / "tests").glob("test_*.py")
                    if re.search(r"pytest\.mark\.gpu\b", p.read_text()))
    assert len(marked) >= 10 and sorted(run) == marked


def test_every_flag_a_step_gives_its_script_is_one_the_script_takes():
    """The steps run where no GPU is to catch a renamed flag or preset: each script's --help
    here, and the presets and the target the steps name."""
    listed = checks("--list").stdout.splitlines()
    commands = [line.split("  ", 1)[1].split() for line in listed if " scripts/" in line]
    assert len(commands) >= 15
    helps = {}
    for argv in commands:
        script = next(a for a in argv if a.startswith("scripts/"))
        if script not in helps:
            h = subprocess.run([sys.executable, script, "--help"], cwd=ROOT,
                               capture_output=True, text=True)
            assert h.returncode == 0, h.stderr
            helps[script] = set(re.findall(r"--[\w-]+", h.stdout))
        flags = {a for a in argv if a.startswith("--")}
        assert flags <= helps[script], (script, sorted(flags - helps[script]))
        named = dict(zip(argv, argv[1:]))
        if "--preset" in named:
            assert named["--preset"] in all_presets(), (script, named["--preset"])
    # the base compare_trees measures against: a commit, or a directory of its tree
    default, given = (checks("--list", "--only", "compare-trees", *extra).stdout.split()
                      for extra in ((), ("--base", "/srv/base-tree")))
    assert default[default.index("--base") + 1] == "8a2843f"
    assert given[given.index("--base") + 1] == "/srv/base-tree"
    engine = checks("--list", "--only", "engine").stdout.split()
    find_target(engine[engine.index("--target") + 1])  # the target the engine step builds


def test_a_call_resumes_after_the_passed_steps_within_its_budget(tmp_path):
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "manifest.json").write_text("{}")
    record = tmp_path / "checks.json"
    record.write_text(json.dumps({"steps": {
        "engine": {"status": "passed", "commit": commit()},
        "telemetry": {"status": "passed", "commit": commit()},
        "kernels": {"status": "failed", "commit": commit()},
        "models": {"status": "passed", "commit": "0000000"}}}))
    out = checks("--dry-run", "--resume", "--out", record, "--engine", engine,
                 "--budget-min", 12)
    assert out.returncode == 0, out.stderr
    # the failed step and the one passed at another commit run again; the budget ends the call
    assert names(out.stdout) == ["kernels", "models"]
    assert "left batches: for the next call" in out.stdout
    assert "left density-8-batch-8: for the next call" in out.stdout
    assert "left multigpu: needs 2 GPUs, this call has 1" in out.stdout
    short = checks("--dry-run", "--engine", engine, "--budget-min", 9, "--only",
                   "density-8-batch-8,multigpu")
    assert names(short.stdout) == [] and \
        "left density-8-batch-8: expects 11 min, more than --budget-min 9" in short.stdout
    first = checks("--dry-run", "--out", record, "--engine", engine, "--budget-min", 12)
    assert names(first.stdout) == ["engine", "telemetry"]  # without --resume: from the start
    done = checks("--dry-run", "--resume", "--out", record, "--engine", engine, "--only",
                  "engine,telemetry")
    assert done.returncode == 0 and done.stdout.strip() == f"every step has passed at {commit()}"
    (engine / "manifest.json").unlink()  # the engine is gone: built again before its users
    rebuilt = checks("--dry-run", "--resume", "--out", record, "--engine", engine,
                     "--only", "latency")
    assert names(rebuilt.stdout) == ["engine", "latency"]
    assert json.loads(record.read_text())["steps"]["kernels"]["status"] == "failed"  # untouched


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the steps where CUDA is")
def test_without_a_gpu_it_refuses_in_one_line_and_writes_nothing(tmp_path):
    out = checks("--out", tmp_path / "checks.json", "--only", "kernels")
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1
    assert "needs a CUDA GPU" in out.stderr and not (tmp_path / "checks.json").exists()
    bad = checks("--only", "kernels,nonesuch")
    assert bad.returncode == 2 and "unknown step(s) nonesuch" in bad.stderr


@pytest.fixture
def gc(load_script):
    return load_script("gpu_checks")


def test_a_step_is_recorded_as_it_ended(tmp_path, gc):
    lines = "import sys, time; print('\\n'.join(map(str, range(100)))); sys.stdout.flush(); "

    def step(code):
        return gc.Step("probe", 1, (gc.PY, "-c", lines + code))

    ok = gc.run_step(step("print('{engine}' in sys.argv)"), gc.Places(tmp_path), None)
    assert ok["status"] == "passed" and len(ok["tail"]) == gc.TAIL_LINES
    assert ok["tail"][-1] == "False" and ok["tail"][0] == str(100 - gc.TAIL_LINES + 1)
    assert gc.run_step(step("sys.exit(3)"), gc.Places(tmp_path), None)["status"] == "failed"
    # stopped at its timeout, long before its sleep ends; the output it gave is kept (the
    # timeout leaves room for the child's start on a loaded machine)
    slow = gc.run_step(step("time.sleep(600)"), gc.Places(tmp_path), 10)
    assert slow["status"] == "timed out" and slow["tail"][-1] == "99"
    # a step's own children (a script's server) are stopped with it
    spawns = step("import subprocess; child = subprocess.Popen(['sleep', '600']); "
                  "print('child', child.pid, flush=True); time.sleep(600)")
    spawned = gc.run_step(spawns, gc.Places(tmp_path), 10)
    assert spawned["status"] == "timed out" and spawned["tail"][-1].startswith("child ")
    child = int(spawned["tail"][-1].split()[1])
    def gone():
        try:  # a zombie until whoever inherited it reaps it
            return psutil.Process(child).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    for _ in range(100):
        if gone():
            break
        time.sleep(0.1)
    assert gone()


def test_a_step_longer_than_a_call_is_planned_detached(tmp_path):
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "manifest.json").write_text("{}")
    record = tmp_path / "checks.json"
    only = "telemetry,density-1-batch-1,density-2-batch-1,multigpu"
    out = checks("--dry-run", "--detach", "--budget-min", 9, "--out", record, "--engine",
                 engine, "--only", only)
    assert out.returncode == 0, out.stderr
    # the call's own steps, then the first longer than the budget, started detached; the
    # next long one waits for a later call, and is not said to be too long for any
    assert names(out.stdout) == ["telemetry", "density-1-batch-1"]
    assert "density-1-batch-1: detached: " in out.stdout
    assert "left density-2-batch-1: for the next call" in out.stdout
    assert not record.exists()
    bad = checks("--dry-run", "--detach", "--budget-min", 9, "--only", only)
    assert bad.returncode == 2 and "--detach starts a step longer" in bad.stderr
    # a call made while a detached step runs runs nothing else and leaves its record as is
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        running = {"status": "running", "pid": sleeper.pid,
                   "created": psutil.Process(sleeper.pid).create_time(),
                   "started": time.time(),
                   "minutes": 11, "log": str(tmp_path / "log"), "rc": str(tmp_path / "rc")}
        record.write_text(json.dumps({"steps": {"density-1-batch-1": running}}))
        waits = checks("--dry-run", "--detach", "--resume", "--budget-min", 9, "--out", record,
                       "--engine", engine, "--only", only)
        assert waits.returncode == 0 and "this call runs nothing else" in waits.stdout
        assert names(waits.stdout) == ["density-1-batch-1"]
        assert json.loads(record.read_text())["steps"]["density-1-batch-1"] == running
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_detached_step_outlives_its_call_and_is_recorded_as_it_ended(tmp_path, gc):
    out = tmp_path / "checks.json"
    code = "import sys, time; print('\\n'.join(map(str, range(100)))); sys.stdout.flush(); "

    def wait_ended(entry):
        for _ in range(600):  # a loaded machine starts Python slowly
            outcome = gc.collect(entry, time.time())
            if outcome is not None:
                return outcome
            time.sleep(0.1)
        raise AssertionError("the detached step did not end")

    failing = gc.Step("probe", 1, (gc.PY, "-c", code + "print('{engine}'); sys.exit(3)"))
    entry = gc.start_detached(failing, gc.Places(tmp_path / "engine"), out)
    assert entry["status"] == "running" and os.getpgid(entry["pid"]) == entry["pid"]
    outcome = wait_ended(entry)
    assert outcome["status"] == "failed" and len(outcome["tail"]) == gc.TAIL_LINES
    assert outcome["tail"][-1] == str(tmp_path / "engine") and outcome["tail"][0] == "61"
    ended = gc.settle(entry, outcome)
    assert ended["status"] == "failed" and not {"pid", "created", "rc"} & set(ended)
    assert not Path(entry["rc"]).exists() and Path(entry["log"]).parent == tmp_path

    passing = gc.Step("probe", 1, (gc.PY, "-c", code))
    assert wait_ended(gc.start_detached(passing, gc.Places(tmp_path), out))["status"] == "passed"

    # running while within STALE_FACTOR times its minutes; past that, stopped, with its
    # own children (its process session)
    slow = gc.Step("probe", 1, (gc.PY, "-c", code + "time.sleep(600)"))
    entry = gc.start_detached(slow, gc.Places(tmp_path), out)
    assert gc.collect(entry, time.time()) is None
    late = entry["started"] + gc.STALE_FACTOR * slow.minutes * 60 + 1
    outcome = gc.collect(entry, late)
    assert outcome["status"] == "timed out"
    gc.settle(entry, outcome)
    os.waitpid(entry["pid"], 0)  # its shell is this test's child: reaped here
    assert gc.collect(entry, time.time())["status"] == "lost"  # gone, with no exit code

    # a record whose pid now belongs to another process (started at another time) is lost
    other = {**entry, "pid": os.getpid()}
    assert gc.collect(other, time.time())["status"] == "lost"
    mine = psutil.Process(os.getpid()).create_time()
    assert gc.collect({**other, "created": mine}, time.time()) is None
