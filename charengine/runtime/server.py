"""charrun --serve: a local page that streams the character over WebRTC (aiohttp + aiortc).

The page (static/: plain HTML, CSS and a script) sends an SDP offer with the reference
image, optional speech and prompt (or asks for the microphone); the worker answers, starts a
live session and streams video and audio paced from one clock. One session at a time. No
ICE server is used unless given: aiortc's default would be a public STUN server.

Routes: GET / (the page), GET /static/* (its style and script), POST /offer, POST /interrupt,
POST /stop, GET /status (the state and the engine: family, preset, target, fps, frames per
step), GET /metrics. Every error is JSON, {"error": sentence}, with a 4xx status for what
the request got wrong and 5xx for what the server did (503 with Retry-After where trying
again later will do). Uploads are bounded before they are read (runtime/access.py: how many
at once and their bytes) and decoded off the event loop, so /metrics and the rest answer
while an image is read; a speech upload is refused past MAX_UPLOAD_SPEECH_S, and an SDP past
MAX_SDP_BYTES or MAX_MEDIA_SECTIONS before it is negotiated (on the event loop).

Who may do what (runtime/access.py): every request must name a host the server answers to
(DNS rebinding); a POST must be JSON and come from the page's own origin, an allowed one, or
no web page at all. /offer answers with the session's id, an unguessable token: /interrupt
and /stop act only on the session their body names ({"session": id}), and the events
channel carries the session's events only once the page has said the id on it.

The session talks to the page over a data channel named "events" that the page opens and
greets with {"type": "hello", "session": id}: {"type": "stats", "state": ..., live
numbers...} every STATS_PERIOD_S (Metrics.live(): the numbers /metrics has, from the same
object), {"type": "state", "state": ...} when the state changes (runtime/live.py STATES),
{"type": "error", "message": ...} when a rank dies or the session fails, {"type":
"draining", ...} when a stop gives the session a deadline, and {"type": "ended"} (with "why"
where the server ended it: nothing said for --idle-timeout, or too much sent). An offer
whose client never connects frees the server after CONNECT_TIMEOUT_S; a client that vanishes
mid-session (no RTCP report for PEER_SILENT_S) frees it too, and a client that sends more than
its account allows (runtime/client_bounds.py: bytes, packets, data-channel messages, its
microphone ahead of real time) has its session ended, told why.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import signal
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import av
import numpy as np
import torch
from aiohttp import web
from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription

from .access import (JSON_TYPE, PAGE_HEADERS, UPLOAD_RETRY_AFTER_S, Access, UploadGate,
                     same_token)
from .client_bounds import ClientAccount, watch_ice_checks
from .formats import (MAX_UPLOAD_SPEECH_S, ImageFit, MediaError, cut, data_url_bytes,
                      prompt_problem, quoted, upload_message)
from .garbage import collect_after_session
from .images import load_image
from .live import SILENCE_LEVEL, LiveSession
from .media import read_audio
from .metrics import Metrics
from .run_config import IDLE_TIMEOUT_S
from .webrtc import PacedOutput
from .worker import Worker

log = logging.getLogger("charengine.server")

MAX_UPLOAD_BYTES = 64 * 1024 * 1024  # the whole offer: image and speech as data URLs
CONNECT_TIMEOUT_S = 5.0  # an answered offer whose peer has not connected by then is freed
# a connected client that has sent no RTCP receiver report for this long has vanished (every
# WebRTC receiver reports about once a second); looked at every PEER_POLL_S
PEER_SILENT_S = 3.0
PEER_POLL_S = 0.5
STATS_PERIOD_S = 1.0  # how often the live numbers are pushed to the page
ERROR_FLUSH_S = 0.2  # lets an error message leave before the peer closes
# libraries whose INFO lines are each connection's inner steps (aioice: some twenty ICE
# checks a session): their warnings and errors are logged, the rest would drown the server's
QUIET_LOGGERS = ("aioice", "aiortc")
IDLE_POLL_S = 1.0  # the idle watchdog's longest sleep
QUIET_STATES = ("starting", "listening")  # the character says nothing
TOKEN_BYTES = 16  # a session id's randomness (secrets.token_urlsafe: 22 characters)
MAX_CHANNEL_MESSAGE = 4096  # the longest message the events channel reads
# a control request's body ({"session": id, "in_flight": ...}): its declared length is checked
# before it is read (the upload gate counts offers only)
MAX_CONTROL_BYTES = 4096
# what a 503 at capacity tells the client to wait: a session is minutes long, so a freed
# lane is found by trying again now and then
FULL_RETRY_AFTER_S = 5
# the most of a microphone's audio a barge-in's "in_flight": "drop" drops: more than what
# sits between a client and the session (a receiver's jitter buffer, 4 packets of 20 ms, and
# a packet or two on the way), so a client that never sends silence is heard again soon
IN_FLIGHT_MAX_S = 0.5
STATIC = "static"  # the page's files, package data of charengine.runtime
# An offer's SDP is refused past these before it is negotiated: the page's offer in Chromium
# has three media sections (video, audio both ways, the events channel) in about 7 kB, and
# negotiating grows faster than the sections do (5,000 of them, 6 MB, held the event loop,
# and so every session's media, for 15 s)
MAX_SDP_BYTES = 64 * 1024
MAX_MEDIA_SECTIONS = 8
BYTES_PER_KB = 1000


class ServeError(RuntimeError):
    pass


class BadRequest(ValueError):
    pass


class NoSuchSession(LookupError):
    """A control request whose session id names no session in progress (404)."""


class BodyRefused(ValueError):
    """A request body refused before it is read, with its status (411, 413)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Unavailable(RuntimeError):
    """The server cannot take the request now (503 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


def _upload_error(e: MediaError, what: str, name) -> BadRequest:
    """A reader's message about an upload, naming the file as the page chose it."""
    text = upload_message(e)
    if isinstance(name, str) and name.strip():
        what = f'{what} "{cut(name.strip())}"'
    return BadRequest(f"{what}: {text}")


async def _page_headers(request, response) -> None:
    """access.PAGE_HEADERS on every response, errors and static files included."""
    response.headers.update(PAGE_HEADERS)


def _error(status: int, message: str, retry_after: float | None = None) -> web.Response:
    headers = {"Retry-After": f"{retry_after:g}"} if retry_after is not None else None
    return web.json_response({"error": message}, status=status, headers=headers)


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
    except NoSuchSession as e:
        return _error(404, str(e))
    except BodyRefused as e:
        return _error(e.status, str(e))
    except Unavailable as e:
        return _error(503, str(e), retry_after=e.retry_after_s)
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


@dataclass
class Served:
    """A session in progress: its token (the capability /interrupt, /stop and the events
    channel ask for), its number (what the log names), its lane (the worker's place it runs
    in), the session, its peer connection, the page's "events" channel once it has said the
    token, and the tasks that watch it."""
    token: str
    number: int
    lane: int
    session: LiveSession
    pc: RTCPeerConnection
    events: object = None
    tasks: list = field(default_factory=list)
    # a barge-in asked the microphone's audio already on its way to be dropped: samples left
    # to drop, up to its first silent frame (what the client sends once it has cleared its
    # own queue); the frames that begin within IN_FLIGHT_MAX_S of it at most
    hush: int = 0
    # since when (the loop's clock) the character has only listened: its start, then each
    # turn's end; None while it speaks (the idle watchdog ends a session quiet too long)
    quiet_since: float | None = None
    # what its client has sent (runtime/client_bounds.py), and why the session is ended for
    # it once the client has sent too much
    account: ClientAccount = field(default_factory=ClientAccount)
    overrun: str | None = None


def _checked_str(body: dict, key: str, default=None):
    """body[key] where it is absent, null or a string; else BadRequest naming it."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise BadRequest(f"'{key}' must be a string, not {type(value).__name__}")
    return value


def _answer_directions(pc, voice) -> list:
    """What each of the offer's media sections carries, set before the answer is made: the
    character's video out on the section it took, and nothing in there (a client's video
    would be decoded into frames nothing reads: one 720p sender grew the server by 40 MB a
    second); the character's voice out and the client's microphone in on the voice's
    section; nothing on any other. Returns the microphone's track, in a list (empty where
    the offer sends nothing on the voice's section: aiortc makes a receiver's track only
    for a section the peer sends on)."""
    microphones = []
    for t in pc.getTransceivers():
        if t.sender.track is None:
            t.direction = "inactive"
        elif t.kind == "video":
            t.direction = "sendonly"
        elif t.sender is voice and t.receiver.track is not None:
            microphones.append(t.receiver.track)
    return microphones


def _unbundled(sdp: str) -> list[str]:
    """The sections of an offer's SDP (their a=mid, or their place) that its BUNDLE group
    does not name: bundled, every section arrives on one transport, whose counts are all the
    client sends (runtime/client_bounds.py), and one ICE agent serves the session."""
    bundle, mids = set(), []
    for line in sdp.splitlines():
        if line.startswith("a=group:BUNDLE"):
            bundle.update(line.split()[1:])
        elif line.startswith("m="):
            mids.append(f"#{len(mids) + 1}")
        elif line.startswith("a=mid:") and mids:
            mids[-1] = line.removeprefix("a=mid:").strip()
    return [mid for mid in mids if mid not in bundle]


def _check_sdp(sdp: str) -> None:
    """BadRequest for an offer's SDP past MAX_SDP_BYTES or MAX_MEDIA_SECTIONS."""
    size = len(sdp.encode("utf-8", "surrogatepass"))
    if size > MAX_SDP_BYTES:
        raise BadRequest(f"the offer's SDP is {size:,} bytes; at most {MAX_SDP_BYTES:,}: send "
                         "the page's own offer")
    sections = sum(line.startswith("m=") for line in sdp.splitlines())
    if sections > MAX_MEDIA_SECTIONS:
        raise BadRequest(f"the offer's SDP has {sections} media sections; at most "
                         f"{MAX_MEDIA_SECTIONS}: send the page's own offer")
    if unbundled := _unbundled(sdp):
        raise BadRequest(f"the offer's SDP leaves media sections out of its BUNDLE group "
                         f"({quoted(' '.join(unbundled))}): name every section in one "
                         "a=group:BUNDLE, as browsers offer")


def parse_json(raw: bytes, what: str):
    """A request body as JSON; BadRequest (400) for anything else, nesting included."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest(f"{what} is not JSON") from None
    except RecursionError:
        raise BadRequest(f"{what} is JSON nested too deeply") from None


class Server:
    def __init__(self, worker: Worker, metrics: Metrics, ice_servers: list[str] = (),
                 slack: int = 2, image_fit: ImageFit = ImageFit(),
                 connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 stats_period_s: float = STATS_PERIOD_S, access: Access = Access(),
                 peer_silent_s: float = PEER_SILENT_S, idle_timeout_s: float = IDLE_TIMEOUT_S):
        self.worker, self.metrics, self.slack = worker, metrics, slack
        self.idle_timeout_s = idle_timeout_s
        self.image_fit, self.connect_timeout_s = image_fit, connect_timeout_s
        self.stats_period_s, self.access, self.peer_silent_s = stats_period_s, access, \
            peer_silent_s
        self.ice = [RTCIceServer(urls=u) for u in ice_servers]
        # the worker's lanes (runtime/lanes.py; a TP worker is one), each serving at most
        # one session: lane -> the session in it
        self.lanes = getattr(worker, "lanes", None) or [worker]
        self.live: dict[int, Served] = {}
        self.uploads = UploadGate(MAX_UPLOAD_BYTES)
        self.lock = asyncio.Lock()
        self.sessions = 0
        self.last_error: str | None = None
        self.info = engine_info(worker, slack)
        metrics.set_capacity(self.capacity)
        if getattr(worker, "turns", None) is not None:
            metrics.watch_turns(worker.turns)

    @property
    def capacity(self) -> int:
        return len(self.lanes)

    @property
    def full(self) -> bool:
        return len(self.live) >= self.capacity

    def _active(self, served: Served) -> bool:
        return self.live.get(served.lane) is served

    def _free_lane(self) -> int | None:
        return next((i for i in range(self.capacity) if i not in self.live), None)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_UPLOAD_BYTES,
                              middlewares=[json_errors, self.guard])
        app.on_response_prepare.append(_page_headers)
        app.router.add_get("/", self.index)
        app.router.add_get("/static/{name}", self.static)
        app.router.add_post("/offer", self.offer)
        app.router.add_post("/interrupt", self.interrupt)
        app.router.add_post("/stop", self.stop)
        app.router.add_get("/status", self.status)
        app.router.add_get("/metrics", self.metrics_page)
        app.on_shutdown.append(lambda _: self.close())
        return app

    @web.middleware
    async def guard(self, request, handler):
        """runtime/access.py: the Host every request names; for a POST, JSON and the page's
        own origin (or an allowed one)."""
        why = self.access.host_refusal(request.headers.get("Host"))
        if why is None and request.method == "POST":
            if request.content_type != JSON_TYPE:
                return _error(415, f"send the request as JSON (Content-Type: {JSON_TYPE})")
            why = self.access.origin_refusal(request.headers.get("Origin"),
                                             request.headers.get("Host"))
        if why is not None:
            log.warning("refused %s %s: %s", request.method, request.path, why)
            return _error(403, why)
        return await handler(request)

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
        states = [s.session.state for s in self.live.values()]
        return web.json_response({"state": "streaming" if states else "ready",
                                  "session_state": states[0] if len(states) == 1 else None,
                                  "active": len(states), "capacity": self.capacity,
                                  "sessions": self.sessions, "last_error": self.last_error,
                                  "model": spec.name, "family": spec.FAMILY, "fps": spec.fps,
                                  "engine": self.info, "max_upload_bytes": MAX_UPLOAD_BYTES,
                                  "uploads_in_flight": self.uploads.count})

    def _read_media(self, body: dict):
        """The offer's image and speech, decoded (on an executor thread)."""
        spec = self.worker.spec
        fit = self.image_fit
        policy, background = _checked_str(body, "fit"), _checked_str(body, "background")
        if policy is not None or background is not None:
            fit = ImageFit(policy or fit.policy, background or fit.background)
        notes = []
        image_bytes = data_url_bytes(_checked_str(body, "image"), "image")
        if image_bytes is not None:
            try:
                picture = load_image(image_bytes, spec.out_h, spec.out_w, fit)
            except MediaError as e:
                raise _upload_error(e, "the image", body.get("image_name")) from None
            image = picture.pixels
            notes.append(f"image: {picture.describe()}")
        else:
            image = torch.full((3, spec.out_h, spec.out_w), 0.5)
        speech_bytes = data_url_bytes(_checked_str(body, "speech"), "speech")
        if speech_bytes is not None:
            warnings: list[str] = []
            try:
                speech = read_audio(speech_bytes, spec.side.sample_rate, warn=warnings.append,
                                    max_seconds=MAX_UPLOAD_SPEECH_S)
            except MediaError as e:
                raise _upload_error(e, "the speech", body.get("speech_name")) from None
            notes.append(f"speech: {speech.numel() / spec.side.sample_rate:.1f} s at "
                         f"{spec.side.sample_rate // 1000} kHz mono" +
                         "".join(f"; {w.removeprefix('upload: ')}" for w in warnings))
        else:
            speech = None
        return image, speech, notes

    def _unavailable(self) -> web.Response | None:
        """The answer to an offer that cannot be taken now, before its body is read (an offer
        that arrives while a TP engine's ranks start afresh waits for them: its session
        starts on the fresh group, never on the dead one)."""
        if self.full:
            return self._full()
        return None

    def _full(self) -> web.Response:
        """503 with Retry-After: every lane has its session (a balancer sends the next
        offer elsewhere; /readyz reads busy meanwhile)."""
        response = _error(503, f"full: {self.capacity} session"
                               f"{'s' if self.capacity > 1 else ''} in progress, this "
                               "server's capacity; try again in a moment")
        response.headers["Retry-After"] = str(FULL_RETRY_AFTER_S)
        return response

    async def _offer_body(self, request) -> dict:
        """The offer's JSON, read within the upload gate; its fields' types checked."""
        size = self.uploads.admit(request.content_length)
        if size is None:
            raise Unavailable("the server is reading other uploads: try again in a moment",
                              UPLOAD_RETRY_AFTER_S)
        try:
            raw = await request.read()
        finally:
            self.uploads.release(size)
        body = parse_json(raw, "the offer")
        if not isinstance(body, dict) or not isinstance(body.get("sdp"), str) \
                or body.get("type") != "offer":
            raise BadRequest("the offer needs 'sdp' (a string) and 'type': 'offer'")
        for key in ("prompt", "image", "speech", "fit", "background"):
            _checked_str(body, key)
        if (why := prompt_problem(body.get("prompt") or "")) is not None:
            raise BadRequest(f"'prompt' {why}")
        _check_sdp(body["sdp"])
        return body

    async def offer(self, request):
        refused = self._unavailable()
        if refused is not None:
            return refused
        body = await self._offer_body(request)
        async with self.lock:
            lane = self._free_lane()
            if lane is None:  # offers read beside this one took the lanes
                return self._full()
            loop = asyncio.get_running_loop()
            image, speech, notes = await loop.run_in_executor(None, self._read_media, body)
            out = PacedOutput(loop, self.worker.spec.side.sample_rate)
            pc = RTCPeerConnection(RTCConfiguration(iceServers=self.ice))
            try:
                await pc.setRemoteDescription(RTCSessionDescription(body["sdp"], "offer"))
                pc.addTrack(out.video)
                voice = pc.addTrack(out.audio)
                microphones = _answer_directions(pc, voice)
                await pc.setLocalDescription(await pc.createAnswer())
            except (ValueError, TypeError, AttributeError, KeyError) as e:
                await pc.close()
                why = str(e) or type(e).__name__
                raise BadRequest(f"the offer's SDP could not be negotiated ({why}); send the "
                                 "page's own offer") from None
            self.sessions += 1
            served = Served(secrets.token_urlsafe(TOKEN_BYTES), self.sessions, lane, None, pc)
            if not watch_ice_checks(pc, lambda: self._ice_check(served)):
                log.warning("session %d: its ICE checks are not counted (this aiortc holds "
                            "them where charengine does not look)", served.number)
            served.session = LiveSession(
                self.lanes[lane], out.publish, self.slack, self.metrics,
                session_id=str(served.number),
                on_error=lambda msg: loop.call_soon_threadsafe(
                    lambda: asyncio.ensure_future(self._failed(served, msg))),
                on_state=lambda state: loop.call_soon_threadsafe(
                    self._state_changed, served, state))

            @pc.on("datachannel")
            def on_channel(channel):
                if (why := served.account.spend("messages", 1)) is not None:
                    self._overran(served, why)
                channel.on("message", lambda m: self._channel_said(served, channel, m))

            @pc.on("connectionstatechange")
            async def on_state():
                if pc.connectionState in ("failed", "closed") and self._active(served):
                    await self.close(served)

            self.live[lane] = served
            try:
                await loop.run_in_executor(None, served.session.start, image,
                                           body.get("prompt") or "")
            except Exception as e:  # noqa: BLE001 - a rank group that could not start
                del self.live[lane]
                await pc.close()
                self.last_error = str(e)
                return _error(503, f"the session could not start: {e}")
            if speech is not None:
                served.session.say(speech)
            for track in microphones:
                served.tasks.append(asyncio.ensure_future(
                    self._microphone(track, served)))
            served.quiet_since = loop.time()
            served.tasks += [asyncio.ensure_future(self._connect_watchdog(served)),
                             asyncio.ensure_future(self._peer_watchdog(served)),
                             asyncio.ensure_future(self._idle_watchdog(served)),
                             asyncio.ensure_future(self._push_stats(served))]
            log.info("session %d started (lane %d; %d of %d in progress)", served.number, lane,
                     len(self.live), self.capacity)
            return web.json_response({"sdp": pc.localDescription.sdp,
                                      "type": pc.localDescription.type, "notes": notes,
                                      "session": served.token})

    def _channel_said(self, served: Served, channel, message) -> None:
        """A message on one of the client's data channels, counted against its account. On
        the events channel, {"type": "hello", "session": token} makes the channel the
        session's (events go nowhere before); anything else is ignored."""
        if (why := served.account.spend("messages", 1)) is not None:
            self._overran(served, why)
            return
        if channel.label != "events" or not isinstance(message, str) or \
                len(message) > MAX_CHANNEL_MESSAGE:
            return
        try:
            said = json.loads(message)
        except (json.JSONDecodeError, RecursionError):
            return
        if isinstance(said, dict) and said.get("type") == "hello" and \
                isinstance(said.get("session"), str) and \
                same_token(said["session"], served.token):
            served.events = channel

    async def _connect_watchdog(self, served: Served) -> None:
        await asyncio.sleep(self.connect_timeout_s)
        if self._active(served) and served.pc.connectionState != "connected":
            log.warning("session %d: the client did not connect within %g s; session freed",
                        served.number, self.connect_timeout_s)
            await self.close(served)

    async def _peer_watchdog(self, served: Served) -> None:
        """A client that vanished (killed, its network gone) sends nothing more, but its
        connection reads "connected" until ICE's consent expires (30 s): every WebRTC
        receiver reports on the video it gets (RTCP receiver reports, about every second),
        so a session whose client has connected and then not reported for peer_silent_s is
        ended. The same stats give what the client has sent, for its account."""
        last, heard = None, None
        while self._active(served):
            await asyncio.sleep(PEER_POLL_S)
            now = time.monotonic()
            stats = (await served.pc.getStats()).values()
            # the first report is due once video has gone out: a receiver reports on what it
            # gets, and a session's first frames may take a loaded server seconds to make
            if heard is None and served.pc.connectionState == "connected" and any(
                    r.type == "outbound-rtp" and r.kind == "video" and r.packetsSent
                    for r in stats):
                heard = now
            # the offer bundles every section on one transport: its counts (and those of
            # transports aiortc made and stopped, which stay 0) are all the client has sent
            transports = [r for r in stats if r.type == "transport"]
            why = served.account.spend_to(
                "kB", sum(r.bytesReceived for r in transports) / BYTES_PER_KB) or \
                served.account.spend_to("packets", sum(r.packetsReceived for r in transports))
            if why is not None:
                self._overran(served, why)
                return
            reports = [r.timestamp for r in stats
                       if r.type == "remote-inbound-rtp" and r.kind == "video"]
            if reports and reports[0] != last:
                last, heard = reports[0], now
            elif heard is not None and now - heard > self.peer_silent_s \
                    and self._active(served):
                log.warning("session %d: the client stopped answering (no report for %g s); "
                            "session freed", served.number, self.peer_silent_s)
                await self.close(served)
                return

    async def _push_stats(self, served: Served) -> None:
        """The live numbers to the page, every stats_period_s, while the session lasts."""
        while self._active(served):
            self._send(served, {"type": "stats", "state": served.session.state,
                                **served.session.metrics.live()})
            await asyncio.sleep(self.stats_period_s)

    def _state_changed(self, served: Served, state: str) -> None:
        if self._active(served):
            if state not in QUIET_STATES:
                served.quiet_since = None
            elif served.quiet_since is None:
                served.quiet_since = asyncio.get_running_loop().time()
            self._send(served, {"type": "state", "state": state})

    async def _idle_watchdog(self, served: Served) -> None:
        """Ends a session whose character has only listened for idle_timeout_s (no speech
        queued or heard: a tab left open holds its place otherwise); 0: never."""
        if not self.idle_timeout_s:
            return
        loop = asyncio.get_running_loop()
        while self._active(served):
            since = served.quiet_since
            left = self.idle_timeout_s if since is None else \
                since + self.idle_timeout_s - loop.time()
            if left <= 0:
                why = f"nothing was said for {self.idle_timeout_s:g} s"
                log.info("session %d: %s; ended", served.number, why)
                await self.close(served, why)
                return
            await asyncio.sleep(min(left, IDLE_POLL_S))

    def _ice_check(self, served: Served) -> bool:
        """An ICE check from the client, counted against its account: False (unanswered)
        once past it, the session then ended."""
        why = served.account.spend("ice_checks", 1)
        if why is not None:
            self._overran(served, why)
        return why is None

    def _overran(self, served: Served, why: str) -> None:
        """Ends the session whose client has sent more than its account allows (once)."""
        if served.overrun is None and self._active(served):
            served.overrun = why
            log.warning("session %d: %s; ended", served.number, why)
            asyncio.ensure_future(self.close(served, why))

    async def _failed(self, served: Served, message: str) -> None:
        """The session failed on its own (a rank died): tell the page, free the server; the
        next session starts on fresh ranks."""
        if not self._active(served):
            return
        self.last_error = message
        self._send(served, {"type": "error", "message": message})
        await asyncio.sleep(ERROR_FLUSH_S)  # let the message leave before the peer closes
        await self.close(served)

    @staticmethod
    def _send(served: Served | None, event: dict) -> None:
        ch = served.events if served is not None else None
        if ch is not None and ch.readyState == "open":
            try:
                ch.send(json.dumps(event))
            except Exception:  # noqa: BLE001 - the peer is going away
                pass

    def send_all(self, event: dict) -> None:
        """An event to the page of every session in progress."""
        for served in list(self.live.values()):
            self._send(served, event)

    async def _microphone(self, track, served: Served):
        rs = av.AudioResampler(format="flt", layout="mono", rate=self.worker.spec.side.sample_rate)
        while True:
            try:
                frame = await track.recv()
            except Exception:  # noqa: BLE001 - the track ended
                return
            why = served.account.spend("audio_s", frame.samples / frame.sample_rate)
            if why is not None:
                self._overran(served, why)
                return
            for f in rs.resample(frame):
                samples = np.ascontiguousarray(f.to_ndarray().reshape(-1))
                if served.hush > 0:
                    if samples.size == 0 or np.abs(samples).max() > SILENCE_LEVEL:
                        served.hush = max(0, served.hush - samples.size)
                        continue  # sent before the barge-in
                    served.hush = 0
                served.session.say(torch.from_numpy(samples))

    @staticmethod
    async def _control_body(request):
        """A control request's JSON, read only where it declares at most MAX_CONTROL_BYTES."""
        if request.content_length is None:
            raise BodyRefused(411, "send the request with its Content-Length")
        if request.content_length > MAX_CONTROL_BYTES:
            raise BodyRefused(413, f"the request's body is {request.content_length:,} bytes; "
                                   f"at most {MAX_CONTROL_BYTES:,}")
        return parse_json(await request.read(), "the request")

    async def _owned(self, request, body=None) -> Served:
        """The session a control request names ({"session": token}, as /offer returned it)."""
        if body is None:
            body = await self._control_body(request)
        token = body.get("session") if isinstance(body, dict) else None
        if not isinstance(token, str) or not token:
            raise BadRequest('name the session: {"session": id}, the id /offer returned')
        # every live token compared, in constant time each: no early answer says how many
        # sessions there are or which token came close
        found = [s for s in list(self.live.values()) if same_token(token, s.token)]
        served = found[0] if found else None
        if served is None:
            raise NoSuchSession("no such session: it has ended, or it is not yours; press "
                                "Start to begin a new one")
        return served

    async def interrupt(self, request):
        """A barge-in. With "in_flight": "drop" the microphone's audio already sent is dropped
        too, up to its first silent frame (at most IN_FLIGHT_MAX_S of it): a client that
        clears its own queue of speech and then sends silence (charengine.pipecat) asks for
        it; the page does not (its microphone is the user, who may go on speaking)."""
        body = await self._control_body(request)
        served = await self._owned(request, body)
        in_flight = body.get("in_flight", "keep")
        if in_flight not in ("keep", "drop"):
            raise BadRequest("'in_flight' must be \"keep\" or \"drop\"")
        served.hush = round(IN_FLIGHT_MAX_S * self.worker.spec.side.sample_rate) \
            if in_flight == "drop" else 0
        t = served.session.interrupt()
        return web.json_response({"interrupt_t": t, "now": time.monotonic()})

    async def stop(self, request):
        served = await self._owned(request)
        fps = await self.close(served)
        return web.json_response({"fps": fps})

    async def close(self, only: Served | None = None, why: str | None = None):
        """End session `only` if it is still in progress (None: every session; returns the
        last one's fps); `why`, where the server ends it on its own, goes to the page."""
        if only is None:
            fps = None
            for served in list(self.live.values()):
                fps = await self.close(served)
            return fps
        served = only
        if not self._active(served):
            return None
        del self.live[served.lane]
        for task in served.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        fps = await asyncio.get_running_loop().run_in_executor(None, served.session.stop)
        self._send(served, {"type": "ended", "fps": fps, **({"why": why} if why else {})})
        await served.pc.close()
        collect_after_session()  # its cycles, and its encoder's threads, freed now
        return fps


async def _serve(server: Server, host: str, port: int, readiness=None, drain=None) -> None:
    """The page on host:port until SIGINT or SIGTERM, with /healthz and /readyz beside its
    /metrics. SIGTERM drains (runtime/lifecycle.py): /readyz reads draining and new offers get
    503 at once, the page in a session is told how long it has left ({"type": "draining"}),
    the session goes on until it ends or its time is up, then ends cleanly ({"type": "ended"}
    and the peer connection closed). SIGINT, or a second signal, ends it at once."""
    from .lifecycle import STOP_SIGNALS, Drain, keep_ranks
    from .probes import Readiness

    readiness = readiness or Readiness()
    drain = drain or Drain()
    busy = lambda: bool(server.live)  # noqa: E731 - any session in progress (drain waits)
    full = lambda: server.full  # noqa: E731 - every lane taken (/readyz reads busy)

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
                server.send_all({"type": "draining", "ends_in_s": round(left, 1),
                              "message": f"The server is stopping: this session ends in "
                                         f"{left:.0f} s."})
                log.info("%s: draining; the session in progress may go on for %.1f s",
                         sig.name, left)
            else:
                readiness.draining(f"stopping ({sig.name})")
        wake.set()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    print(f"charrun: serving on http://{host}:{port}/", flush=True)
    readiness.ready(full, healthy=getattr(server.worker, "alive", None))
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
          drain=None, access: Access = Access(),
          idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
    """Serve until SIGINT or SIGTERM; the session in progress ends cleanly (the caller stops
    the worker's ranks). `readiness` (runtime/probes.py) reads ready once the page listens;
    `metrics` is the worker's (the probe server's /metrics too); `drain`
    (runtime/lifecycle.py) carries --grace-period."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    metrics = metrics or Metrics(target_fps=worker.spec.fps)
    server = Server(worker, metrics, ice_servers, slack, image_fit, access=access,
                    idle_timeout_s=idle_timeout_s)
    asyncio.run(_serve(server, host, port, readiness, drain))
