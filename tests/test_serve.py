"""charrun --serve end to end: the server and headless Chromium inside a network namespace
that the test creates (aioice gathers no loopback candidates; inside the namespace the only
other addresses are on a veth pair of the test's own, both ends inside, so no traffic
leaves it)."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from engines import ROOT, build_target

CHROMIUM = shutil.which("chromium")


def _can_netns() -> bool:
    if os.geteuid() != 0 or not shutil.which("ip"):
        return False
    name = f"charprobe{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ok


def _have_playwright() -> bool:
    try:
        import playwright  # noqa: F401
        return True
    except ImportError:
        return False


pytestmark = pytest.mark.skipif(
    not (CHROMIUM and _have_playwright() and _can_netns()),
    reason="needs root (network namespaces), Debian's chromium and playwright")


@pytest.fixture
def netns():
    name = f"charns{os.getpid()}"
    run = lambda *a: subprocess.run(["ip", *a], check=True, capture_output=True)  # noqa: E731
    run("netns", "add", name)
    try:
        run("-n", name, "link", "set", "lo", "up")
        run("-n", name, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
        for dev, addr in (("v0", "10.233.0.1/24"), ("v1", "10.233.0.2/24")):
            run("-n", name, "addr", "add", addr, "dev", dev)
            run("-n", name, "link", "set", dev, "up")
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _in_ns(ns, *cmd):
    return ["ip", "netns", "exec", ns, *cmd]


def _wait_http(ns, url, timeout=60):
    end = time.time() + timeout
    while time.time() < end:
        r = subprocess.run(_in_ns(ns, sys.executable, "-c",
                                  f"import urllib.request; urllib.request.urlopen('{url}')"),
                           capture_output=True)
        if r.returncode == 0:
            return
        time.sleep(0.5)
    raise TimeoutError(url)


def _get(ns, url) -> str:
    return subprocess.run(_in_ns(ns, sys.executable, "-c",
                                 f"import urllib.request; print(urllib.request.urlopen('{url}')"
                                 ".read().decode())"), capture_output=True, text=True,
                          check=True).stdout


def _serve(ns, engine, port):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen(_in_ns(ns, sys.executable, "-m", "charengine.runtime.cli",
                                     "--engine", str(engine), "--serve", "--port", str(port)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}/"
    try:
        _wait_http(ns, url)
    except TimeoutError:
        server.kill()
        raise
    return server, url


def _end(server) -> str:
    server.terminate()
    try:
        out, _ = server.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()
        out, _ = server.communicate()
    return out


@pytest.mark.parametrize("source", ["upload", "microphone"])
def test_page_streams_video_at_24fps_with_audio_to_chromium(netns, tmp_path, source):
    server, url = _serve(netns, build_target(tmp_path), 8765)
    try:
        shot = tmp_path / "page.png"
        speech = ["--speech", str(ROOT / "assets/speech.wav")] if source == "upload" else ["--mic"]
        r = subprocess.run(_in_ns(netns, sys.executable, str(ROOT / "tests/browser_client.py"),
                                  "--url", url, "--image", str(ROOT / "assets/face.png"),
                                  *speech, "--seconds", "4", "--shot", str(shot)),
                           capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        stats = json.loads(r.stdout.strip().splitlines()[-1])
        first, last = stats["first"], stats["last"]
        fps = (last["video"]["framesDecoded"] - first["video"]["framesDecoded"]) / stats["elapsed"]
        assert 20 <= fps <= 28, stats
        assert last["video"]["frameWidth"] == 64
        samples = last["audio"]["totalSamplesReceived"] - first["audio"]["totalSamplesReceived"]
        assert samples > 0.8 * 48000 * stats["elapsed"], stats  # audio keeps arriving
        concealed = last["audio"]["concealedSamples"] - first["audio"]["concealedSamples"]
        assert concealed < 0.05 * samples, stats  # and plays without gaps
        assert shot.stat().st_size > 1000
        metrics = _get(netns, url + "metrics")
        assert "charengine_sessions_started_total 1.0" in metrics
        assert "charengine_sessions_finished_total 1.0" in metrics  # the page's Stop
        assert "charengine_frame_drift_seconds_count" in metrics
    finally:
        out = _end(server)
    assert "Traceback" not in out, out


def test_a_rank_that_dies_mid_session_is_told_to_the_page_and_the_next_session_runs(
        netns, tmp_path):
    import psutil

    server, url = _serve(netns, build_target(tmp_path, "cpu-tiny-tp2"), 8766)
    try:
        client = subprocess.Popen(_in_ns(netns, sys.executable, str(ROOT / "tests/browser_client.py"),
                                         "--url", url, "--image", str(ROOT / "assets/face.png"),
                                         "--speech", str(ROOT / "assets/speech.wav"),
                                         "--wait-error", "40", "--shot", str(tmp_path / "e.png")),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert client.stdout.readline().strip() == "STREAMING", client.stderr.read()
        ranks = [p for p in psutil.Process(server.pid).children(recursive=True)
                 if "multiprocessing" in " ".join(p.cmdline())]
        assert ranks, "no rank processes"
        ranks[-1].kill()
        out, err = client.communicate(timeout=120)
        assert client.returncode == 0, out + err
        said = json.loads(out.strip().splitlines()[-1])["error"]
        assert "The session stopped" in said and "died" in said and "Press Start" in said
        r = subprocess.run(_in_ns(netns, sys.executable, str(ROOT / "tests/browser_client.py"),
                                  "--url", url, "--image", str(ROOT / "assets/face.png"),
                                  "--speech", str(ROOT / "assets/speech.wav"), "--seconds", "2",
                                  "--shot", str(tmp_path / "again.png")),
                           capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr  # fresh ranks: video flows again
    finally:
        out = _end(server)
    assert "Traceback" not in out, out


def test_the_page_streams_livetalk_at_16fps_to_chromium(netns, tmp_path):
    server, url = _serve(netns, build_target(tmp_path, "cpu-tiny-livetalk"), 8767)
    try:
        r = subprocess.run(_in_ns(netns, sys.executable, str(ROOT / "tests/browser_client.py"),
                                  "--url", url, "--image", str(ROOT / "assets/face.png"),
                                  "--speech", str(ROOT / "assets/speech.wav"), "--seconds", "4",
                                  "--shot", str(tmp_path / "page.png")),
                           capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        stats = json.loads(r.stdout.strip().splitlines()[-1])
        first, last = stats["first"], stats["last"]
        fps = (last["video"]["framesDecoded"] - first["video"]["framesDecoded"]) / stats["elapsed"]
        assert 13 <= fps <= 19, stats
        assert last["video"]["frameWidth"] == 64
        samples = last["audio"]["totalSamplesReceived"] - first["audio"]["totalSamplesReceived"]
        assert samples > 0.8 * 48000 * stats["elapsed"], stats
        status = json.loads(_get(netns, url + "status"))
        assert status["model"] == "tiny-livetalk" and status["fps"] == 16
    finally:
        out = _end(server)
    assert "Traceback" not in out, out
