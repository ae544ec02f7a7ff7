"""charrun --serve as a client meets it, over real HTTP on loopback: every error is JSON with
a 4xx status, uploads are decoded off the event loop (so /metrics answers meanwhile), an
offer whose client never connects frees the server, and SIGTERM ends the server and every
rank of a TP engine within 2 s with exit 0. /status names the engine, the page's files are
served, an upload's error names its file; the live numbers the page is pushed and /metrics
come from one object, and a live session reports its states and its speech's latency."""

import asyncio
import base64
import io
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import psutil
import pytest
from PIL import Image

from engines import build_target
from procs import still_running

pytestmark = pytest.mark.slow
CHARRUN = [sys.executable, "-m", "charengine.runtime.cli"]


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


class Served:
    def __init__(self, engine, *flags):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.p = subprocess.Popen(CHARRUN + ["--engine", str(engine), "--serve", "--port",
                                             str(self.port), "--health-port", str(free_port()),
                                             *flags],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env={**__import__("os").environ, "PYTHONUNBUFFERED": "1"})
        self.lines = []
        threading.Thread(target=lambda: self.lines.extend(iter(self.p.stdout.readline, "")),
                         daemon=True).start()
        end = time.monotonic() + 120
        while not any("serving on" in ln for ln in self.lines):
            assert self.p.poll() is None, "".join(self.lines)
            assert time.monotonic() < end, "".join(self.lines)
            time.sleep(0.1)

    def request(self, path, body: bytes | None = None, timeout=60):
        req = urllib.request.Request(self.url + path, data=body, method="POST" if body is not
                                     None else "GET",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.headers.get("Content-Type", ""), r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("Content-Type", ""), e.read()

    def stop(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            self.p.wait(30)
        return "".join(self.lines)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    d = tmp_path_factory.mktemp("eng")
    return build_target(d), build_target(d, "cpu-tiny-tp2")


@pytest.fixture(scope="module")
def server(engines):
    s = Served(engines[0])
    yield s
    out = s.stop()
    assert "Traceback" not in out, out


def error_of(status, ctype, body):
    assert "application/json" in ctype, (status, ctype, body[:200])
    return json.loads(body)["error"]


@pytest.mark.parametrize("body,says", [
    (b"{not json", "not JSON"),
    (b"[1, 2]", "needs 'sdp'"),
    (json.dumps({"sdp": 5, "type": "offer"}).encode(), "needs 'sdp'"),
    (json.dumps({"sdp": "v=0", "type": "offer"}).encode(), "could not be negotiated"),
    (json.dumps({"sdp": "v=0", "type": "offer", "image": "http://x"}).encode(),
     "image: expected a data: URL"),
    (json.dumps({"sdp": "v=0", "type": "offer",
                 "image": "data:image/png;base64," + base64.b64encode(b"GIF89a no").decode()}
                ).encode(), "not an image"),
])
def test_a_malformed_offer_gets_a_json_400(server, body, says):
    status, ctype, data = server.request("/offer", body)
    assert status == 400 and says in error_of(status, ctype, data)


def test_an_oversized_upload_gets_a_json_413(server):
    status, ctype, data = server.request("/offer", b"x" * (65 * 1024 * 1024))
    assert status == 413 and "too large" in error_of(status, ctype, data)


def test_unknown_routes_and_methods_get_json(server):
    status, ctype, data = server.request("/nope")
    assert status == 404 and error_of(status, ctype, data)
    status, ctype, data = server.request("/interrupt", b"{}")
    assert status == 409 and "no session" in error_of(status, ctype, data)


def test_metrics_answer_while_a_large_image_is_decoded(server):
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    pixels = (rng.integers(0, 4, (6000, 6000, 3), dtype=np.uint8) * 60)  # 36 MP, ~30 MB
    Image.fromarray(pixels).save(buf, "PNG", compress_level=1)
    body = json.dumps({"sdp": "v=0 not an sdp", "type": "offer", "image":
                       "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()})
    result = {}
    t = threading.Thread(target=lambda: result.update(r=server.request("/offer", body.encode())))
    t.start()
    time.sleep(0.3)
    waits = []
    while t.is_alive():
        t0 = time.monotonic()
        status, _, _ = server.request("/metrics", timeout=10)
        waits.append(time.monotonic() - t0)
        assert status == 200
        time.sleep(0.05)
    t.join()
    assert waits and max(waits) < 1.0, waits
    assert result["r"][0] == 400  # the SDP, read after the image


def aiortc_offer() -> dict:
    from aiortc import RTCPeerConnection

    async def make():
        pc = RTCPeerConnection()
        pc.addTransceiver("video", direction="recvonly")
        pc.addTransceiver("audio", direction="recvonly")
        await pc.setLocalDescription(await pc.createOffer())
        offer = {"sdp": pc.localDescription.sdp, "type": "offer"}
        await pc.close()
        return offer

    return asyncio.run(make())


def test_an_offer_whose_client_never_connects_frees_the_server_within_15_s(server):
    offer = aiortc_offer()
    status, _, data = server.request("/offer", json.dumps(offer).encode())
    assert status == 200, data
    t0 = time.monotonic()
    status, ctype, data = server.request("/offer", json.dumps(offer).encode())
    assert status == 409 and "busy" in error_of(status, ctype, data)
    while json.loads(server.request("/status")[2])["state"] != "ready":
        assert time.monotonic() - t0 < 15
        time.sleep(0.2)


def test_sigterm_ends_a_tp_server_and_its_ranks_within_2_s(engines):
    s = Served(engines[1])
    tree = psutil.Process(s.p.pid).children(recursive=True)
    assert len(tree) >= 2  # the two TP ranks
    t0 = time.monotonic()
    s.p.send_signal(signal.SIGTERM)
    code = s.p.wait(30)
    exited = time.monotonic() - t0
    alive = still_running(tree, timeout=2.0 - exited)
    assert exited < 2.0 and not alive, (exited, alive)
    assert code == 0
    out = s.stop()
    assert "Traceback" not in out, out


def test_status_names_the_engine_and_the_page_files_are_served(server):
    status, _, data = server.request("/status")
    engine = json.loads(data)["engine"]
    assert status == 200 and engine == {
        "family": "characters", "preset": "tiny", "target": "cpu-tiny", "device": "cpu",
        "gpu": None, "tp": 1, "fps": 24, "width": 64, "height": 64, "frames_per_step": 4,
        "unit": "step", "budget_s": 4 / 24, "slack": 2, "sample_rate": 16000}
    status, _, page = server.request("/")
    assert status == 200 and b'src="/static/page.js"' in page
    for path, ctype in (("/static/page.js", "javascript"), ("/static/page.css", "text/css")):
        status, got, body = server.request(path)
        assert status == 200 and ctype in got and len(body) > 1000, (path, got)
    status, ctype, data = server.request("/static/nope.js")
    assert status == 404 and error_of(status, ctype, data)


def test_an_upload_error_names_the_file_as_the_page_chose_it(server):
    body = json.dumps({"sdp": "v=0", "type": "offer", "image_name": "holiday.txt",
                       "image": "data:image/png;base64," + base64.b64encode(b"hi").decode()})
    status, ctype, data = server.request("/offer", body.encode())
    said = error_of(status, ctype, data)
    assert status == 400 and said.startswith('the image "holiday.txt": not an image'), said
    assert "BytesIO" not in said, said


def metric(text: str, name: str) -> float:
    return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith(name + " ")))


def test_the_live_numbers_and_metrics_come_from_one_object():
    from charengine.runtime.metrics import Metrics

    now = [100.0]
    m = Metrics(target_fps=24, clock=lambda: now[0])
    m.session_started()
    for k in range(240):  # ten seconds at 24 fps, a step of four frames every 1/6 s
        t = 90.0 + k / 24
        now[0] = t
        if k % 4 == 0:
            m.step_done(0.05 if k % 8 else 0.1, 4)
        m.frame(t + (0.004 if k % 2 else 0.0), t)
    m.stall(0.08)
    m.speech_latency(0.4)
    m.queued(1, 6)
    live = m.live()
    assert live["playback_fps"] == pytest.approx(24, rel=1e-2)
    assert live["generation_fps"] == pytest.approx(4 / 0.075)  # frames per diffusion second
    assert live["realtime_factor"] == pytest.approx(4 / 0.075 / 24)
    assert live["step_s"]["0.5"] == pytest.approx(0.075) and live["step_s"]["0.9"] == 0.1
    assert len(live["steps"]) == 60 and live["steps"][-1][0] == pytest.approx(1 / 24 * 3)
    assert live["drift_s"]["1.0"] == pytest.approx(0.004)
    assert (live["stalls"], live["stall_s"], live["queued_steps"], live["queued_frames"]) == \
        (1, 0.08, 1, 6)
    text = m.exposition().decode()
    assert metric(text, 'charengine_live_step_seconds{quantile="0.5"}') == live["step_s"]["0.5"]
    assert metric(text, "charengine_live_playback_fps") == pytest.approx(live["playback_fps"])
    assert metric(text, 'charengine_live_speech_latency_seconds{quantile="0.5"}') == 0.4
    assert metric(text, "charengine_stalls_total") == 1.0
    assert metric(text, "charengine_queued_frames") == 6.0
    assert metric(text, "charengine_step_seconds_count") == 60.0
    now[0] += 61.0  # a minute on: the window holds nothing, the totals stay
    later = m.live()
    assert later["steps"] == [] and later["playback_fps"] is None and later["stalls"] == 1


def test_a_live_session_reports_its_states_and_the_latency_of_its_speech(engines):
    import torch

    from charengine.runtime.engine import Engine
    from charengine.runtime.live import LiveSession, wait_until
    from charengine.runtime.metrics import Metrics
    from charengine.runtime.worker import Worker

    worker, m, states = Worker(Engine.load(engines[0])), Metrics(), []
    s = LiveSession(worker, lambda *a: None, metrics=m, on_state=states.append)
    s.start(torch.rand(3, 64, 64))
    assert wait_until(lambda: "listening" in states, 20), states
    said = time.monotonic()
    s.say(torch.randn(16000 * 2) * 0.1)
    assert wait_until(lambda: m.live()["latency_s"]["last"] is not None, 20), states
    heard = time.monotonic()
    assert 0 < m.live()["latency_s"]["last"] <= heard - said, m.live()
    assert states[:2] == ["listening", "speaking"], states
    s.interrupt()
    assert wait_until(lambda: s.state == "interrupted", 1)
    time.sleep(0.5)
    assert s.state == "interrupted"  # silence after a barge-in stays "interrupted"
    s.stop()
    assert states[-2:] == ["interrupted", "ended"] and m.live()["frames_played"] > 8, states
