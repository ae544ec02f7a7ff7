"""charrun's probes and SIGTERM's drain, as an orchestrator meets them: the real charrun --serve
and --livekit as processes, /healthz and /readyz polled over real HTTP through a whole start
(loading, then ready), a session (busy), SIGTERM mid-session (draining, the session left to
run within --grace-period and then ended with the peer told, exit 0, every rank process
gone), a TP rank that dies while idle (its ranks started afresh), and a port that cannot be
had. The --livekit worker registers with a stand-in of LiveKit's worker service (its real
protocol, over a WebSocket on loopback: no LiveKit server can run here); the avatar's end of
a job runs against the loopback rooms of tests/livekit_loopback.py."""

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest

from charengine.runtime.lifecycle import END_RESERVE_S
from engines import ROOT, build_target
from netns import can_netns, namespace
from offers import page_offer
from procs import still_running

pytestmark = pytest.mark.slow
CHARRUN = [sys.executable, "-m", "charengine.runtime.cli"]
GRACE_S = 6.0  # the tests' --grace-period
SESSION_AFTER_SIGTERM_S = GRACE_S - min(END_RESERVE_S, GRACE_S / 2)  # as lifecycle.Drain has it
REPORT_S = 0.5  # between a streaming client's frame counts


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def http(url: str, body: bytes | None = None, timeout: float = 10):
    """(status, parsed JSON or text), or (None, why) where nothing answers."""
    req = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, ctype, data = r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        status, ctype, data = e.code, e.headers.get("Content-Type", ""), e.read()
    except OSError as e:
        return None, str(e)
    return status, json.loads(data) if "json" in ctype else data.decode()


class Charrun:
    """charrun as a subprocess, its output collected; `probes` is its probe server's URL."""

    def __init__(self, *flags, env=None, wrap=()):
        self.health_port = free_port()
        self.probes = f"http://127.0.0.1:{self.health_port}"
        self.p = subprocess.Popen([*wrap, *CHARRUN, *flags, "--health-port",
                                   str(self.health_port), "--grace-period", f"{GRACE_S:g}"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env={**(env or os.environ), "PYTHONUNBUFFERED": "1"})
        self.t0 = time.monotonic()
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(iter(self.p.stdout.readline, "")),
                         daemon=True).start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def probe(self, path: str):
        return http(self.probes + path, timeout=5)

    def watch_start(self, until: str = "ready", timeout: float = 120.0) -> list[tuple]:
        """Poll /healthz and /readyz from the first moment until /readyz says `until`:
        [(seconds since the start, /healthz status, /readyz status, /readyz body)]."""
        seen = []
        while True:
            assert self.p.poll() is None, self.output
            assert time.monotonic() - self.t0 < timeout, (seen, self.output)
            # /readyz first: once it answers the port listens, so /healthz answers too (the
            # other way round, the port could open between the two and /healthz read None)
            status, body = self.probe("/readyz")
            health, _ = self.probe("/healthz")
            if health is not None or status is not None:
                seen.append((time.monotonic() - self.t0, health, status, body))
                if isinstance(body, dict) and body.get("state") == until:
                    return seen
            time.sleep(0.05)

    def sigterm(self, timeout: float = 30.0) -> tuple[int, float]:
        """SIGTERM; the exit status and how long the exit took."""
        t = time.monotonic()
        self.p.send_signal(signal.SIGTERM)
        code = self.p.wait(timeout)
        return code, time.monotonic() - t

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)


def states(seen) -> list[str]:
    """The /readyz states seen, each once, in order."""
    out = []
    for *_, body in seen:
        s = body.get("state") if isinstance(body, dict) else None
        if s and (not out or out[-1] != s):
            out.append(s)
    return out


def rank_processes(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children(recursive=True)
            if "spawn_main" in " ".join(p.cmdline())]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    d = tmp_path_factory.mktemp("eng")
    return {"tiny": build_target(d), "tp2": build_target(d, "cpu-tiny-tp2")}


def test_serve_probes_through_a_start_a_session_and_a_sigterm_that_drains_it(engines):
    """A TP engine: /healthz answers while the engine loads and /readyz says loading, then
    ready; an answered offer makes it busy (on the probe port and the page alike); SIGTERM
    makes it draining at once, new offers get a JSON 503, the session goes on until shortly
    before the grace period ends, then charrun exits 0 with both rank processes gone."""
    port = free_port()
    page = f"http://127.0.0.1:{port}"
    c = Charrun("--engine", str(engines["tp2"]), "--serve", "--port", str(port))
    try:
        seen = c.watch_start()
        assert states(seen) == ["loading", "ready"], seen
        loading = [s for s in seen if s[3].get("state") == "loading"]
        assert all(h == 200 and r == 503 for _, h, r, _ in loading), loading
        assert {s[3].get("detail") for s in loading} & {
            "loading the weights, warm-up and graph capture", "loading the runtime (torch)",
            "checking the engine"}, loading
        assert seen[-1][2] == 200 and seen[-1][3]["engine"] == "cpu-tiny-tp2"
        status, metrics = c.probe("/metrics")
        assert status == 200 and "charengine_sessions_started_total 0.0" in metrics
        assert http(page + "/readyz")[0] == 200  # the page's app answers the probes too
        status, body = c.probe("/nope")
        assert status == 404 and "/healthz" in body["error"]
        ranks = rank_processes(c.p.pid)
        assert len(ranks) == 2
        tree = psutil.Process(c.p.pid).children(recursive=True)

        status, answer = http(page + "/offer", page_offer())
        assert status == 200, answer
        status, body = c.probe("/readyz")
        assert status == 503 and body["state"] == "busy", body
        assert http(page + "/readyz")[1]["state"] == "busy"
        assert "charengine_sessions_started_total 1.0" in c.probe("/metrics")[1]

        t = time.monotonic()
        c.p.send_signal(signal.SIGTERM)
        drained, refused = [], None
        while c.p.poll() is None and time.monotonic() - t < GRACE_S + 5:
            status, body = c.probe("/readyz")
            if status is not None:
                drained.append((time.monotonic() - t, status, body.get("state")))
            if refused is None and drained and drained[-1][2] == "draining":
                refused = http(page + "/offer", page_offer())
            time.sleep(0.05)
        code, exited = c.p.wait(5), time.monotonic() - t
        # draining as soon as the signal is handled, and from then on
        first = next(i for i, (_, _, s) in enumerate(drained) if s == "draining")
        assert all(s == "busy" for _, _, s in drained[:first])
        assert all(st == 503 and s == "draining" for _, st, s in drained[first:]), drained
        assert refused[0] == 503 and "stopping" in refused[1]["error"], refused
        # the session was left to run (the client never connected: nothing else ends it
        # sooner than the connect timeout), then ended within the grace period
        # (exit 0: within the grace period, else charrun gives up with 1)
        assert SESSION_AFTER_SIGTERM_S - 0.3 <= exited, (exited, c.output)
        assert code == 0, c.output
        alive = still_running(tree, timeout=1.0)
        assert not alive, alive
        assert "Traceback" not in c.output, c.output
        assert "ending the session in progress" in c.output
    finally:
        c.kill()


def test_a_tp_rank_that_dies_while_idle_is_started_afresh_and_the_worker_reads_ready(engines):
    """A rank killed while idle: from the moment its process has exited, /readyz reads
    loading; an offer then waits for the ranks started afresh and its session runs on them
    (none reaches the dead group); the log names the rank; the worker reads ready again."""
    port = free_port()
    c = Charrun("--engine", str(engines["tp2"]), "--serve", "--port", str(port))
    try:
        c.watch_start()
        old = rank_processes(c.p.pid)
        old[-1].kill()
        old[-1].wait(10)  # reaped by charrun or not, the process has exited
        status, body = c.probe("/readyz")
        assert status == 503 and body["state"] == "loading", body
        assert "rank" in body["detail"], body
        status, said = http(f"http://127.0.0.1:{port}/offer", page_offer(), timeout=60)
        assert status == 200, said
        new = rank_processes(c.p.pid)  # the session's ranks: a fresh group
        assert len(new) == 2 and not {p.pid for p in new} & {p.pid for p in old}
        c.watch_start(until="ready", timeout=60)  # once the never-connecting client is freed
        assert "died (exit -9); starting the TP ranks afresh" in c.output, c.output
        assert c.sigterm()[0] == 0, c.output
        assert "Traceback" not in c.output, c.output
    finally:
        c.kill()


def test_a_drain_that_cannot_end_gives_up_at_the_grace_period(engines):
    """A TP rank that hangs (stopped) mid-session: the session cannot end, so at the grace
    period charrun says so in one line and exits 1, and the live ranks leave with it."""
    port = free_port()
    c = Charrun("--engine", str(engines["tp2"]), "--serve", "--port", str(port))
    ranks = []
    try:
        c.watch_start()
        ranks = rank_processes(c.p.pid)
        assert http(f"http://127.0.0.1:{port}/offer", page_offer())[0] == 200
        time.sleep(0.5)
        ranks[0].suspend()
        code, took = c.sigterm()
        assert code == 1 and GRACE_S - 0.5 < took, (code, took, c.output)
        assert f"the drain did not end within --grace-period {GRACE_S:g} s" in c.output
        assert "Traceback" not in c.output, c.output
        alive = still_running(ranks[1:], timeout=2.0)
        assert not alive, alive
    finally:
        for r in ranks:
            if r.is_running():
                r.kill()
        c.kill()


def test_sigterm_while_the_engine_loads_exits_0_without_serving(engines):
    """Nothing is in progress to drain: the load stops (once torch's import, which a signal
    must not cut, is done), the ranks with it, well within the grace period."""
    c = Charrun("--engine", str(engines["tp2"]), "--serve", "--port", str(free_port()))
    try:
        seen = c.watch_start(until="loading")
        code, took = c.sigterm()
        assert code == 0, (code, took, c.output)  # 0: within the grace period
        assert "stopped by SIGTERM while the engine loaded" in c.output
        assert "Traceback" not in c.output and "serving on" not in c.output, c.output
        assert seen[-1][1] == 200
    finally:
        c.kill()


def test_a_probe_port_in_use_is_refused_before_the_engine_loads(engines):
    with socket.create_server(("127.0.0.1", 0)) as s:
        held = s.getsockname()[1]
        r = subprocess.run(CHARRUN + ["--engine", str(engines["tiny"]), "--serve", "--port",
                                      str(free_port()), "--health-port", str(held)],
                           capture_output=True, text=True, timeout=60)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert f"--health-port {held}: cannot listen on 127.0.0.1:{held}" in lines[0]
    assert "serving on" not in r.stdout and "Traceback" not in r.stderr
    port = free_port()
    r = subprocess.run(CHARRUN + ["--engine", str(engines["tiny"]), "--serve", "--port",
                                  str(port), "--health-port", str(port)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--health-port" in r.stderr and "Traceback" not in r.stderr


# ---- mid-session, with a connected peer (inside a network namespace of the test's own) ----

@pytest.fixture
def netns():
    """The command prefix that runs inside a network namespace of the test's own."""
    if not can_netns():
        pytest.skip("needs root and iproute2 (network namespaces) for a WebRTC peer")
    with namespace("charpr", "10.233.1") as name:
        yield ["ip", "netns", "exec", name]


@pytest.mark.parametrize("engine", ["tiny", "tp2"])
def test_sigterm_mid_session_keeps_streaming_then_tells_the_peer_and_exits_0(
        engines, netns, engine):
    """A WebRTC peer streaming: SIGTERM sends it {"type": "draining"} with the time left,
    the stream goes on for that time, then {"type": "ended"} and the connection closes;
    /readyz read busy, then draining; charrun exits 0 within the grace period."""
    c = Charrun("--engine", str(engines[engine]), "--serve", "--port", "8080", wrap=netns)
    try:
        while not any("serving on" in ln for ln in c.lines):
            assert c.p.poll() is None and time.monotonic() - c.t0 < 120, c.output
            time.sleep(0.1)
        client = subprocess.Popen(
            [*netns, sys.executable, str(ROOT / "tests/webrtc_client.py"), "--url",
             "http://127.0.0.1:8080/", "--readyz", f"{c.probes}/readyz", "--image",
             str(ROOT / "assets/face.png"), "--seconds", "60", "--report", str(REPORT_S)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        said, t_term = [], None
        for line in client.stdout:
            said.append(json.loads(line))
            if said[-1]["kind"] == "streaming":
                t_term = time.monotonic()
                c.p.send_signal(signal.SIGTERM)
        client.wait(30)
        code = c.p.wait(30)
        exited = time.monotonic() - t_term
    finally:
        c.kill()
    assert t_term is not None, (said, client.stderr.read(), c.output)
    events = [s for s in said if s["kind"] == "event"]
    draining = [e for e in events if e["event"]["type"] == "draining"]
    ended = [e for e in events if e["event"]["type"] == "ended"]
    assert len(draining) == 1 and len(ended) == 1, events
    assert draining[0]["event"]["ends_in_s"] == pytest.approx(SESSION_AFTER_SIGTERM_S, abs=0.3)
    assert "stopping" in draining[0]["event"]["message"]
    # the session went on streaming after SIGTERM for the time left: frames kept arriving in
    # its first half and in its second (how many a second is this machine's)
    assert ended[0]["t"] - draining[0]["t"] >= SESSION_AFTER_SIGTERM_S - 0.3
    middle = (draining[0]["t"] + ended[0]["t"]) / 2
    by_middle = max(s["frames"] for s in said if "frames" in s and s["t"] <= middle)
    assert draining[0]["frames"] < by_middle < ended[0]["frames"], (draining, said, ended)
    closed = [s for s in said if s["kind"] == "connection" and s["state"] == "closed"]
    assert closed and closed[0]["t"] >= ended[0]["t"], said
    ready = [s["state"] for s in said if s["kind"] == "readyz"]
    assert ready[:2] == ["busy", "draining"], ready
    assert code == 0, (code, exited, c.output)  # 0: within the grace period
    assert "Traceback" not in c.output, c.output


# ---- --livekit ------------------------------------------------------------------------------

class LiveKitWorkerService:
    """The worker service of a LiveKit server, as far as a worker meets it: a WebSocket at
    /agent speaking LiveKit's agent protocol (livekit.protocol.agent). It registers the
    worker, records what the worker says (status, load, job updates), offers it a job when
    asked and assigns it on acceptance; /rtc accepts the job's room connection and holds it
    (no media server runs here), so the job stays in progress until the worker ends it."""

    def __init__(self):
        from aiohttp import web

        self.web = web
        self.messages: list = []
        self.ws = None
        self.registered = asyncio.Event()
        self.refusing = False  # connections refused (503) while set: the service is down
        self.registrations: list[float] = []
        self.port = free_port()
        self.url = f"ws://127.0.0.1:{self.port}"

    async def start(self):
        app = self.web.Application()
        app.router.add_get("/agent", self._agent)
        app.router.add_get("/rtc", self._room)
        self.runner = self.web.AppRunner(app)
        await self.runner.setup()
        await self.listen()

    async def listen(self):
        self.site = self.web.TCPSite(self.runner, "127.0.0.1", self.port)
        await self.site.start()

    async def vanish(self):
        """The service stops accepting connections while the worker's stays open, silent:
        as a server that is gone without closing it (a host that died, a network cut)."""
        await self.site.stop()

    async def stop(self):
        await self.runner.cleanup()

    async def _agent(self, request):
        from aiohttp import WSMsgType
        from livekit.protocol import agent, models

        if self.refusing:
            return self.web.Response(status=503, text="down")
        ws = self.web.WebSocketResponse()
        await ws.prepare(request)
        self.ws = ws
        async for msg in ws:
            if msg.type != WSMsgType.BINARY:
                continue
            m = agent.WorkerMessage()
            m.ParseFromString(msg.data)
            which = m.WhichOneof("message")
            self.messages.append((time.monotonic(), which, getattr(m, which)))
            if which == "register":
                await ws.send_bytes(agent.ServerMessage(register=agent.RegisterWorkerResponse(
                    worker_id="W-test", server_info=models.ServerInfo())).SerializeToString())
                self.t_registered = time.monotonic()
                self.registrations.append(self.t_registered)
                self.registered.set()
            elif which == "availability" and m.availability.available:
                await ws.send_bytes(agent.ServerMessage(assignment=agent.JobAssignment(
                    job=self.job, url=self.url, token="room-token")).SerializeToString())
        return ws

    async def _room(self, request):
        ws = self.web.WebSocketResponse()
        await ws.prepare(request)
        async for _ in ws:
            pass
        return ws

    def charrun(self, engine) -> "Charrun":
        """charrun --livekit on `engine`, pointed at this service."""
        env = {**os.environ, "LIVEKIT_URL": self.url, "LIVEKIT_API_KEY": "key",
               "LIVEKIT_API_SECRET": "s" * 32}
        return Charrun("--engine", str(engine), "--livekit", env=env)

    async def drop(self) -> None:
        """The service goes down: the worker's connection is closed, new ones refused."""
        self.refusing = True
        await self.ws.close()

    async def offer_job(self, job_id: str):
        from livekit.protocol import agent, models

        self.job = agent.Job(id=job_id, room=models.Room(name="room-1", sid="RM_1"),
                             type=agent.JobType.JT_ROOM, agent_name="charengine-avatar",
                             metadata=json.dumps({"identity": "charengine-avatar"}))
        await self.ws.send_bytes(agent.ServerMessage(availability=agent.AvailabilityRequest(
            job=self.job)).SerializeToString())

    def said(self, which: str) -> list:
        return [(t, m) for t, w, m in self.messages if w == which]


@contextlib.asynccontextmanager
async def livekit_charrun(engine):
    """A LiveKitWorkerService and charrun --livekit pointed at it, both stopped on leaving."""
    lk = LiveKitWorkerService()
    await lk.start()
    c = lk.charrun(engine)
    try:
        yield lk, c
    finally:
        c.kill()
        await lk.stop()


def test_livekit_worker_probes_registration_a_job_and_a_sigterm_that_drains_it(engines):
    """charrun --livekit: loading until LiveKit has registered the worker, then ready; busy
    (and load 1.0, full, to LiveKit) with a job; SIGTERM: draining, LiveKit told the worker
    is full, the job left to run, then ended (its status success), exit 0 within the grace
    period."""
    pytest.importorskip("livekit.agents")
    from livekit.protocol import agent

    async def scenario():
        async with livekit_charrun(engines["tiny"]) as (lk, c):
            loop = asyncio.get_running_loop()
            seen = await loop.run_in_executor(None, c.watch_start)
            assert lk.registered.is_set()
            await lk.offer_job("J-1")
            busy = await loop.run_in_executor(None, lambda: c.watch_start(until="busy"))
            await asyncio.sleep(1.0)
            t_term = time.monotonic()
            c.p.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            draining = c.probe("/readyz")
            code = await loop.run_in_executor(None, c.p.wait, 30)
            return seen, busy, draining, code, time.monotonic() - t_term, t_term, lk, c

    seen, busy, draining, code, exited, t_term, lk, c = asyncio.run(scenario())
    order = states(seen)
    assert order[0] == "loading" and order[-1] == "ready", seen
    first_ready = next(c.t0 + t for t, _, _, body in seen if body.get("state") == "ready")
    assert lk.t_registered <= first_ready  # ready only once LiveKit has registered it
    assert busy[-1][2] == 503
    assert draining[0] == 503 and draining[1]["state"] == "draining", draining
    assert code == 0, (code, exited, c.output)  # 0: within the grace period
    assert exited >= SESSION_AFTER_SIGTERM_S - 0.3, exited  # the job was left to run
    accepted = [m for _, m in lk.said("availability") if m.available]
    assert accepted and accepted[0].job_id == "J-1"
    full = [m for t, m in lk.said("update_worker")
            if t >= t_term and m.status == agent.WorkerStatus.WS_FULL]
    assert full, lk.messages  # LiveKit dispatches no more jobs here
    jobs = [m.status for _, m in lk.said("update_job") if m.job_id == "J-1"]
    assert jobs[-1] == agent.JobStatus.JS_SUCCESS, jobs
    assert "Traceback" not in c.output, c.output


def test_a_dropped_livekit_connection_reads_loading_until_the_worker_registers_again(engines):
    """The LiveKit service goes down after registering the worker: /readyz reads loading
    (LiveKit can dispatch nothing meanwhile), saying why, while the worker keeps trying; once
    the service is back the worker registers again and reads ready."""
    pytest.importorskip("livekit.agents")

    async def scenario():
        async with livekit_charrun(engines["tiny"]) as (lk, c):
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, c.watch_start)
            await lk.drop()
            down = await loop.run_in_executor(None, lambda: c.watch_start(until="loading"))
            await asyncio.sleep(1.0)
            still = c.probe("/readyz")
            lk.refusing = False
            back = await loop.run_in_executor(None, c.watch_start)
            code, _ = await loop.run_in_executor(None, c.sigterm)
            return down, still, back, code, lk, c

    down, still, back, code, lk, c = asyncio.run(scenario())
    assert down[-1][2] == 503 and "dropped: reconnecting" in down[-1][3]["detail"], down
    assert still[0] == 503 and still[1]["state"] == "loading", still  # not ready while down
    assert back[-1][2] == 200 and len(lk.registrations) == 2, (back, lk.registrations)
    assert code == 0 and "Traceback" not in c.output, c.output


def test_a_livekit_server_gone_without_closing_the_connection_reads_loading(engines):
    """The service stops answering new connections while the worker's WebSocket stays open
    (nothing tells the worker; its heartbeat would notice in a minute): /readyz reads
    loading, naming the server that cannot be reached, and ready once it is back."""
    pytest.importorskip("livekit.agents")

    async def scenario():
        async with livekit_charrun(engines["tiny"]) as (lk, c):
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, c.watch_start)
            await lk.vanish()
            down = await loop.run_in_executor(None, lambda: c.watch_start(until="loading",
                                                                          timeout=60))
            await lk.listen()
            back = await loop.run_in_executor(None, lambda: c.watch_start(timeout=60))
            code, _ = await loop.run_in_executor(None, c.sigterm)
            return down, back, code, lk, c

    down, back, code, lk, c = asyncio.run(scenario())
    assert down[-1][2] == 503 and "cannot be reached" in down[-1][3]["detail"], down[-1]
    assert back[-1][2] == 200 and len(lk.registrations) == 1, (back[-1], lk.registrations)
    assert code == 0 and "Traceback" not in c.output, c.output


def test_the_avatar_job_that_a_drain_ends_tells_the_agent_its_turn_was_interrupted(engines):
    """The end of a job that the drain asks for, in the avatar's room (loopback rooms): a turn
    still playing is reported to the agent as interrupted, at the position played, and the
    job ends at once."""
    pytest.importorskip("livekit.agents")
    import numpy as np
    from livekit import rtc
    from livekit.agents.voice.avatar import DataStreamAudioOutput

    from charengine.runtime.engine import Engine
    from charengine.runtime.livekit_avatar import serve_room
    from charengine.runtime.metrics import Metrics
    from charengine.runtime.worker import Worker
    from livekit_loopback import pair

    worker = Worker(Engine.load(engines["tiny"]))
    metrics = Metrics(target_fps=worker.spec.fps)
    rate = 24000

    async def played(frames: int) -> None:  # until `frames` more frames have played
        end = metrics.live()["frames_played"] + frames
        while metrics.live()["frames_played"] < end:
            await asyncio.sleep(0.02)

    async def scenario():
        agent_room, avatar_room = pair()
        stop = asyncio.Event()
        job = asyncio.ensure_future(serve_room(avatar_room, worker, {"sender": "agent"},
                                               metrics=metrics, stop=stop))
        out = DataStreamAudioOutput(agent_room, destination_identity="charengine-avatar",
                                    sample_rate=rate)
        finished = []
        out.on("playback_finished", finished.append)
        while not avatar_room.local_participant.published:  # the avatar is in the room
            await asyncio.sleep(0.05)
        t = np.arange(5 * rate) / rate
        pcm = (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype(np.int16)
        n = rate // 100
        for i in range(0, pcm.size, n):
            await out.capture_frame(rtc.AudioFrame(pcm[i: i + n].tobytes(), rate, 1, n))
        while metrics.live()["latency_s"]["last"] is None:  # the turn's first voice played
            await asyncio.sleep(0.02)
        await played(round(1.5 * worker.spec.fps))  # a second and a half of the 5 s turn
        stop.set()
        await asyncio.wait_for(job, 30)
        return finished

    finished = asyncio.run(scenario())
    assert len(finished) == 1 and finished[0].interrupted, finished
    assert 0.5 < finished[0].playback_position < 5.0, finished  # where it was cut


def test_idle_connections_hold_no_more_than_the_cap_and_are_closed():
    """Connections that say nothing to the probe port: those past the cap are closed as
    they come, those within it once idle_s has passed; the threads they held are gone and
    /healthz answers again."""
    from charengine.runtime.probes import ProbeServer, Readiness

    def serving() -> int:  # the probe server's connection threads
        return sum(t.name.endswith("(process_request_thread)") for t in threading.enumerate())

    cap, port = 4, free_port()
    probes = ProbeServer(Readiness(), "127.0.0.1", port, idle_s=5.0, max_connections=cap)
    probes.start()
    try:
        idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(3 * cap)]
        most, end = 0, time.monotonic() + 2
        while time.monotonic() < end:
            most = max(most, serving())
            time.sleep(0.01)
        assert most == cap, most
        assert all(c.recv(1) == b"" for c in idle)  # every one closed by the server
        for c in idle:
            c.close()
        end = time.monotonic() + 30
        while serving() and time.monotonic() < end:
            time.sleep(0.05)
        assert serving() == 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=30) as r:
            assert r.status == 200
    finally:
        probes.stop()
