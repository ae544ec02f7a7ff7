"""charengine as a wheel: built from the source tree, installed into a fresh virtual
environment outside the checkout and run from there. charbuild finds its targets and the
shipped tiny checkpoint, charrun renders an MP4 (decoded back) and serves the page, all
through the installed package, never the source tree."""

import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

from rendered import FACE, ROOT, SPEECH, check_mp4, expected_frames

# what the wheel is built from: the same paths the Containerfile copies
SOURCES = ("pyproject.toml", "charengine")
# package data: the source directory and where the installed package holds it
PACKAGE_DATA = {"charengine/targets": "charengine/targets",
                "charengine/checkpoints": "charengine/checkpoints",
                "charengine/runtime/static": "charengine/runtime/static"}
TIMEOUT_S = 300
SERVE_READY_S = 120


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip wheel .` makes from a copy of the sources (the build writes beside
    them)."""
    tmp = tmp_path_factory.mktemp("wheel")
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, tmp / "src" / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            (tmp / "src").mkdir(exist_ok=True)
            shutil.copy2(src, tmp / "src" / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
                        "--wheel-dir", str(tmp / "dist"), str(tmp / "src")],
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr
    (whl,) = (tmp / "dist").glob("charengine-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment outside the checkout with the wheel installed (its
    dependencies are this environment's, reached through a .pth file, so that torch is not
    installed twice; the editable install's finder is not among them, as a .pth's own
    directory is not a site directory)."""
    env = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    py = env / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet",
                        "--no-deps", "--no-index", str(wheel)],
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    deps = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    (site / "dependencies.pth").write_text("".join(f"{d}\n" for d in deps))
    return env


@pytest.fixture(scope="module")
def engine(venv, tmp_path_factory) -> Path:
    """The tiny engine, built by the wheel's charbuild from its shipped checkpoint, run in a
    directory outside the checkout."""
    work = tmp_path_factory.mktemp("work")
    r = run_in(venv, "charbuild", "--target", "cpu-tiny", "--out", "engines/cpu-tiny",
               cwd=work)
    assert r.returncode == 0, r.stderr
    return work / "engines/cpu-tiny"


def run_in(venv, *cmd, cwd, **kw):
    """A command of the fresh environment, run in `cwd` (outside the checkout) with no
    PYTHONPATH that could reach the source tree."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run([str(venv / "bin" / cmd[0]), *map(str, cmd[1:])], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S, **kw)


def test_the_wheel_carries_the_package_data_and_nothing_of_the_checkout(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for src, installed in PACKAGE_DATA.items():
        files = [f.name for f in (ROOT / src).iterdir() if f.is_file()]
        assert files, src
        for name in files:
            assert f"{installed}/{name}" in names, f"{src}/{name}"
    assert all(n.startswith(("charengine/", "charengine-")) for n in names), names
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)


def test_the_installed_package_is_the_wheel_not_the_source_tree(venv, tmp_path):
    r = run_in(venv, "python", "-c", "import charengine, charengine.builder.build_config as b; "
               "print(charengine.__file__); print(b.TARGETS_DIR)", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    package, targets = map(Path, r.stdout.split())
    assert package.is_relative_to(venv) and targets.is_relative_to(venv)
    assert not package.is_relative_to(ROOT)


def test_charbuild_and_charrun_from_the_wheel_build_and_render_the_tiny_engine(venv, engine,
                                                                               tmp_path):
    manifest = json.loads((engine / "manifest.json").read_text())
    checkpoint = Path(manifest["weights"]["checkpoint"])
    assert checkpoint.is_relative_to(venv) and checkpoint.name == "tiny.safetensors"
    r = run_in(venv, "charrun", "--engine", engine, "--image", FACE, "--audio", SPEECH,
               "--out", "out/demo.mp4", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    check_mp4(tmp_path / "out/demo.mp4", expected_frames())
    # an unknown target is refused naming the targets the installed package holds
    r = run_in(venv, "charbuild", "--target", "no-such-gpu", "--out", "x", cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "known targets: b200-tp2, cpu-tiny" in r.stderr and not (tmp_path / "x").exists()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_charrun_serve_from_the_wheel_serves_the_page_from_package_data(venv, engine,
                                                                       tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    p = subprocess.Popen([str(venv / "bin/charrun"), "--engine", str(engine), "--serve",
                          "--port", str(port), "--health-port", str(free_port())],
                         cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline, page = time.time() + SERVE_READY_S, None
        while page is None and time.time() < deadline and p.poll() is None:
            try:
                page = urllib.request.urlopen(f"http://127.0.0.1:{port}/").read().decode()
            except OSError:
                time.sleep(0.5)
        assert page is not None, p.stderr.read() if p.poll() is not None else "no page"
        assert "<title>charengine</title>" in page
    finally:
        p.terminate()
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
