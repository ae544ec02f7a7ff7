"""scripts/compare_trees.py's base tree: a commit exported from this checkout's history, or a
directory holding the tree (where a checkout travels without its history), imported through
a site of links; a base it cannot use is one line naming the way out."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def ct(load_script):
    return load_script("compare_trees")


def imports_from(site: Path) -> str:
    """Where `charengine.runtime.cli` comes from, imported through `site` alone."""
    out = subprocess.run([sys.executable, "-c", "import charengine.runtime.cli as m; "
                          "print(m.__file__)"], cwd=site,
                         env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_commit_or_a_directory_of_its_tree_is_the_base(ct, tmp_path):
    from_git = ct.export_tree("HEAD", tmp_path / "git")
    assert (from_git / "charengine" / "provenance.py").is_file()
    assert Path(imports_from(tmp_path / "git" / "site")).resolve().is_relative_to(from_git)

    exported = tmp_path / "exported"
    exported.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(exported)], input=archive, check=True)
    (exported / ".venv").mkdir()  # what a checkout has beside its tree is not copied
    from_dir = ct.export_tree(str(exported), tmp_path / "dir")
    assert not (from_dir / ".venv").exists()
    assert sorted(p.relative_to(from_dir) for p in from_dir.rglob("*.py")) == \
        sorted(p.relative_to(from_git) for p in from_git.rglob("*.py"))
    assert Path(imports_from(tmp_path / "dir" / "site")).resolve().is_relative_to(from_dir)


def test_a_base_it_cannot_use_is_one_line(ct, tmp_path):
    with pytest.raises(SystemExit) as e:
        ct.export_tree("0000000", tmp_path / "none")
    assert "cannot export 0000000" in str(e.value) and "give --base DIR" in str(e.value)
    assert "\n" not in str(e.value)
    (tmp_path / "other").mkdir()
    with pytest.raises(SystemExit, match="holds no charengine/"):
        ct.export_tree(str(tmp_path / "other"), tmp_path / "copy")
