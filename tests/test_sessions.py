"""charrun --serve --sessions N with real WebRTC peers (aiortc) in a network namespace of the
test's own, on the tiny engines of both families and a TP-2 engine (its sessions through the
same rank processes): three sessions stream at once from one process and one copy of the
engine (on LiveTalk's also with --batch 3: steps that wait together run as one batch); the
fourth offer is answered 503 with Retry-After and /readyz reads busy; a
session's id acts on that session only; stopping one, a barge-in on another and a client that
vanishes leave the others streaming, and each frees its place; a session's objects are freed
soon after it ends."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from PIL import Image

from charengine.runtime.engine import Engine
from engines import build_target
from netns import can_netns, namespace

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
CHARRUN = [sys.executable, "-m", "charengine.runtime.cli"]
PAGE, PROBES = "http://127.0.0.1:8080", "http://127.0.0.1:8081"

# an HTTP request from inside the namespace: prints [status, headers, body]
REQUEST = """
import json, sys, urllib.error, urllib.request
url, body = sys.argv[1], sys.argv[2]
req = urllib.request.Request(url, data=body.encode() if body else None,
                             headers={"Content-Type": "application/json"})
def body(raw):
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode()
try:
    with urllib.request.urlopen(req, timeout=30) as r:
        out = [r.status, dict(r.headers), body(r.read())]
except urllib.error.HTTPError as e:
    out = [e.code, dict(e.headers), body(e.read())]
print(json.dumps(out))
"""


@pytest.fixture
def netns():
    if not can_netns():
        pytest.skip("needs root and iproute2 (network namespaces) for WebRTC peers")
    with namespace("charss", "10.233.4") as name:
        yield ["ip", "netns", "exec", name]


def request(netns, url: str, body: dict | None = None):
    r = subprocess.run([*netns, sys.executable, "-c", REQUEST, url,
                        json.dumps(body) if body is not None else ""],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


class Client:
    """tests/webrtc_client.py in the namespace, its lines collected as they come."""

    def __init__(self, netns, image: Path, seconds: float):
        self.p = subprocess.Popen(
            [*netns, sys.executable, str(ROOT / "tests/webrtc_client.py"), "--url",
             PAGE + "/", "--image", str(image), "--seconds", str(seconds), "--report", "0.5"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.said: list[dict] = []
        threading.Thread(target=lambda: self.said.extend(
            json.loads(ln) for ln in iter(self.p.stdout.readline, "")), daemon=True).start()

    def first(self, kind: str):
        return next((s for s in self.said if s["kind"] == kind), None)

    def frames(self) -> int:
        counts = [s["frames"] for s in self.said if "frames" in s]
        return max(counts, default=0)


def wait(pred, most_s: float) -> bool:
    end = time.monotonic() + most_s
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize("target,batch", [("cpu-tiny", 1), ("cpu-tiny-livetalk", 1),
                                          ("cpu-tiny-livetalk", 3), ("cpu-tiny-tp2", 1)])
def test_three_sessions_stream_at_once_and_the_fourth_is_told_to_retry(netns, tmp_path, target,
                                                                      batch):
    engine = build_target(tmp_path, target)
    images = []
    for i, color in enumerate(((200, 40, 40), (40, 200, 40), (40, 40, 200))):
        images.append(tmp_path / f"face{i}.png")
        Image.new("RGB", (64, 64), color).save(images[-1])
    server = subprocess.Popen([*netns, *CHARRUN, "--engine", str(engine), "--serve", "--port",
                               "8080", "--health-port", "8081", "--sessions", "3",
                               "--batch", str(batch), "--over-capacity"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(server.stdout.readline, "")),
                     daemon=True).start()
    clients = []
    try:
        assert wait(lambda: any("serving on" in ln for ln in lines), 120), "".join(lines)
        status, _, ready = request(netns, PROBES + "/readyz")
        assert status == 200 and ready["state"] == "ready", ready
        clients = [Client(netns, image, 600) for image in images]  # killed at the end
        assert wait(lambda: all(c.first("streaming") for c in clients), 240), \
            ([c.said for c in clients], "".join(lines))
        status, _, body = request(netns, PAGE + "/status")
        assert (body["active"], body["capacity"]) == (3, 3), body
        # the fourth: refused before its body is read, told when to come back
        status, headers, body = request(netns, PAGE + "/offer", {"sdp": "v=0", "type": "offer"})
        assert status == 503 and "full: 3 sessions" in body["error"], body
        assert int(headers["Retry-After"]) > 0
        status, _, ready = request(netns, PROBES + "/readyz")
        assert status == 503 and ready["state"] == "busy", ready
        # each session's own figures, labelled with its number, beside the worker's load
        _, _, text = request(netns, PROBES + "/metrics")
        lines = text.splitlines()
        assert "charengine_sessions_active 3.0" in lines and \
            "charengine_sessions_capacity 3.0" in lines, text
        steps = [float(ln.split()[-1]) for ln in lines
                 if ln.startswith("charengine_device_steps_total ")]
        assert steps and steps[0] >= 3, text  # every session's steps, batched or alone
        played = [ln for ln in lines if ln.startswith("charengine_session_playback_fps{")]
        assert sorted(ln.split('"')[1] for ln in played) == ["1", "2", "3"], text
        assert all(float(ln.split()[-1]) > 0 for ln in played), played
        # one session's id stops that session only
        ids = [c.first("answered")["session"] for c in clients]
        assert len(set(ids)) == 3
        status, _, body = request(netns, PAGE + "/stop", {"session": ids[0][::-1]})
        assert status == 404, body
        before = [c.frames() for c in clients]
        status, _, body = request(netns, PAGE + "/stop", {"session": ids[0]})
        assert status == 200, body
        assert wait(lambda: clients[0].first("connection") and any(
            s["kind"] == "connection" and s["state"] == "closed" for s in clients[0].said), 30)
        fps = Engine.load(engine).config.model.fps
        assert wait(lambda: all(c.frames() >= b + 2 * fps
                                for c, b in zip(clients[1:], before[1:])), 60), \
            [c.frames() for c in clients]
        status, _, body = request(netns, PAGE + "/status")
        assert (body["active"], body["capacity"]) == (2, 3), body
        status, _, ready = request(netns, PROBES + "/readyz")
        assert status == 200 and ready["state"] == "ready", ready
        status, _, body = request(netns, PAGE + "/interrupt", {"session": ids[0]})
        assert status == 404, body  # an ended session's id acts on nothing
        # a barge-in on one session, and a client that vanishes: the other streams on
        status, _, body = request(netns, PAGE + "/interrupt", {"session": ids[1]})
        assert status == 200, body
        clients[1].p.kill()  # no goodbye: the server hears no more receiver reports
        before = clients[2].frames()
        assert wait(lambda: request(netns, PAGE + "/status")[2]["active"] == 1, 30)
        assert wait(lambda: clients[2].frames() >= before + 2 * fps, 60), clients[2].frames()
        assert clients[2].first("connection") and not any(
            s["kind"] == "connection" and s["state"] in ("closed", "failed")
            for s in clients[2].said), clients[2].said
    finally:
        for c in clients:
            c.p.kill()
        server.terminate()
        server.wait(30)
    assert "Traceback" not in "".join(lines), "".join(lines)


def test_a_sessions_objects_are_freed_soon_after_it_ends(netns, tmp_path):
    """A session's peer connection, live session and served record are held in reference
    cycles (the WebRTC library's and the pipeline's): the server collects them after each
    session, with its video encoder's threads and buffers, ended by /stop or by its client
    closing. Before, they stayed until the collector's rare full pass (run
    tests/session_release.py with --no-collect: none freed within 10 s), and sessions one
    after another piled up encoders and their threads (docs/RELIABILITY.md)."""
    engine = build_target(tmp_path, "cpu-tiny-livetalk")
    r = subprocess.run([*netns, sys.executable, str(ROOT / "tests/session_release.py"),
                        str(engine)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    freed = json.loads(r.stdout.splitlines()[-1])
    assert set(freed) == {"stop", "client-closes"}, freed
    for ending, objects in freed.items():
        assert all(s is not None for s in objects.values()), (ending, objects)
