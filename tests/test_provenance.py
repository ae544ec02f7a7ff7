"""charengine/provenance.py, in a checkout of its own: the commit a results file records, with
"+" while code is uncommitted, not while only docs/ (where runs write their results) is;
"unknown" outside a checkout."""

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load(copy: Path):
    spec = importlib.util.spec_from_file_location("provenance_copy", copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c",
                           "user.email=t@example.org", *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def test_the_commit_says_when_code_is_uncommitted_and_not_for_results(tmp_path):
    outside = tmp_path / "outside" / "charengine"
    outside.mkdir(parents=True)
    shutil.copy(ROOT / "charengine" / "provenance.py", outside)
    assert load(outside / "provenance.py").commit() == "unknown"

    repo = tmp_path / "repo"
    (repo / "charengine").mkdir(parents=True)
    (repo / "docs" / "results").mkdir(parents=True)
    shutil.copy(ROOT / "charengine" / "provenance.py", repo / "charengine")
    (repo / "docs" / "results" / "run.json").write_text("{}\n")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "first")
    head = git(repo, "rev-parse", "--short", "HEAD")
    prov = load(repo / "charengine" / "provenance.py")
    made = prov.provenance()
    assert made["commit"] == head and re.fullmatch(r"\d{4}-\d\d-\d\d", made["date"])
    (repo / "docs" / "results" / "run.json").write_text('{"ms": 1}\n')  # a run's results
    (repo / "docs" / "results" / "new.json").write_text("{}\n")
    assert prov.commit() == head
    (repo / "charengine" / "provenance.py").write_text(
        (repo / "charengine" / "provenance.py").read_text() + "\n")  # code changed
    assert prov.commit() == head + "+"
    git(repo, "commit", "-qam", "second")
    assert prov.commit() == git(repo, "rev-parse", "--short", "HEAD") != head
