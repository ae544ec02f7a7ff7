"""charrun --serve: a local page that streams the character over WebRTC (aiohttp + aiortc).

The page sends an SDP offer with the reference image, optional speech and prompt (or asks
for the microphone); the worker answers, starts a live session and streams video and audio
paced from one clock. One session at a time. No ICE server is used unless given: aiortc's
default would be a public STUN server.

Routes: GET / (the page), POST /offer, POST /interrupt, POST /stop, GET /status,
GET /metrics. Every error is JSON, {"error": sentence}, with a 4xx status for what the
request got wrong and 5xx for what the server did. Uploads are decoded off the event loop,
so /metrics and the rest answer while an image is read. The session tells the page what
happens to it over a data channel named "events" that the page opens ({"type": "error",
"message": ...} when a rank dies or the session fails, {"type": "ended"}), and an offer
whose client never connects frees the server after CONNECT_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import signal
import time
from importlib import resources

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


class Server:
    def __init__(self, worker: Worker, metrics: Metrics, ice_servers: list[str] = (),
                 slack: int = 2, image_fit: ImageFit = ImageFit(),
                 connect_timeout_s: float = CONNECT_TIMEOUT_S):
        self.worker, self.metrics, self.slack = worker, metrics, slack
        self.image_fit, self.connect_timeout_s = image_fit, connect_timeout_s
        self.ice = [RTCIceServer(urls=u) for u in ice_servers]
        self.session: LiveSession | None = None
        self.pc: RTCPeerConnection | None = None
        self.events = None  # the page's "events" data channel
        self.lock = asyncio.Lock()
        self.sessions = 0
        self.last_error: str | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_UPLOAD_BYTES, middlewares=[json_errors])
        app.router.add_get("/", self.index)
        app.router.add_post("/offer", self.offer)
        app.router.add_post("/interrupt", self.interrupt)
        app.router.add_post("/stop", self.stop)
        app.router.add_get("/status", self.status)
        app.router.add_get("/metrics", self.metrics_page)
        app.on_shutdown.append(lambda _: self.close())
        return app

    async def index(self, request):
        page = resources.files("charengine.runtime").joinpath("static/index.html").read_text()
        return web.Response(text=page, content_type="text/html")

    async def metrics_page(self, request):
        return web.Response(body=self.metrics.exposition(),
                            headers={"Content-Type": "text/plain; version=0.0.4"})

    async def status(self, request):
        spec = self.worker.spec
        return web.json_response({"state": "streaming" if self.session else "ready",
                                  "sessions": self.sessions, "last_error": self.last_error,
                                  "model": spec.name, "family": spec.FAMILY, "fps": spec.fps})

    def _read_media(self, body: dict):
        """The offer's image and speech, decoded (on an executor thread)."""
        spec = self.worker.spec
        fit = self.image_fit
        if body.get("fit") is not None or body.get("background") is not None:
            fit = ImageFit(body.get("fit") or fit.policy, body.get("background") or fit.background)
        notes = []
        if body.get("image"):
            picture = load_image(_data_url_bytes(body["image"], "image"), spec.out_h, spec.out_w,
                                 fit)
            image = picture.pixels
            notes.append(f"image: {picture.describe()}")
        else:
            image = torch.full((3, spec.out_h, spec.out_w), 0.5)
        speech_bytes = _data_url_bytes(body.get("speech"), "speech")
        if speech_bytes:
            speech = read_audio(speech_bytes, spec.side.sample_rate, warn=notes.append)
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
                    lambda: asyncio.ensure_future(self._failed(session, msg))))

            @pc.on("track")
            def on_track(track):
                if track.kind == "audio":
                    asyncio.ensure_future(self._microphone(track, session))

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
            asyncio.ensure_future(self._connect_watchdog(pc))
            log.info("session %s started", sid)
            return web.json_response({"sdp": pc.localDescription.sdp,
                                      "type": pc.localDescription.type, "notes": notes})

    async def _connect_watchdog(self, pc: RTCPeerConnection) -> None:
        await asyncio.sleep(self.connect_timeout_s)
        if self.pc is pc and pc.connectionState != "connected":
            log.warning("the client did not connect within %g s; session freed",
                        self.connect_timeout_s)
            await self.close()

    async def _failed(self, session: LiveSession, message: str) -> None:
        """The session failed on its own (a rank died): tell the page, free the server; the
        next session starts on fresh ranks."""
        if self.session is not session:
            return
        self.last_error = message
        self._send({"type": "error", "message": message})
        await asyncio.sleep(0.2)  # let the message leave before the peer closes
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
        fps = None
        if session is not None:
            fps = await asyncio.get_running_loop().run_in_executor(None, session.stop)
            self._send({"type": "ended"})
        self.events = None
        if pc is not None:
            await pc.close()
        return fps


async def _serve(server: Server, host: str, port: int) -> None:
    runner = web.AppRunner(server.app(), handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as e:
        await runner.cleanup()
        raise ServeError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e}); "
                         "choose another port or stop what uses it") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"charrun: serving on http://{host}:{port}/", flush=True)
    try:
        await stop.wait()
        log.info("stopping: ending the session in progress")
    finally:
        await server.close()
        await runner.cleanup()


def serve(worker: Worker, host: str, port: int, ice_servers: list[str], slack: int,
          image_fit: ImageFit = ImageFit()) -> None:
    """Serve until SIGINT or SIGTERM; the session in progress ends cleanly (the caller stops
    the worker's ranks)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    server = Server(worker, Metrics(target_fps=worker.spec.fps), ice_servers, slack, image_fit)
    asyncio.run(_serve(server, host, port))
