"""charrun --serve: a local page that streams the character over WebRTC (aiohttp + aiortc).

The page (static/: plain HTML, CSS and a script) sends an SDP offer with the reference
image, optional speech and prompt (or asks for the microphone); the worker answers, starts a
live session and streams video and audio paced from one clock. One session at a time. No
ICE server is used unless given: aiortc's default would be a public STUN server.

Routes: GET / (the page), GET /static/* (its style and script), POST /offer, POST /interrupt,
POST /stop, GET /status (the state and the engine: family, preset, target, fps, frames per
step), GET /metrics. Every error is JSON, {"error": sentence}, with a 4xx status for what
the request got wrong and 5xx for what the server did. Uploads are decoded off the event
loop, so /metrics and the rest answer while an image is read.

The session talks to the page over a data channel named "events" that the page opens:
{"type": "stats", "state": ..., live numbers...} every STATS_PERIOD_S (Metrics.live(): the
numbers /metrics has, from the same object), {"type": "state", "state": ...} when the state
changes (runtime/live.py STATES), {"type": "error", "message": ...} when a rank dies or the
session fails, {"type": "draining", ...} when a stop gives the session a deadline, and
{"type": "ended"}. An offer whose client never connects frees the server
after CONNECT_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import re
import signal
import time
from importlib import resources
from pathlib import Path

import av
import numpy as np
import torch
from aiohttp import web
from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription

from .formats import ImageFit, MediaError
from .images import load_image
from .live import LiveSession
from .media import read_audio
from .metrics import Metrics
from .webrtc import PacedOutput
from .worker import Worker

log = logging.getLogger("charengine.server")

MAX_UPLOAD_BYTES = 64 * 1024 * 1024  # the whole offer: image and speech as data URLs
CONNECT_TIMEOUT_S = 10.0  # an answered offer whose peer has not connected by then is freed
STATS_PERIOD_S = 1.0  # how often the live numbers are pushed to the page
ERROR_FLUSH_S = 0.2  # lets an error message leave before the peer closes
MAX_NAME_CHARS = 80  # an uploaded file's name, as messages quote it
STATIC = "static"  # the page's files, package data of charengine.runtime


class ServeError(RuntimeError):
    pass


class BadRequest(ValueError):
    pass


def _data_url_bytes(url, what: str) -> bytes | None:
    if not url:
        return None
    if not isinstance(url, str) or not url.startswith("data:") or "," not in url:
        raise BadRequest(f"{what}: expected a data: URL")
    try:
        return base64.b64decode(url.split(",", 1)[1], validate=False)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{what}: the data URL is not valid base64") from None


def _upload_error(e: MediaError, what: str, name) -> BadRequest:
    """A reader's message about an upload, naming the file as the page chose it."""
    text = re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-f]+>", "", str(e))
    text = text.removeprefix("upload: ")
    if isinstance(name, str) and name.strip():
        what = f'{what} "{name.strip()[:MAX_NAME_CHARS]}"'
    return BadRequest(f"{what}: {text}")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


@web.middleware
async def json_errors(request, handler):
    """Every error as {"error": sentence}: aiohttp's own (404, 405, 413 ...) included."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        if e.status == 413:
            return _error(413, f"the upload is too large: at most "
                               f"{MAX_UPLOAD_BYTES // (1024 * 1024)} MB in all")
        return _error(e.status, e.reason or "request failed")
    except (BadRequest, MediaError) as e:
        return _error(400, str(e))
    except Exception as e:  # noqa: BLE001 - the page shows a sentence, the log the cause
        log.error("%s %s failed: %s: %s", request.method, request.path, type(e).__name__, e)
        return _error(500, f"the server failed ({type(e).__name__}: {e})")


def engine_info(worker: Worker, slack: int) -> dict:
    """What the page says is loaded: family, preset, target, device, frame size, fps, frames
    per step (a step that denoises several latent frames together is a chunk) and the step's
    real-time budget."""
    spec, target = worker.spec, worker.target
    frames = spec.frames_per_latent
    return {"family": spec.FAMILY, "preset": spec.name, "target": target.name,
            "device": target.device, "gpu": target.gpu, "tp": worker.cfg.tp,
            "fps": spec.fps, "width": spec.out_w, "height": spec.out_h,
            "frames_per_step": frames,
            "unit": "chunk" if getattr(spec, "chunk_frames", 1) > 1 else "step",
            "budget_s": frames / spec.fps, "slack": slack,
            "sample_rate": spec.side.sample_rate}


class Server:
    def __init__(self, worker: Worker, metrics: Metrics, ice_servers: list[str] = (),
                 slack: int = 2, image_fit: ImageFit = ImageFit(),
                 connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 stats_period_s: float = STATS_PERIOD_S):
        self.worker, self.metrics, self.slack = worker, metrics, slack
        self.image_fit, self.connect_timeout_s = image_fit, connect_timeout_s
        self.stats_period_s = stats_period_s
        self.ice = [RTCIceServer(urls=u) for u in ice_servers]
        self.session: LiveSession | None = None
        self.pc: RTCPeerConnection | None = None
        self.events = None  # the page's "events" data channel
        self.stats_task: asyncio.Task | None = None
        self.lock = asyncio.Lock()
        self.sessions = 0
        self.last_error: str | None = None
        self.info = engine_info(worker, slack)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_UPLOAD_BYTES, middlewares=[json_errors])
        app.router.add_get("/", self.index)
        app.router.add_get("/static/{name}", self.static)
        app.router.add_post("/offer", self.offer)
        app.router.add_post("/interrupt", self.interrupt)
        app.router.add_post("/stop", self.stop)
        app.router.add_get("/status", self.status)
        app.router.add_get("/metrics", self.metrics_page)
        app.on_shutdown.append(lambda _: self.close())
        return app

    @staticmethod
    def static_dir() -> Path:
        return Path(str(resources.files("charengine.runtime").joinpath(STATIC)))

    async def static(self, request):
        """The page's own files, by name (nothing else under static/ is reached)."""
        path = self.static_dir() / request.match_info["name"]
        if path.name != request.match_info["name"] or not path.is_file():
            raise web.HTTPNotFound(reason=f"no such file: /static/{request.match_info['name']}")
        return web.FileResponse(path)

    async def index(self, request):
        page = (self.static_dir() / "index.html").read_text()
        return web.Response(text=page, content_type="text/html")

    async def metrics_page(self, request):
        return web.Response(body=self.metrics.exposition(),
                            headers={"Content-Type": "text/plain; version=0.0.4"})

    async def status(self, request):
        spec = self.worker.spec
        return web.json_response({"state": "streaming" if self.session else "ready",
                                  "session_state": self.session.state if self.session else None,
                                  "sessions": self.sessions, "last_error": self.last_error,
                                  "model": spec.name, "family": spec.FAMILY, "fps": spec.fps,
                                  "engine": self.info, "max_upload_bytes": MAX_UPLOAD_BYTES})

    def _read_media(self, body: dict):
        """The offer's image and speech, decoded (on an executor thread)."""
        spec = self.worker.spec
        fit = self.image_fit
        if body.get("fit") is not None or body.get("background") is not None:
            fit = ImageFit(body.get("fit") or fit.policy, body.get("background") or fit.background)
        notes = []
        if body.get("image"):
            try:
                picture = load_image(_data_url_bytes(body["image"], "image"), spec.out_h,
                                     spec.out_w, fit)
            except MediaError as e:
                raise _upload_error(e, "the image", body.get("image_name")) from None
            image = picture.pixels
            notes.append(f"image: {picture.describe()}")
        else:
            image = torch.full((3, spec.out_h, spec.out_w), 0.5)
        speech_bytes = _data_url_bytes(body.get("speech"), "speech")
        if speech_bytes:
            warnings: list[str] = []
            try:
                speech = read_audio(speech_bytes, spec.side.sample_rate, warn=warnings.append)
            except MediaError as e:
                raise _upload_error(e, "the speech", body.get("speech_name")) from None
            notes.append(f"speech: {speech.numel() / spec.side.sample_rate:.1f} s at "
                         f"{spec.side.sample_rate // 1000} kHz mono" +
                         "".join(f"; {w.removeprefix('upload: ')}" for w in warnings))
        else:
            speech = None
        return image, speech, notes

    async def offer(self, request):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadRequest("the offer is not JSON") from None
        if not isinstance(body, dict) or not isinstance(body.get("sdp"), str) \
                or body.get("type") != "offer":
            raise BadRequest("the offer needs 'sdp' (a string) and 'type': 'offer'")
        if not isinstance(body.get("prompt", ""), str):
            raise BadRequest("'prompt' must be a string")
        async with self.lock:
            if self.session is not None:
                return _error(409, "busy: one session at a time; try again when it ends")
            loop = asyncio.get_running_loop()
            image, speech, notes = await loop.run_in_executor(None, self._read_media, body)
            out = PacedOutput(loop, self.worker.spec.side.sample_rate)
            pc = RTCPeerConnection(RTCConfiguration(iceServers=self.ice))
            microphones: list = []  # the page's audio tracks: the offer announces them

            @pc.on("track")
            def on_track(track):
                if track.kind == "audio":
                    microphones.append(track)

            try:
                await pc.setRemoteDescription(RTCSessionDescription(body["sdp"], "offer"))
                pc.addTrack(out.video)
                pc.addTrack(out.audio)
                await pc.setLocalDescription(await pc.createAnswer())
            except (ValueError, TypeError, AttributeError, KeyError) as e:
                await pc.close()
                why = str(e) or type(e).__name__
                raise BadRequest(f"the offer's SDP could not be negotiated ({why}); send the "
                                 "page's own offer") from None
            self.sessions += 1
            sid = str(self.sessions)
            session = LiveSession(
                self.worker, out.publish, self.slack, self.metrics, session_id=sid,
                on_error=lambda msg: loop.call_soon_threadsafe(
                    lambda: asyncio.ensure_future(self._failed(session, msg))),
                on_state=lambda state: loop.call_soon_threadsafe(
                    self._state_changed, session, state))

            @pc.on("datachannel")
            def on_channel(channel):
                if channel.label == "events" and self.session is session:
                    self.events = channel

            @pc.on("connectionstatechange")
            async def on_state():
                if pc.connectionState in ("failed", "closed") and self.pc is pc:
                    await self.close()

            self.session, self.pc, self.events = session, pc, None
            try:
                await loop.run_in_executor(None, session.start, image, body.get("prompt", ""))
            except Exception as e:  # noqa: BLE001 - a rank group that could not start
                self.session = self.pc = None
                await pc.close()
                self.last_error = str(e)
                return _error(503, f"the session could not start: {e}")
            if speech is not None:
                session.say(speech)
            for track in microphones:
                asyncio.ensure_future(self._microphone(track, session))
            asyncio.ensure_future(self._connect_watchdog(pc))
            self.stats_task = asyncio.ensure_future(self._push_stats(session))
            log.info("session %s started", sid)
            return web.json_response({"sdp": pc.localDescription.sdp,
                                      "type": pc.localDescription.type, "notes": notes,
                                      "session": sid})

    async def _connect_watchdog(self, pc: RTCPeerConnection) -> None:
        await asyncio.sleep(self.connect_timeout_s)
        if self.pc is pc and pc.connectionState != "connected":
            log.warning("the client did not connect within %g s; session freed",
                        self.connect_timeout_s)
            await self.close()

    async def _push_stats(self, session: LiveSession) -> None:
        """The live numbers to the page, every stats_period_s, while the session lasts."""
        while self.session is session:
            self._send({"type": "stats", "state": session.state, **self.metrics.live()})
            await asyncio.sleep(self.stats_period_s)

    def _state_changed(self, session: LiveSession, state: str) -> None:
        if self.session is session:
            self._send({"type": "state", "state": state})

    async def _failed(self, session: LiveSession, message: str) -> None:
        """The session failed on its own (a rank died): tell the page, free the server; the
        next session starts on fresh ranks."""
        if self.session is not session:
            return
        self.last_error = message
        self._send({"type": "error", "message": message})
        await asyncio.sleep(ERROR_FLUSH_S)  # let the message leave before the peer closes
        await self.close()

    def _send(self, event: dict) -> None:
        ch = self.events
        if ch is not None and ch.readyState == "open":
            try:
                ch.send(json.dumps(event))
            except Exception:  # noqa: BLE001 - the peer is going away
                pass

    async def _microphone(self, track, session: LiveSession):
        rs = av.AudioResampler(format="flt", layout="mono", rate=self.worker.spec.side.sample_rate)
        while True:
            try:
                frame = await track.recv()
            except Exception:  # noqa: BLE001 - the track ended
                return
            for f in rs.resample(frame):
                session.say(torch.from_numpy(np.ascontiguousarray(f.to_ndarray().reshape(-1))))

    async def interrupt(self, request):
        if self.session is None:
            return _error(409, "no session to interrupt: press Start first")
        t = self.session.interrupt()
        return web.json_response({"interrupt_t": t, "now": time.monotonic()})

    async def stop(self, request):
        fps = await self.close()
        return web.json_response({"fps": fps})

    async def close(self):
        session, pc = self.session, self.pc
        self.session = self.pc = None
        if self.stats_task is not None:
            self.stats_task.cancel()
            self.stats_task = None
        fps = None
        if session is not None:
            fps = await asyncio.get_running_loop().run_in_executor(None, session.stop)
            self._send({"type": "ended", "fps": fps})
        self.events = None
        if pc is not None:
            await pc.close()
        return fps


async def _serve(server: Server, host: str, port: int, readiness=None, drain=None) -> None:
    """The page on host:port until SIGINT or SIGTERM, with /healthz and /readyz beside its
    /metrics. SIGTERM drains (runtime/lifecycle.py): /readyz reads draining and new offers get
    503 at once, the page in a session is told how long it has left ({"type": "draining"}),
    the session goes on until it ends or its time is up, then ends cleanly ({"type": "ended"}
    and the peer connection closed). SIGINT, or a second signal, ends it at once."""
    from .lifecycle import Drain, keep_ranks
    from .probes import Readiness

    readiness = readiness or Readiness()
    drain = drain or Drain()
    busy = lambda: server.metrics.sessions_in_progress > 0  # noqa: E731

    async def probe(request):
        if request.path == "/healthz":
            return web.json_response({"alive": True})
        status, body = readiness.report()
        return web.json_response(body, status=status)

    @web.middleware
    async def no_offers_while_draining(request, handler):
        if drain.begun and request.method == "POST" and request.path == "/offer":
            return _error(503, "the server is stopping: start the session again in a moment "
                               "(on another server, or on this one once it has restarted)")
        return await handler(request)

    app = server.app()
    app.router.add_get("/healthz", probe)
    app.router.add_get("/readyz", probe)
    app.middlewares.append(no_offers_while_draining)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as e:
        await runner.cleanup()
        raise ServeError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e}); "
                         "choose another port or stop what uses it") from None
    wake = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if drain.begin(sig.name, now=sig == signal.SIGINT):
            left = drain.session_left_s()
            if busy() and left > 0:
                readiness.draining(f"stopping ({sig.name}): the session in progress ends "
                                   f"within {left:.0f} s")
                server._send({"type": "draining", "ends_in_s": round(left, 1),
                              "message": f"The server is stopping: this session ends in "
                                         f"{left:.0f} s."})
                log.info("%s: draining; the session in progress may go on for %.1f s",
                         sig.name, left)
            else:
                readiness.draining(f"stopping ({sig.name})")
        wake.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    print(f"charrun: serving on http://{host}:{port}/", flush=True)
    readiness.ready(busy)
    if drain.begun:  # the signal came while the engine loaded
        readiness.draining(f"stopping ({drain.signame})")
        wake.set()
    ranks = asyncio.ensure_future(keep_ranks(server.worker, readiness, server.lock, busy, drain))
    try:
        await wake.wait()
        await drain.until_sessions_end(busy)
        log.info("stopping: ending the session in progress")
    finally:
        ranks.cancel()
        await asyncio.gather(ranks, return_exceptions=True)
        await server.close()
        await runner.cleanup()


def serve(worker: Worker, host: str, port: int, ice_servers: list[str], slack: int,
          image_fit: ImageFit = ImageFit(), readiness=None, metrics: Metrics | None = None,
          drain=None) -> None:
    """Serve until SIGINT or SIGTERM; the session in progress ends cleanly (the caller stops
    the worker's ranks). `readiness` (runtime/probes.py) reads ready once the page listens;
    `metrics` is the worker's (the probe server's /metrics too); `drain`
    (runtime/lifecycle.py) carries --grace-period."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    metrics = metrics or Metrics(target_fps=worker.spec.fps)
    server = Server(worker, metrics, ice_servers, slack, image_fit)
    asyncio.run(_serve(server, host, port, readiness, drain))
