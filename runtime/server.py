"""charrun --serve: a local page that streams the character over WebRTC (aiohttp + aiortc).

The page sends an SDP offer with the reference image, optional speech and prompt (or asks
for the microphone); the worker answers, starts a live session and streams video and audio
paced from one clock. One session at a time. No ICE server is used unless given: aiortc's
default would be a public STUN server.

Routes: GET / (the page), POST /offer, POST /interrupt, POST /stop, GET /metrics.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from importlib import resources

import av
import numpy as np
import torch
from aiohttp import web
from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription

from .live import LiveSession
from .media import MediaError, read_audio, read_image
from .metrics import Metrics
from .webrtc import PacedOutput
from .worker import Worker

log = logging.getLogger("charengine.server")


def _data_url_bytes(url: str | None) -> bytes | None:
    if not url:
        return None
    if not url.startswith("data:") or "," not in url:
        raise MediaError("upload: expected a data: URL")
    return base64.b64decode(url.split(",", 1)[1])


class Server:
    def __init__(self, worker: Worker, metrics: Metrics, ice_servers: list[str] = (),
                 slack: int = 2):
        self.worker, self.metrics, self.slack = worker, metrics, slack
        self.ice = [RTCIceServer(urls=u) for u in ice_servers]
        self.session: LiveSession | None = None
        self.pc: RTCPeerConnection | None = None
        self.lock = asyncio.Lock()
        self.sessions = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/", self.index)
        app.router.add_post("/offer", self.offer)
        app.router.add_post("/interrupt", self.interrupt)
        app.router.add_post("/stop", self.stop)
        app.router.add_get("/metrics", self.metrics_page)
        app.on_shutdown.append(lambda _: self.close())
        return app

    async def index(self, request):
        page = resources.files("charengine.runtime").joinpath("static/index.html").read_text()
        return web.Response(text=page, content_type="text/html")

    async def metrics_page(self, request):
        return web.Response(body=self.metrics.exposition(),
                            headers={"Content-Type": "text/plain; version=0.0.4"})

    async def offer(self, request):
        body = await request.json()
        spec = self.worker.spec
        async with self.lock:
            if self.session is not None:
                return web.json_response({"error": "busy: one session at a time"}, status=409)
            try:
                image = read_image(_data_url_bytes(body.get("image")), spec.out_h, spec.out_w) \
                    if body.get("image") else torch.full((3, spec.out_h, spec.out_w), 0.5)
                speech_bytes = _data_url_bytes(body.get("speech"))
                speech = read_audio(speech_bytes, spec.side.sample_rate) if speech_bytes else None
            except MediaError as e:
                return web.json_response({"error": str(e)}, status=400)
            loop = asyncio.get_running_loop()
            out = PacedOutput(loop, spec.side.sample_rate)
            pc = RTCPeerConnection(RTCConfiguration(iceServers=self.ice))
            self.sessions += 1
            session = LiveSession(self.worker, out.publish, self.slack, self.metrics,
                                  session_id=str(self.sessions))

            @pc.on("track")
            def on_track(track):
                if track.kind == "audio":
                    asyncio.ensure_future(self._microphone(track, session))

            @pc.on("connectionstatechange")
            async def on_state():
                if pc.connectionState in ("failed", "closed"):
                    await self.close()

            await pc.setRemoteDescription(RTCSessionDescription(body["sdp"], body["type"]))
            pc.addTrack(out.video)
            pc.addTrack(out.audio)
            answer = await pc.createAnswer()
            await pc.setLocalDescription(answer)
            await loop.run_in_executor(None, session.start, image, body.get("prompt", ""))
            if speech is not None:
                session.say(speech)
            self.session, self.pc = session, pc
            return web.json_response({"sdp": pc.localDescription.sdp,
                                      "type": pc.localDescription.type})

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
            return web.json_response({"error": "no session"}, status=409)
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
        if pc is not None:
            await pc.close()
        return fps


def serve(worker: Worker, host: str, port: int, ice_servers: list[str], slack: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    server = Server(worker, Metrics(target_fps=worker.spec.fps), ice_servers, slack)
    print(f"charrun: serving on http://{host}:{port}/", flush=True)
    web.run_app(server.app(), host=host, port=port, print=None)
