"""A session of a running `charrun --serve`, opened from Python as its page opens one (aiortc):
the bot side of `charengine.pipecat`, with nothing of Pipecat in it.

The client offers to receive the character's video and audio and to send one audio track,
the speech the character is to speak (`SpeechTrack`: what `say` is given, paced at real time,
silence between turns, as a microphone sends), opens the server's "events" channel and greets
it with the session's id. The server's refusals (busy, full, draining, a bad image) come back
as `Refused` carrying the server's own sentence; a peer that does not connect in time, or an
address that answers but not as charrun --serve does, as `Unreachable`. A connection that
drops or a session the server ends is told to `on_lost` with a sentence; what to do then
(the service reconnects within its `Reconnect` policy) is the caller's."""

from __future__ import annotations

import asyncio
import base64
import collections
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import aiohttp
import av
import numpy as np
from aiortc import (MediaStreamTrack, RTCConfiguration, RTCIceServer, RTCPeerConnection,
                    RTCSessionDescription)
from aiortc.mediastreams import MediaStreamError

log = logging.getLogger("charengine.pipecat")

SPEECH_FRAME_S = 0.02  # the speech track's frames: one Opus packet each
# silent frames a barge-in's clear owes before any new speech: the server drops what arrives
# loud up to its first silent frame, and Opus's decoder carries a frame's tail into the next
SILENCE_AFTER_CLEAR = 3
# speech after silence is held until this much of it waits (or it has waited this long), so a
# TTS that streams at real time, its frames arriving up to this less one frame (40 ms) late,
# plays without gaps; a turn's start waits up to this long for it
SPEECH_LEAD_S = 0.06
HTTP_TIMEOUT_S = 30.0  # an offer carries the image: a large one takes a moment to decode
CONNECT_TIMEOUT_S = 10.0  # from the answer to the peer connected
STOP_TIMEOUT_S = 5.0  # /stop at the end: the server frees the session even if it never comes


class Refused(RuntimeError):
    """The server answered the request with an error: `sentence` is its own words."""

    def __init__(self, url: str, status: int, sentence: str, retry_after_s: float | None):
        super().__init__(f"charrun at {url}: {sentence} (HTTP {status})")
        self.status, self.sentence, self.retry_after_s = status, sentence, retry_after_s


class Unreachable(ConnectionError):
    """No session could be opened: the server does not answer, answers but not as charrun
    --serve does, or its peer never connected."""


@dataclass(frozen=True)
class EngineInfo:
    """What /status says of the loaded engine: the frames and speech the session carries."""
    family: str
    preset: str
    fps: int
    width: int
    height: int
    sample_rate: int
    frames_per_step: int

    @classmethod
    def of(cls, status: dict, url: str) -> "EngineInfo":
        """The engine of the server at `url` by its /status; Unreachable if that does not
        read as charrun --serve's."""
        try:
            e = status["engine"]
            return cls(str(e["family"]), str(e["preset"]), int(e["fps"]), int(e["width"]),
                       int(e["height"]), int(e["sample_rate"]), int(e["frames_per_step"]))
        except (KeyError, TypeError, ValueError) as err:
            raise not_charrun(url, f"its /status names no engine ({type(err).__name__}: "
                                   f"{err})") from None

    @property
    def step_s(self) -> float:
        """One step's (chunk's) video time: what a barge-in may still play."""
        return self.frames_per_step / self.fps


def retry_after_s(header: str | None) -> float | None:
    """A Retry-After header's seconds; None without one or for its date form."""
    try:
        return float(header) if header else None
    except ValueError:
        return None


def not_charrun(url: str, what: str) -> Unreachable:
    return Unreachable(f"{url} answers, but not as charrun --serve does: {what}; is it the "
                       "address of charrun --serve's page?")


async def engine_info(url: str, timeout_s: float = HTTP_TIMEOUT_S) -> EngineInfo:
    """What the server at `url` serves (a bot sizes its video output by it); Refused or
    Unreachable as `CharacterClient.open`."""
    client = CharacterClient(url, on_video=None, on_audio=None, http_timeout_s=timeout_s)
    try:
        return EngineInfo.of(await client._request("GET", "status"), client.url)
    finally:
        await client.close(tell_server=False)


def image_data_url(image: str | Path | bytes | None) -> tuple[str | None, str | None]:
    """(data URL, file name) of the reference image: a path or the file's bytes (None: the
    server's grey frame)."""
    if image is None:
        return None, None
    if isinstance(image, (str, Path)):
        path = Path(image)
        data, name = path.read_bytes(), path.name
    else:
        data, name = bytes(image), None
    return "data:application/octet-stream;base64," + base64.b64encode(data).decode(), name


class SpeechTrack(MediaStreamTrack):
    """The audio the bot sends: 16-bit mono samples at the engine's rate, given by `push`,
    sent in SPEECH_FRAME_S frames paced at real time from the first one, silence where
    nothing waits (the server hears a microphone: speech, then quiet between turns). Speech
    that follows silence goes once SPEECH_LEAD_S of it waits or it has waited that long, and
    goes on while it comes in time; a frame that finds too little waiting sends what there is
    and the track holds the next speech for the lead again. After `clear` (a barge-in)
    SILENCE_AFTER_CLEAR silent frames go first, whatever is pushed meanwhile: the server's
    sign that what follows was said after the barge-in. `clock` and `sleep` are the ones its
    pacing reads and waits on."""

    kind = "audio"

    def __init__(self, sample_rate: int, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable] = asyncio.sleep):
        super().__init__()
        self.rate, self.clock, self.sleep = sample_rate, clock, sleep
        self.chunk = round(sample_rate * SPEECH_FRAME_S)
        self.lead = round(sample_rate * SPEECH_LEAD_S)
        self.waiting: collections.deque[np.ndarray] = collections.deque()
        self.queued = 0  # samples waiting
        self.sent = 0  # samples sent (the next frame's pts)
        self.t0: float | None = None
        self.silence_owed = 0  # frames of silence before the next speech (after a clear)
        self.speaking = False  # sending speech that has come in time since its lead
        self.held_since: float | None = None  # when speech after silence was first held

    def push(self, pcm: np.ndarray) -> None:
        pcm = np.asarray(pcm, dtype=np.int16).reshape(-1)
        if pcm.size:
            self.waiting.append(pcm)
            self.queued += pcm.size

    def clear(self) -> int:
        """Drop what waits (a barge-in); returns how many samples."""
        dropped, self.queued = self.queued, 0
        self.waiting.clear()
        self.silence_owed = SILENCE_AFTER_CLEAR
        self.speaking, self.held_since = False, None
        return dropped

    @property
    def queued_s(self) -> float:
        return self.queued / self.rate

    def _take(self, n: int) -> np.ndarray:
        out = np.zeros(n, np.int16)
        at = 0
        while at < n and self.waiting:
            head = self.waiting[0]
            k = min(n - at, head.size)
            out[at: at + k] = head[:k]
            at += k
            if k == head.size:
                self.waiting.popleft()
            else:
                self.waiting[0] = head[k:]
        self.queued -= at
        return out

    def _speak(self, now: float) -> bool:
        """Whether this frame sends speech: some waits, and either speech is going on or its
        lead has gathered (SPEECH_LEAD_S of it, or held that long)."""
        if not self.queued:
            self.held_since = None
            return False
        if self.speaking:
            return True
        if self.held_since is None:
            self.held_since = now
        if self.queued >= self.lead or now - self.held_since >= SPEECH_LEAD_S:
            self.held_since = None
            return True
        return False

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        now = self.clock()
        if self.t0 is None:
            self.t0 = now
        wait = self.t0 + self.sent / self.rate - now
        if wait > 0:
            await self.sleep(wait)
        if self.silence_owed:
            self.silence_owed -= 1
            pcm = np.zeros(self.chunk, np.int16)
        elif self._speak(self.clock()):
            self.speaking = self.queued >= self.chunk  # else it ran short: hold the next
            pcm = self._take(self.chunk)
        else:
            pcm = np.zeros(self.chunk, np.int16)
        frame = av.AudioFrame.from_ndarray(pcm[None], format="s16", layout="mono")
        frame.sample_rate = self.rate
        frame.pts, frame.time_base = self.sent, Fraction(1, self.rate)
        self.sent += self.chunk
        return frame


VideoSink = Callable[[av.VideoFrame], Awaitable[None]]
AudioSink = Callable[[av.AudioFrame], Awaitable[None]]


class CharacterClient:
    """One session on the server at `url` (the page's address, e.g. http://127.0.0.1:8080/).

    `open` asks /status for the engine, sends the offer (image, prompt, the speech track) and
    waits for the peer to connect; the character's frames go to `on_video` and `on_audio`
    (awaited in order, one task per track), the server's events to `on_event`, and the end
    of a session the caller did not close to `on_lost(sentence)`. `say` queues speech (16-bit
    mono at `info.sample_rate`), `interrupt` is a barge-in, `close` ends the session."""

    def __init__(self, url: str, image: str | Path | bytes | None = None,
                 prompt: str | None = None, *, on_video: VideoSink, on_audio: AudioSink,
                 on_event: Callable[[dict], None] = lambda event: None,
                 on_lost: Callable[[str], None] = lambda why: None,
                 ice_servers: tuple[str, ...] = (), connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 http_timeout_s: float = HTTP_TIMEOUT_S):
        self.url = url if url.endswith("/") else url + "/"
        self.image, self.image_name = image_data_url(image)
        self.prompt = prompt
        self.on_video, self.on_audio, self.on_event, self.on_lost = \
            on_video, on_audio, on_event, on_lost
        self.ice = [RTCIceServer(urls=u) for u in ice_servers]
        self.connect_timeout_s = connect_timeout_s
        self.timeout = aiohttp.ClientTimeout(total=http_timeout_s)
        self.http: aiohttp.ClientSession | None = None
        self.pc: RTCPeerConnection | None = None
        self.speech: SpeechTrack | None = None
        self.info: EngineInfo | None = None
        self.session: str | None = None
        self.tasks: list[asyncio.Task] = []
        self.closing = False

    async def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        if self.http is None:
            self.http = aiohttp.ClientSession(timeout=self.timeout)
        try:
            async with self.http.request(method, self.url + path, json=body) as r:
                try:
                    answer = await r.json(content_type=None)
                except (json.JSONDecodeError, aiohttp.ContentTypeError, UnicodeDecodeError):
                    answer = None
                if not isinstance(answer, dict):
                    if r.status == 200:
                        raise not_charrun(self.url, f"/{path} is not a JSON object")
                    said = (await r.text())[:200] if answer is None else str(answer)[:200]
                    answer = {"error": said or r.reason}
                if r.status != 200:
                    retry = r.headers.get("Retry-After")
                    raise Refused(self.url, r.status, str(answer.get("error", r.reason)),
                                  retry_after_s(retry))
                return answer
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            raise Unreachable(f"charrun at {self.url} does not answer "
                              f"({type(e).__name__}: {e}); is `charrun --serve` running "
                              "there?") from None

    async def open(self) -> EngineInfo:
        """A session, connected; Refused or Unreachable (nothing left open) otherwise."""
        self.closing = False
        try:
            return await self._open()
        except BaseException:
            await self.close(tell_server=self.session is not None)
            raise

    async def _open(self) -> EngineInfo:
        self.info = EngineInfo.of(await self._request("GET", "status"), self.url)
        self.pc = pc = RTCPeerConnection(RTCConfiguration(iceServers=self.ice))
        self.speech = SpeechTrack(self.info.sample_rate)
        pc.addTransceiver(self.speech, direction="sendrecv")
        pc.addTransceiver("video", direction="recvonly")
        events = pc.createDataChannel("events")
        connected = asyncio.Event()

        @pc.on("track")
        def on_track(track):
            sink = self.on_video if track.kind == "video" else self.on_audio
            self.tasks.append(asyncio.ensure_future(self._pump(track, sink)))

        @pc.on("connectionstatechange")
        def on_state():
            if pc.connectionState == "connected":
                connected.set()
            elif pc.connectionState in ("failed", "closed") and not self.closing:
                self._lost(f"the connection to charrun at {self.url} was lost "
                           f"({pc.connectionState})")

        @events.on("message")
        def on_message(message):
            try:
                event = json.loads(message)
            except (TypeError, json.JSONDecodeError):
                return
            if not isinstance(event, dict):
                return
            if event.get("type") == "error":
                self._lost(f"charrun at {self.url}: {event.get('message')}")
            elif event.get("type") == "ended" and not self.closing:
                self._lost(f"charrun at {self.url} ended the session")
            self.on_event(event)

        await pc.setLocalDescription(await pc.createOffer())
        offer = {"sdp": pc.localDescription.sdp, "type": "offer", "prompt": self.prompt,
                 "image": self.image, "image_name": self.image_name}
        answer = await self._request("POST", "offer", offer)
        if not all(isinstance(answer.get(k), str) for k in ("session", "sdp", "type")):
            raise not_charrun(self.url, "its answer to the offer has no session, sdp and type")
        self.session = answer["session"]
        events.on("open", lambda: events.send(json.dumps({"type": "hello",
                                                          "session": self.session})))
        await pc.setRemoteDescription(RTCSessionDescription(answer["sdp"], answer["type"]))
        try:
            await asyncio.wait_for(connected.wait(), self.connect_timeout_s)
        except asyncio.TimeoutError:
            raise Unreachable(f"charrun at {self.url} answered, but its media did not connect "
                              f"within {self.connect_timeout_s:g} s") from None
        return self.info

    def _lost(self, why: str) -> None:
        if not self.closing:
            self.closing = True  # told once
            self.on_lost(why)

    async def _pump(self, track, sink) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            await sink(frame)

    def say(self, pcm: np.ndarray) -> None:
        if self.speech is not None:
            self.speech.push(pcm)

    async def interrupt(self) -> int:
        """A barge-in: the speech not yet sent is dropped here, the rest and the frames not
        yet played at the server. Returns the samples dropped here."""
        dropped = self.speech.clear() if self.speech is not None else 0
        if self.session is not None and not self.closing:
            try:
                # the speech already sent is dropped at the server up to the silence this
                # track sends from now on
                await self._request("POST", "interrupt", {"session": self.session,
                                                          "in_flight": "drop"})
            except (Refused, Unreachable) as e:
                log.warning("interrupt: %s", e)
        return dropped

    async def close(self, tell_server: bool = True) -> None:
        """End the session (the server frees its place) and everything opened for it."""
        self.closing = True
        session, self.session = self.session, None
        if tell_server and session is not None:
            try:
                await asyncio.wait_for(self._request("POST", "stop", {"session": session}),
                                       STOP_TIMEOUT_S)
            except (Refused, Unreachable, asyncio.TimeoutError) as e:
                log.info("stop: %s", e)  # already ended there (404), or the server has gone
        if self.speech is not None:
            self.speech.stop()
        if self.pc is not None:
            await self.pc.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()
        self.pc = self.speech = None
        if self.http is not None:
            await self.http.close()
            self.http = None
