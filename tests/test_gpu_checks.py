"""scripts/gpu_checks.py: its steps hold every file with GPU tests, and a call runs what its
record and budget leave (--dry-run, which needs no GPU); without a GPU it refuses in one
line and writes nothing."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_checks.py"


def checks(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True)


def names(out: str) -> list[str]:
    return [line.split(":")[0] for line in out.splitlines() if not line.startswith("left ")]


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()


def test_the_steps_run_every_file_with_gpu_tests_once():
    listed = checks("--list")
    assert listed.returncode == 0, listed.stderr
    run = re.findall(r"tests/(test_\w+\.py)", listed.stdout)
    marked = sorted(p.name for p in (ROOT / "tests").glob("test_*.py")
                    if re.search(r"pytest\.mark\.gpu\b", p.read_text()))
    assert len(marked) >= 10 and sorted(run) == marked


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


def test_a_step_is_recorded_as_it_ended(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_checks", SCRIPT)
    gc = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_checks", gc)  # its dataclass looks its module up
    spec.loader.exec_module(gc)
    lines = "import sys, time; print('\\n'.join(map(str, range(100)))); sys.stdout.flush(); "

    def step(code):
        return gc.Step("probe", 1, (gc.PY, "-c", lines + code))

    ok = gc.run_step(step("print('{engine}' in sys.argv)"), tmp_path, None)
    assert ok["status"] == "passed" and len(ok["tail"]) == gc.TAIL_LINES
    assert ok["tail"][-1] == "False" and ok["tail"][0] == str(100 - gc.TAIL_LINES + 1)
    assert gc.run_step(step("sys.exit(3)"), tmp_path, None)["status"] == "failed"
    # stopped at its timeout, long before its sleep ends; the output it gave is kept (the
    # timeout leaves room for the child's start on a loaded machine)
    slow = gc.run_step(step("time.sleep(600)"), tmp_path, 10)
    assert slow["status"] == "timed out" and slow["tail"][-1] == "99"
