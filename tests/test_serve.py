"""charrun --serve end to end: the server and headless Chromium inside a network namespace
that the test creates (aioice gathers no loopback candidates; inside the namespace the only
other addresses are on a veth pair of the test's own, both ends inside, so no traffic
leaves it). tests/browser_client.py drives the page and reads it as a person would: its
state and sentences, the engine line, the live numbers and the chart; getStats() counts
what arrived."""

import json
import shutil
import subprocess
import sys

import pytest

from engines import ROOT, build_target
from netns import can_netns, end_server, in_ns, namespace, serve_in

CHROMIUM = shutil.which("chromium")


def _have_playwright() -> bool:
    try:
        import playwright  # noqa: F401
        return True
    except ImportError:
        return False


pytestmark = pytest.mark.skipif(
    not (CHROMIUM and _have_playwright() and can_netns()),
    reason="needs root (network namespaces), Debian's chromium and playwright")


@pytest.fixture
def netns():
    with namespace("charns", "10.233.0") as name:
        yield name


def _get(ns, url) -> str:
    return subprocess.run(in_ns(ns, sys.executable, "-c",
                                f"import urllib.request; print(urllib.request.urlopen('{url}')"
                                ".read().decode())"), capture_output=True, text=True,
                          check=True).stdout


def _client(ns, url, *args, timeout=180):
    r = subprocess.run(in_ns(ns, sys.executable, str(ROOT / "tests/browser_client.py"),
                             "--url", url, *args), capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["policy_refused"] == [], got["policy_refused"]  # the page's policy fits it
    return got


def _fps(stats) -> float:
    first, last = stats["first"], stats["last"]
    return (last["video"]["framesDecoded"] - first["video"]["framesDecoded"]) / stats["elapsed"]


def _audio_flows(stats) -> None:
    """Audio keeps arriving with the video (how smoothly is the machine's: a loaded one
    conceals more; scripts/ measure it)."""
    first, last = stats["first"], stats["last"]
    samples = last["audio"]["totalSamplesReceived"] - first["audio"]["totalSamplesReceived"]
    packets = last["audio"]["packetsReceived"] - first["audio"]["packetsReceived"]
    assert samples > 0 and packets > 0, stats


def _value(numbers, name, key="value") -> float:
    return float(numbers[name][key])


def _metric(text: str, name: str) -> float:
    return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith(name + " ")))


def _long_speech(path):
    """assets/speech.wav eight times over: speech that outlasts the tour's reading, however
    slowly this machine plays it."""
    import wave

    with wave.open(str(ROOT / "assets/speech.wav")) as w:
        params, frames = w.getparams(), w.readframes(w.getnframes())
    with wave.open(str(path), "wb") as w:
        w.setparams(params)
        w.writeframes(frames * 8)
    return path


def test_the_page_as_a_first_visit_meets_it(netns, tmp_path):
    """Engine line, a file that is not an image, speech that is not audio, a session's states,
    the live numbers and chart from the page itself (the same numbers as /metrics), 24 fps
    with audio by getStats(), two widths, Interrupt, Stop, and a proxy's 502 without JSON."""
    server, url = serve_in(netns, build_target(tmp_path), 8765)
    try:
        notes = tmp_path / "notes.txt"
        notes.write_text("not a face, not a voice\n" * 40)
        t = _client(netns, url, "--tour", str(tmp_path / "shots"), "--image",
                    str(ROOT / "assets/face.png"), "--speech", str(_long_speech(tmp_path /
                    "speech.wav")), "--not-image", str(notes), "--seconds", "3")
        metrics_after = _get(netns, url + "metrics")
    finally:
        out = end_server(server)
    assert "Traceback" not in out, out

    loaded = t["loaded"]
    assert loaded["engine"] == {"family": "characters", "preset": "tiny", "target": "cpu-tiny",
                                "fps": "24 fps", "frame": "64 × 64",
                                "unit": "steps of 4 frames", "device": "CPU"}, loaded
    assert loaded["state"] == "ready" and loaded["start_enabled"], loaded

    assert '"notes.txt" is not an image' in t["not_image"] and "Choose a PNG" in t["not_image"]
    assert t["not_image_page"]["state"] == "error" and not t["not_image_page"]["start_enabled"]
    assert "64 × 64" in t["image_note"] and not t["image_ready"]["error"], t["image_ready"]
    said = t["not_audio"]  # the server's JSON 400, in words, with what to do
    assert said.startswith("Could not start: the speech \"notes.txt\": not an audio file"), said
    assert "Check the image and speech you chose, then press Start again." in said, said

    # the rates below are the machine's (a loaded one plays slower): the page must show
    # the server's own numbers, which the same object gives /metrics
    assert t["after_start"] == "connecting" and t["streaming_state"] == "speaking", t
    assert _fps(t) > 0, t  # by the browser's own count
    _audio_flows(t)
    assert t["last"]["video"]["frameWidth"] == 64

    n1, n2, n3 = (t[f"numbers_{k}"]["numbers"] for k in (1, 2, 3))
    c1, c2, c3 = (t[f"numbers_{k}"]["chart"] for k in (1, 2, 3))
    assert t["numbers_2"]["step_label"] == "Step time"
    assert _value(n3, "playback") > 0, n3  # the last 5 s, past the start
    gen, factor = _value(n2, "generation"), _value(n2, "generation", "realtime")
    assert gen > 0 and factor == pytest.approx(gen / 24, rel=1e-6), n2
    p50, p90 = _value(n2, "step", "p50"), _value(n2, "step", "p90")
    assert 0 < p50 <= p90, n2
    assert 0 <= _value(n2, "queue", "steps") <= 2 and _value(n2, "queue", "frames") >= 0, n2
    assert 0 < _value(n2, "latency"), n2  # the clip's first sample to its frame
    assert 0 <= _value(n2, "drift", "p90") <= _value(n2, "drift", "max"), n2
    assert c2["updates"] > c1["updates"] and c2["count"] > c1["count"], (c1, c2)
    assert c2["points"] != c1["points"] and c2["count"] == len(c2["points"].split()), c2
    assert c2["budget_label"] == "real-time budget 167 ms", c2

    m = t["metrics"]  # read between numbers_2 and numbers_3: the same source
    assert c2["count"] <= _metric(m, "charengine_step_seconds_count") <= c3["count"], (c2, c3)
    assert _value(n2, "stalls") <= _metric(m, "charengine_stalls_total") <= _value(n3, "stalls")
    assert _metric(m, 'charengine_live_step_seconds{quantile="0.5"}') > 0
    assert _metric(m, "charengine_live_playback_fps") > 0

    wide, phone = t["wide_layout"], t["phone_layout"]
    assert wide["controls"]["right"] <= wide["screen"]["left"], wide  # the character between
    assert wide["numbers"]["left"] >= wide["screen"]["right"], wide  # the controls and numbers
    assert wide["screen"]["width"] >= 500 and wide["numbers"]["bottom"] <= 800, wide
    assert phone["controls"]["top"] >= phone["screen"]["bottom"], phone  # below it
    assert phone["page_width"] <= 390 and phone["screen"]["width"] >= 340, phone
    for name in ("serve_wide.png", "serve_phone.png"):
        assert (tmp_path / "shots" / name).stat().st_size > 10_000

    assert t["before_interrupt"] == "speaking" and t["interrupted"] == "interrupted", t
    assert "The rest of the speech was dropped" in t["interrupted_page"]["message"]
    assert t["stopped"] == "ended" and t["stopped_page"]["start_enabled"], t["stopped_page"]
    said = t["bad_gateway"]
    assert "the server answered 502 Bad Gateway" in said and "wait a moment" in said, said
    assert t["bad_gateway_page"]["state"] == "error"
    assert "charengine_sessions_started_total 1.0" in metrics_after
    assert "charengine_sessions_finished_total 1.0" in metrics_after  # the page's Stop


def test_the_microphone_streams_and_a_server_that_vanishes_is_told(netns, tmp_path):
    server, url = serve_in(netns, build_target(tmp_path), 8768)
    try:
        client = subprocess.Popen(in_ns(netns, sys.executable,
                                        str(ROOT / "tests/browser_client.py"), "--url", url,
                                        "--image", str(ROOT / "assets/face.png"), "--mic",
                                        "--seconds", "4", "--wait-error", "30",
                                        "--shot", str(tmp_path / "mic.png")),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert client.stdout.readline().strip() == "STREAMING", client.stderr.read()
        server.kill()  # the server goes away mid-session, without a word
        out, err = client.communicate(timeout=120)
        assert client.returncode == 0, out + err
    finally:
        end_server(server)
    stats = json.loads(out.strip().splitlines()[-1])
    assert _fps(stats) > 0, stats
    _audio_flows(stats)
    numbers = stats["page"]["numbers"]
    assert _value(numbers, "playback") > 0, numbers
    assert 0 < _value(numbers, "latency"), numbers  # the microphone's speech to its frames
    said = stats["error"]
    assert "The connection to the server was lost" in said and "Press Start" in said, said
    assert stats["after_error"]["state"] == "error" and stats["after_error"]["start_enabled"]


def test_a_session_nothing_is_said_to_ends_after_the_idle_timeout(netns, tmp_path):
    """--idle-timeout 4: a client that sends no speech streams its character listening,
    then gets {"type": "ended"} with why, its connection closed; the log says why and the
    server takes the next session."""
    server, url = serve_in(netns, build_target(tmp_path), 8773, "--idle-timeout", "4")
    try:
        r = subprocess.run(in_ns(netns, sys.executable, str(ROOT / "tests/webrtc_client.py"),
                                 "--url", url, "--seconds", "60"),
                           capture_output=True, text=True, timeout=120)
        status = json.loads(_get(netns, url + "status"))
    finally:
        out = end_server(server)
    said = [json.loads(ln) for ln in r.stdout.splitlines()]
    kinds = [s["kind"] for s in said]
    assert "streaming" in kinds and "timeout" not in kinds, said
    events = [s["event"] for s in said if s["kind"] == "event"]
    assert events[-1]["type"] == "ended", events
    assert events[-1]["why"] == "nothing was said for 4 s", events
    assert "speaking" not in [e.get("state") for e in events], events
    assert status["state"] == "ready" and status["active"] == 0, status
    number = 1  # the server's log names a session by its number, from 1
    assert f"session {number}: nothing was said for 4 s; ended" in out, out


def test_a_rank_that_dies_mid_session_is_told_to_the_page_and_the_next_session_runs(
        netns, tmp_path):
    import psutil

    server, url = serve_in(netns, build_target(tmp_path, "cpu-tiny-tp2"), 8766)
    try:
        client = subprocess.Popen(in_ns(netns, sys.executable,
                                        str(ROOT / "tests/browser_client.py"), "--url", url,
                                        "--image", str(ROOT / "assets/face.png"),
                                        "--speech", str(ROOT / "assets/speech.wav"),
                                        "--seconds", "0", "--wait-error", "40",
                                        "--shot", str(tmp_path / "e.png")),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert client.stdout.readline().strip() == "STREAMING", client.stderr.read()
        ranks = [p for p in psutil.Process(server.pid).children(recursive=True)
                 if "multiprocessing" in " ".join(p.cmdline())]
        assert ranks, "no rank processes"
        ranks[-1].kill()
        out, err = client.communicate(timeout=120)
        assert client.returncode == 0, out + err
        result = json.loads(out.strip().splitlines()[-1])
        said = result["error"]
        assert "The session stopped" in said and "died" in said and "Press Start" in said
        assert result["after_error"]["state"] == "error"
        assert result["after_error"]["start_enabled"], result["after_error"]
        _client(netns, url, "--image", str(ROOT / "assets/face.png"), "--speech",
                str(ROOT / "assets/speech.wav"), "--seconds", "2",
                "--shot", str(tmp_path / "again.png"))  # fresh ranks: video flows again
    finally:
        out = end_server(server)
    assert "Traceback" not in out, out


def test_the_page_streams_livetalk_at_16fps_to_chromium(netns, tmp_path):
    server, url = serve_in(netns, build_target(tmp_path, "cpu-tiny-livetalk"), 8767)
    try:
        stats = _client(netns, url, "--image", str(ROOT / "assets/face.png"), "--speech",
                        str(ROOT / "assets/speech.wav"), "--seconds", "4",
                        "--shot", str(tmp_path / "page.png"))
        status = json.loads(_get(netns, url + "status"))
    finally:
        out = end_server(server)
    assert "Traceback" not in out, out
    assert _fps(stats) > 0, stats
    assert stats["last"]["video"]["frameWidth"] == 64
    _audio_flows(stats)
    assert status["model"] == "tiny-livetalk" and status["fps"] == 16
    page = stats["page"]
    assert page["engine"]["family"] == "livetalk" and page["engine"]["fps"] == "16 fps"
    assert page["engine"]["unit"] == "chunks of 12 frames", page["engine"]
    assert page["step_label"] == "Chunk time"
    numbers = page["numbers"]
    # the playback rate of the 16 fps target (how near it is the machine's: a loaded one plays
    # slower; never faster, as the frames are paced)
    assert "of 16" in numbers["playback"]["text"], numbers
    assert 0 < _value(numbers, "playback") <= 19, numbers
    assert _value(numbers, "generation") > 0 and _value(numbers, "step", "p50") > 0, numbers
    assert page["chart"]["budget_label"] == "real-time budget 750 ms", page["chart"]


def test_no_page_the_user_visits_can_take_the_server_over(netns, tmp_path):
    """A session streams to a client; meanwhile Chromium opens pages of other origins and a
    page whose name is re-pointed at the server (tests/hostile_page.py). Every request they
    make that would change state or read the server is refused by the server (403 for a
    host it does not serve or a page it does not know, 415 for a body that is not JSON) or
    stopped by the browser (a preflight the server never grants, a frame of the page the
    server forbids); the session streams on, the only one started."""
    server, url = serve_in(netns, build_target(tmp_path), 8770, "--health-port", "8771")
    victim = subprocess.Popen(in_ns(netns, sys.executable, str(ROOT / "tests/webrtc_client.py"),
                                    "--url", url, "--seconds", "120"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        said = next((json.loads(ln) for ln in iter(victim.stdout.readline, "")
                     if json.loads(ln)["kind"] in ("streaming", "refused")), None)
        assert said and said["kind"] == "streaming", said
        r = subprocess.run(in_ns(netns, sys.executable, str(ROOT / "tests/hostile_page.py"),
                                 "--url", url, "--health", "8771", "--chromium", CHROMIUM),
                           capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        attacks = json.loads(r.stdout.strip().splitlines()[-1])
        status = json.loads(_get(netns, url + "status"))
        assert victim.poll() is None  # still connected
    finally:
        victim.terminate()
        victim.communicate(timeout=30)
        out = end_server(server)
    assert status["state"] == "streaming" and status["sessions"] == 1, status
    answered = attacks["server"]
    assert answered, attacks
    for request, codes in answered.items():
        assert all(c in (403, 405, 415) for c in codes), (request, codes)
    for name in ("cross_site", "framing", "rebound", "rebound_probes"):
        for what, got in attacks["page"][name].items():
            assert got.startswith(("blocked", "opaque", "read 403", "read 405", "read 415")), \
                (name, what, got)
    rebound = attacks["page"]["rebound"]
    assert "--allow-host evil.example" in rebound["GET /status"], rebound
    assert "refused POST /stop" in out and "Traceback" not in out, out
