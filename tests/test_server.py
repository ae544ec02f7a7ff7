"""charrun --serve as a client meets it, over real HTTP on loopback: every error is JSON with
a 4xx status, uploads are decoded off the event loop (so /metrics answers meanwhile), an
offer whose client never connects frees the server, and SIGTERM ends the server and every
rank of a TP engine within 2 s with exit 0."""

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
                                             str(self.port), *flags],
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
    _, alive = psutil.wait_procs(tree, timeout=max(0.0, 2.0 - exited))
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert exited < 2.0 and not alive, (exited, alive)
    assert code == 0
    out = s.stop()
    assert "Traceback" not in out, out
