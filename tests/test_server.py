"""charrun --serve as a client meets it, over real HTTP on loopback: every error is JSON with
a 4xx status, uploads are decoded off the event loop (so /metrics answers meanwhile), an
offer whose client never connects frees the server, and SIGTERM ends the server and every
rank of a TP engine within 2 s with exit 0. /status names the engine, the page's files are
served, an upload's error names its file; the live numbers the page is pushed and /metrics
come from one object, and a live session reports its states and its speech's latency."""

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

from charengine.runtime.formats import MAX_SHOWN
from engines import build_target
from offers import answer_of, offer_sdp, page_offer, slow_upload, wav_data_url
from procs import still_running

pytestmark = pytest.mark.slow
CHARRUN = [sys.executable, "-m", "charengine.runtime.cli"]


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


class Served:
    def __init__(self, engine, *flags):
        self.port, self.health_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.p = subprocess.Popen(CHARRUN + ["--engine", str(engine), "--serve", "--port",
                                             str(self.port), "--health-port",
                                             str(self.health_port), *flags],
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

    def request(self, path, body: bytes | None = None, timeout=60, headers=None, port=None):
        url = f"http://127.0.0.1:{port}" if port else self.url
        req = urllib.request.Request(url + path, data=body, method="POST" if body is not
                                     None else "GET",
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
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
    (json.dumps({"sdp": "v=0\r\n" + "a=x\r\n" * 20_000, "type": "offer"}).encode(),
     "the offer's SDP is 100,005 bytes; at most 65,536"),
    (json.dumps({"sdp": "v=0\r\n" + "m=audio 9 UDP/TLS/RTP/SAVPF 0\r\n" * 9,
                 "type": "offer"}).encode(), "has 9 media sections; at most 8"),
])
def test_a_malformed_offer_gets_a_json_400(server, body, says):
    status, ctype, data = server.request("/offer", body)
    assert status == 400 and says in error_of(status, ctype, data)


def test_an_offer_that_bundles_not_every_section_gets_a_400(server):
    """Every section of an offer must arrive on one transport (the client's traffic is
    counted on it): a section left out of the BUNDLE group, or no group, is refused before a
    session starts."""
    sdp = offer_sdp("video", "audio", direction="recvonly", events=True)
    assert "a=group:BUNDLE 0 1 2\r\n" in sdp
    for group, says in (("a=group:BUNDLE 0 1\r\n", "('2')"), ("", "('0 1 2')")):
        body = {"type": "offer", "sdp": sdp.replace("a=group:BUNDLE 0 1 2\r\n", group)}
        status, ctype, data = server.request("/offer", json.dumps(body).encode())
        assert status == 400, data
        assert f"leaves media sections out of its BUNDLE group {says}" in error_of(
            status, ctype, data)
    assert json.loads(server.request("/status")[2])["state"] == "ready"


def test_an_oversized_upload_gets_a_json_413(server):
    status, ctype, data = server.request("/offer", b"x" * (65 * 1024 * 1024))
    assert status == 413 and "too large" in error_of(status, ctype, data)


def test_unknown_routes_and_methods_get_json(server):
    status, ctype, data = server.request("/nope")
    assert status == 404 and error_of(status, ctype, data)
    status, ctype, data = server.request("/interrupt", b"{}")
    assert status == 400 and "name the session" in error_of(status, ctype, data)
    status, ctype, data = server.request("/stop", json.dumps({"session": "x" * 22}).encode())
    assert status == 404 and "no such session" in error_of(status, ctype, data)


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
    time.sleep(0.3)  # the body is sent; the image is being decoded
    answered = 0
    while t.is_alive():
        status, _, _ = server.request("/metrics", timeout=60)
        assert status == 200
        answered += t.is_alive()  # answered while the offer was still being read
        time.sleep(0.05)
    t.join()
    # an event loop held by the decode would answer none meanwhile; a slower machine (a
    # longer decode) answers more
    assert answered >= 3, answered
    assert result["r"][0] == 400  # the SDP, read after the image


def test_an_offer_whose_client_never_connects_frees_the_server(server):
    offer = page_offer()
    status, _, data = server.request("/offer", offer)
    assert status == 200, data
    status, ctype, data = server.request("/offer", offer)
    assert status == 503 and "full: 1 session in progress" in error_of(status, ctype, data)
    number = json.loads(server.request("/status")[2])["sessions"]
    wait_for(lambda: json.loads(server.request("/status")[2])["state"] == "ready", 60)
    assert wait_for(lambda: f"session {number}: the client did not connect within" in
                    "".join(server.lines), 10), "".join(server.lines)


def test_every_response_forbids_framing_and_type_guessing(server):
    """The page, its files, the JSON and an error alike carry access.PAGE_HEADERS (what
    Chromium makes of them: test_serve)."""
    from charengine.runtime.access import PAGE_HEADERS

    for path, status in (("/", 200), ("/static/page.js", 200), ("/status", 200),
                         ("/no-such-page", 404)):
        try:
            r = urllib.request.urlopen(server.url + path, timeout=30)
        except urllib.error.HTTPError as e:
            r = e
        assert r.status == status, (path, r.status)
        assert {k: r.headers.get(k) for k in PAGE_HEADERS} == PAGE_HEADERS, (path, r.headers)


def test_the_answer_takes_no_video_in_and_one_microphone(server):
    """An offer to send on every section (video and two audio): the answer sends the
    character's video and takes none in (a client's video would be decoded into frames
    nothing reads), takes the microphone on the voice's section and nothing on the other."""
    sdp = offer_sdp("video", "audio", "audio", direction="sendrecv")
    status, _, data = server.request("/offer", json.dumps({"type": "offer", "sdp": sdp}).encode())
    assert status == 200, data
    answer = json.loads(data)
    kinds, directions = [], []
    for line in answer["sdp"].splitlines():
        if line.startswith("m="):
            kinds.append(line[2:].split()[0])
        elif line[2:] in ("sendrecv", "sendonly", "recvonly", "inactive"):
            directions.append(line[2:])
    assert list(zip(kinds, directions)) == [("video", "sendonly"), ("audio", "sendrecv"),
                                            ("audio", "inactive")], answer["sdp"]
    status, _, data = server.request("/stop", json.dumps({"session": answer["session"]}).encode())
    assert status == 200, data
    wait_for(lambda: json.loads(server.request("/status")[2])["state"] == "ready", 60)


def wait_for(pred, most_s: float, poll_s: float = 0.1) -> bool:
    """Poll pred() until it holds (at most `most_s`, a guard against a hang, not a bound
    the test checks): whether it held."""
    end = time.monotonic() + most_s
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(poll_s)
    return True


# ---- who may use the server (runtime/access.py) --------------------------------------

def test_a_request_naming_another_host_is_refused_on_both_ports(server):
    """DNS rebinding: a page at evil.example re-pointed at 127.0.0.1 names evil.example in
    Host; neither the page's port nor the probe port answers it, and nothing changes."""
    evil = {"Host": f"evil.example:{server.port}"}
    for path in ("/", "/status", "/metrics", "/static/page.js", "/readyz"):
        status, ctype, data = server.request(path, headers=evil)
        assert status == 403 and "--allow-host evil.example" in error_of(status, ctype, data)
    for path in ("/healthz", "/readyz", "/metrics"):
        status, ctype, data = server.request(path, headers=evil, port=server.health_port)
        assert status == 403 and "--allow-host" in error_of(status, ctype, data), path
    status, ctype, data = server.request("/offer", page_offer(),
                                         headers=evil)
    assert status == 403
    for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}"):
        assert server.request("/status", headers={"Host": host})[0] == 200
    assert server.request("/metrics", port=server.health_port)[0] == 200  # monitoring
    assert json.loads(server.request("/status")[2])["state"] == "ready"


def test_a_post_must_be_json_from_the_pages_own_origin_or_no_page(server):
    offer = json.dumps({"sdp": "v=0", "type": "offer"}).encode()
    for origin in ("http://evil.example", "null", f"http://localhost:{server.port}",
                   f"https://127.0.0.1:{server.port}"):
        status, ctype, data = server.request("/offer", offer, headers={"Origin": origin})
        assert status == 403 and "--allow-origin" in error_of(status, ctype, data), origin
    for path in ("/stop", "/interrupt"):
        status, _, _ = server.request(path, b"{}", headers={"Origin": "http://evil.example"})
        assert status == 403
    status, ctype, data = server.request("/offer", offer, headers={"Content-Type": "text/plain"})
    assert status == 415 and "application/json" in error_of(status, ctype, data)
    own = {"Origin": f"http://127.0.0.1:{server.port}"}
    status, ctype, data = server.request("/offer", offer, headers=own)
    assert status == 400 and "could not be negotiated" in error_of(status, ctype, data)


@pytest.mark.parametrize("fields,says", [
    ({"fit": ["cover"]}, "'fit' must be a string"),
    ({"background": {"r": 1}}, "'background' must be a string"),
    ({"background": "#zz"}, "background '#zz': not a colour"),
    ({"background": "x" * 100_000}, "background of 100,000 characters: not a colour"),
    ({"fit": "x" * 100_000}, "fit of 100,000 characters: one of cover"),
    ({"prompt": 5}, "'prompt' must be a string"),
    ({"prompt": "a" * 10_001}, "'prompt' is 10,001 characters long; at most 10,000 are taken"),
    ({"speech": "data:audio/wav;base64,"}, "the file is empty"),
    ({"image": "data:image/png;base64,"}, "the file is empty"),
    ({"speech": wav_data_url(1, 50_000)}, "declares a sample rate of 1 Hz"),
    ({"speech": wav_data_url(8000, 8000 * 601)}, "declares 601 s of speech; at most 600"),
])
def test_a_malformed_field_gets_a_400_naming_it(server, fields, says):
    body = json.dumps({"sdp": "v=0", "type": "offer", **fields}).encode()
    status, ctype, data = server.request("/offer", body)
    assert status == 400 and says in error_of(status, ctype, data), error_of(status, ctype, data)


def test_json_nested_past_the_parsers_depth_gets_a_400(server):
    status, ctype, data = server.request("/offer", b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and "nested too deeply" in error_of(status, ctype, data)


def test_control_requests_act_only_on_the_session_they_name(server):
    status, _, data = server.request("/offer", page_offer())
    assert status == 200, data
    token = json.loads(data)["session"]
    assert len(token) >= 22 and not token.isdigit()
    for path in ("/interrupt", "/stop"):
        for wrong in (token[::-1], "\u00e9" * len(token)):  # non-ASCII: compared as bytes
            status, ctype, data = server.request(path, json.dumps({"session": wrong}).encode())
            assert status == 404 and "no such session" in error_of(status, ctype, data)
        status, ctype, data = server.request(path, b"{}")
        assert status == 400
    assert json.loads(server.request("/status")[2])["state"] == "streaming"
    assert server.request("/interrupt", json.dumps({"session": token}).encode())[0] == 200
    status, ctype, data = server.request("/interrupt", json.dumps(
        {"session": token, "in_flight": "later"}).encode())
    assert status == 400 and "'in_flight'" in error_of(status, ctype, data)
    assert server.request("/interrupt", json.dumps(
        {"session": token, "in_flight": "drop"}).encode())[0] == 200
    assert server.request("/stop", json.dumps({"session": token}).encode())[0] == 200
    assert json.loads(server.request("/status")[2])["state"] == "ready"
    status, _, data = server.request("/offer", page_offer())
    second = json.loads(data)["session"]
    assert status == 200 and second != token
    assert server.request("/stop", json.dumps({"session": token}).encode())[0] == 404
    assert server.request("/stop", json.dumps({"session": second}).encode())[0] == 200


@pytest.mark.parametrize("declared,admitted", [(1 << 20, 4), (60 << 20, 2)])
def test_uploads_in_flight_are_capped_in_number_and_bytes(server, declared, admitted):
    """Offers whose bodies are still arriving hold the gate; past four at once, or 128 MB
    declared between them, the next offer gets 503 with Retry-After before it is read."""
    inflight = lambda: json.loads(server.request("/status")[2])["uploads_in_flight"]  # noqa
    held = []
    try:
        for k in range(admitted):
            held.append(slow_upload(server.port, declared))
            assert wait_for(lambda: inflight() == k + 1, 30), inflight()
        with slow_upload(server.port, declared) as s:  # answered before its body is read
            head, body = answer_of(s)
        assert head.startswith("HTTP/1.1 503") and "\r\nRetry-After: 2\r\n" in head, head
        assert "other uploads" in json.loads(body)["error"]
    finally:
        for s in held:
            s.close()
    assert wait_for(lambda: inflight() == 0, 30), inflight()
    status, _, _ = server.request("/offer", json.dumps({"sdp": "v=0", "type": "offer"}).encode())
    assert status == 400  # read again once the others are gone


def test_sigterm_ends_a_tp_server_and_its_ranks(engines):
    s = Served(engines[1])
    tree = psutil.Process(s.p.pid).children(recursive=True)
    assert len(tree) >= 2  # the two TP ranks
    s.p.send_signal(signal.SIGTERM)
    code = s.p.wait(30)
    alive = still_running(tree, timeout=10.0)
    assert not alive, alive
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
    long = "x" * 5000 + ".txt"  # a long name is shown cut
    body = json.dumps({"sdp": "v=0", "type": "offer", "image_name": long,
                       "image": "data:image/png;base64," + base64.b64encode(b"hi").decode()})
    said = error_of(*server.request("/offer", body.encode()))
    assert said.startswith(f'the image "{long[:MAX_SHOWN]}...": not an image'), said


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
    played = m.live()["frames_played"]
    assert wait_until(lambda: m.live()["frames_played"] >= played + 8, 60)  # two steps more
    assert s.state == "interrupted"  # silence after a barge-in stays "interrupted"
    s.stop()
    assert states[-2:] == ["interrupted", "ended"], states


def test_a_client_is_owed_its_first_report_only_once_video_has_gone_out():
    """The peer watchdog: a connected client that has had no video yet sends no receiver
    report and is not freed for it (a loaded server's first frames take seconds); once video
    has gone out, a client silent for peer_silent_s is."""
    import asyncio
    from types import SimpleNamespace

    from charengine.runtime.server import PEER_POLL_S, Served, Server

    silent_s, unsent_polls = 1.0, 8  # four seconds with no video: past silent_s four times
    polls, closed = [0], []

    async def get_stats():
        polls[0] += 1
        sent = polls[0] > unsent_polls
        return {"t": SimpleNamespace(type="transport", bytesReceived=0, packetsReceived=0),
                "v": SimpleNamespace(type="outbound-rtp", kind="video",
                                     packetsSent=10 if sent else 0)}

    served = Served("t", 1, 0, None, SimpleNamespace(connectionState="connected",
                                                     getStats=get_stats))

    async def close(only):
        closed.append(polls[0])
        this.live.clear()

    this = SimpleNamespace(live={0: served}, peer_silent_s=silent_s, close=close)
    this._active = lambda s: this.live.get(0) is s
    asyncio.run(Server._peer_watchdog(this, served))
    assert len(closed) == 1, (closed, polls)
    assert closed[0] >= unsent_polls + silent_s / PEER_POLL_S, (closed, polls)


def test_a_barge_in_that_drops_the_speech_in_flight_drops_it_up_to_the_first_silence():
    """/interrupt with "in_flight": "drop": the microphone's frames still arriving loud are
    dropped; from its first silent frame on, everything is heard again; and a client that
    sends no silence is heard again once the cap's worth is dropped."""
    import asyncio
    from types import SimpleNamespace

    import av
    import numpy as np

    from charengine.runtime.server import Served, Server

    rate = 16000

    def frame(level: float, pts: int):
        pcm = np.full((1, 320), int(level * 32767), np.int16)
        f = av.AudioFrame.from_ndarray(pcm, format="s16", layout="mono")
        f.sample_rate, f.pts = rate, pts
        return f

    def heard_of(levels, hush):
        frames = [frame(v, i * 320) for i, v in enumerate(levels)]

        class Track:
            async def recv(self):
                if not frames:
                    raise RuntimeError("ended")
                return frames.pop(0)

        heard = []
        served = Served("t", 1, 0, SimpleNamespace(
            say=lambda x: heard.append(round(float(x.abs().max()), 2))), None, hush=hush)
        this = SimpleNamespace(worker=SimpleNamespace(spec=SimpleNamespace(
            side=SimpleNamespace(sample_rate=rate))))
        asyncio.run(Server._microphone(this, Track(), served))
        return heard, served.hush

    assert heard_of([0.5, 0.5, 0.0, 0.5, 0.25], rate) == ([0.0, 0.5, 0.25], 0)
    # no silence comes: the frames that begin within the cap's 700 samples are dropped (three
    # of 320), then it is heard
    assert heard_of([0.5, 0.5, 0.5, 0.25, 0.5], 700) == ([0.25, 0.5], 0)


def test_the_events_channel_is_the_sessions_once_it_says_the_id_of_any_characters():
    """An events channel's hello naming another id (non-ASCII, a lone surrogate, not a
    string, too long) leaves the channel without the session's events and raises nothing
    into the peer connection; the session's own id makes it the session's."""
    from types import SimpleNamespace

    from charengine.runtime.server import MAX_CHANNEL_MESSAGE, Served, Server

    token = "Zm9vYmFyYmF6cXV4cXV1eA"
    served, channel = Served(token, 1, 0, None, None), SimpleNamespace(label="events")
    hello = lambda session: json.dumps({"type": "hello", "session": session})  # noqa: E731
    for said in (hello("\u00e9" * len(token)), hello("\ud800"), hello(token[::-1]), hello(7),
                 hello(token) + " " * MAX_CHANNEL_MESSAGE, "[" * 100_000, b"\xff", "{}"):
        Server._channel_said(SimpleNamespace(), served, channel, said)
        assert served.events is None, said[:40]
    Server._channel_said(SimpleNamespace(), served, channel, hello(token))
    assert served.events is channel


def test_a_control_request_past_4_kb_or_without_its_length_is_refused_unread(server):
    import http.client

    from charengine.runtime.server import MAX_CONTROL_BYTES

    long = json.dumps({"session": "x" * MAX_CONTROL_BYTES}).encode()
    for path in ("/interrupt", "/stop"):
        status, ctype, data = server.request(path, long)
        assert status == 413 and f"at most {MAX_CONTROL_BYTES:,}" in error_of(status, ctype,
                                                                              data)
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        try:
            conn.request("POST", path, body=iter([b'{"session": "x"}']), encode_chunked=True,
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            status, ctype, data = r.status, r.headers.get("Content-Type", ""), r.read()
        finally:
            conn.close()
        assert status == 411 and "Content-Length" in error_of(status, ctype, data)
    status, ctype, data = server.request("/stop", json.dumps({"session": "x" * 22}).encode())
    assert status == 404  # a body within the bound is read as before
