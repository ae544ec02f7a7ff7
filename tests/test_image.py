"""The container image, built and run for real. mmdebstrap makes a Debian base (bookworm with
its python3: what a slim Python base holds), `buildah bud --isolation chroot` builds
charengine:cpu from the Containerfile, pip inside the build reaching the package index and
local wheel directories this machine's pip uses, and inside the image (`buildah run
--isolation chroot`, as the image's user) charbuild builds the tiny engine, the entrypoint
renders an MP4 from it mounted read-only at /engine (decoded back here) and gets ready with
--check. Needs root, buildah and mmdebstrap (Debian: apt-get install buildah mmdebstrap);
skipped otherwise. Everything is kept in a storage directory of the test's own."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest

from rendered import FACE, ROOT, SPEECH, check_mp4, expected_frames

SUITE, MIRROR = "bookworm", "http://deb.debian.org/debian"
# what the base holds beyond apt's minimal system: python3 with venv, useradd, CA certificates
BASE_PACKAGES = ("python3", "python3-venv", "passwd", "ca-certificates")
BASE_EXCLUDES = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/locale/*")
BASE_IMAGE, IMAGE = "localhost/charengine-test-base:bookworm", "localhost/charengine:cpu"
USER_UID = 10001
# the CPU image is torch's CPU build and its dependencies; torch's CUDA build alone would pass
# this (the image measured 1.6 GB)
MAX_IMAGE_BYTES = 2_500_000_000
BASE_TIMEOUT_S, BUILD_TIMEOUT_S, RUN_TIMEOUT_S = 600, 1800, 300
TAIL_LINES = 40


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (mmdebstrap's root mode, buildah's chroot isolation)"
    absent = [t for t in ("buildah", "mmdebstrap") if shutil.which(t) is None]
    if absent:
        return f"needs {' and '.join(absent)} (apt-get install buildah mmdebstrap)"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_missing() is not None,
                                                   reason=_missing() or "")]


def tail(text: str) -> str:
    return "\n".join(text.splitlines()[-TAIL_LINES:])


class Buildah:
    """buildah with a storage directory of its own (nothing reaches the machine's)."""

    def __init__(self, root: Path):
        self.flags = ["--root", str(root / "storage"), "--runroot", str(root / "run")]

    def __call__(self, *args, timeout=RUN_TIMEOUT_S, check=True) -> subprocess.CompletedProcess:
        r = subprocess.run(["buildah", *self.flags, *map(str, args)], capture_output=True,
                           text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if check:
            assert r.returncode == 0, f"buildah {args[0]}: {tail(r.stdout + r.stderr)}"
        return r


def pip_config(path: Path) -> list[Path]:
    """Write this machine's pip configuration (files and PIP_* variables, as `pip config
    list` merges them) to `path` as a pip.conf; returns the local paths it names (a wheel
    directory, a CA bundle, a constraints file, a file:// index with the directory above it,
    where a simple index's relative links lead), which the build binds read-only where they
    lie."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                         text=True, check=True).stdout
    sections: dict[str, dict[str, str]] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        section = "global" if section in (":env:", "") else section
        sections.setdefault(section, {})[name] = value.strip().strip("'\"")
    path.write_text("".join(f"[{s}]\n" + "".join(f"{k} = {v}\n" for k, v in kv.items())
                            for s, kv in sections.items()))
    local = set()
    for kv in sections.values():
        for token in " ".join(kv.values()).split():
            p = Path(urlparse(token).path).parent if token.startswith("file://") else Path(token)
            if p.is_absolute() and p.exists():
                local.add(p)
    return sorted(p for p in local if not any(q in p.parents for q in local))


@pytest.fixture(scope="module")
def buildah(tmp_path_factory):
    root = tmp_path_factory.mktemp("containers")
    b = Buildah(root)
    r = b("info", check=False)
    if r.returncode != 0:
        pytest.skip(f"buildah cannot run here: {tail(r.stderr)}")
    yield b
    b("rm", "--all", check=False)
    b("rmi", "--all", "--force", check=False)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def image(buildah, tmp_path_factory) -> str:
    """charengine:cpu, built from the Containerfile on a Debian base made here."""
    tmp = tmp_path_factory.mktemp("image")
    cmd = ["mmdebstrap", "--mode=root", "--variant=apt", "--include=" + ",".join(BASE_PACKAGES),
           *(f"--dpkgopt=path-exclude={p}" for p in BASE_EXCLUDES), SUITE,
           str(tmp / "base.tar"), MIRROR]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=BASE_TIMEOUT_S,
                       stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        pytest.skip(f"mmdebstrap cannot make a {SUITE} base here: {tail(r.stderr)}")
    c = buildah("from", "scratch").stdout.strip()
    buildah("add", c, tmp / "base.tar", "/")
    buildah("config", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            c)
    buildah("commit", "--quiet", "--rm", c, BASE_IMAGE)
    (tmp / "base.tar").unlink()
    binds = [f"--volume={p}:{p}:ro" for p in pip_config(tmp / "pip.conf")]
    buildah("bud", "--isolation", "chroot", "--pull=never", "--file", ROOT / "Containerfile",
            "--tag", IMAGE, "--build-arg", f"BASE={BASE_IMAGE}",
            f"--volume={tmp / 'pip.conf'}:/etc/pip.conf:ro", *binds, ROOT,
            timeout=BUILD_TIMEOUT_S)
    return IMAGE


@pytest.fixture(scope="module")
def container(buildah, image):
    return buildah("from", "--pull=never", image).stdout.strip()


def config_of(buildah, image) -> dict:
    return json.loads(buildah("inspect", "--type", "image", image).stdout)["OCIv1"]["config"]


def run(buildah, container, *cmd, volumes=(), user=None, check=True):
    """`cmd` inside the image as its user (or `user`), with `volumes` (host, container[,
    "ro"])."""
    binds = [f"--volume={':'.join(map(str, v))}" for v in volumes]
    as_user = ["--user", user] if user else []
    return buildah("run", "--isolation", "chroot", *as_user, *binds, container, "--", *cmd,
                   check=check)


def test_the_image_runs_charrun_on_a_read_only_engine_as_a_user_and_holds_no_build_tools(
        buildah, image, container):
    config = config_of(buildah, image)
    assert config["Entrypoint"] == ["charrun", "--engine", "/engine"]
    assert config["User"] == f"{USER_UID}:{USER_UID}"  # numeric: runAsNonRoot can check it
    assert {"8080/tcp", "8081/tcp"} <= set(config.get("ExposedPorts", {}))
    ids = run(buildah, container, "sh", "-c", "id -u; id -g; id -un").stdout.split()
    assert ids == [str(USER_UID), str(USER_UID), "charengine"]
    found = run(buildah, container, "sh", "-c",
                "for t in gcc cc c++ make git pip pip3; do command -v $t; done; "
                "ls -d /opt/charengine/lib/python3*/site-packages/pip "
                "/opt/charengine/lib/python3*/site-packages/charengine/tests 2>/dev/null",
                check=False).stdout.split()
    assert found == [], found
    size_kib = int(run(buildah, container, "du", "-skx", "/", user="0:0").stdout.split()[0])
    assert size_kib * 1024 < MAX_IMAGE_BYTES, f"the image holds {size_kib} KiB"


def test_inside_the_image_charbuild_builds_the_tiny_engine_and_charrun_renders_and_checks(
        buildah, image, container, tmp_path):
    entrypoint = config_of(buildah, image)["Entrypoint"]
    engines, out = tmp_path / "engines", tmp_path / "out"
    for d in (engines, out):
        d.mkdir()
        os.chown(d, USER_UID, USER_UID)
    r = run(buildah, container, "charbuild", "--target", "cpu-tiny", "--out", "/engines/cpu-tiny",
            volumes=[(engines, "/engines")])
    assert "the trained tiny checkpoint" in r.stderr, r.stderr
    engine = (engines / "cpu-tiny", "/engine", "ro")
    media = [(FACE, "/media/face.png", "ro"), (SPEECH, "/media/speech.wav", "ro")]
    r = run(buildah, container, *entrypoint, "--image", "/media/face.png", "--audio",
            "/media/speech.wav", "--out", "/out/demo.mp4", volumes=[engine, *media, (out, "/out")])
    assert "wrote /out/demo.mp4" in r.stdout + r.stderr
    check_mp4(out / "demo.mp4", expected_frames(SPEECH))
    assert (out / "demo.mp4").stat().st_uid == USER_UID  # written by charrun, as the user
    r = run(buildah, container, *entrypoint, "--check", volumes=[engine])
    assert "ready in" in r.stdout + r.stderr and "0 kernels compiled" in r.stdout + r.stderr
    # the engine's mount is read-only for the process
    r = run(buildah, container, "touch", "/engine/x", volumes=[engine], check=False)
    assert r.returncode != 0 and not (engines / "cpu-tiny/x").exists()
