"""LiveKit Agents integration (the optional extra `charengine[livekit]`): the character as a
LiveKit avatar behind a voice agent.

- `CharacterVideoGenerator`: LiveKit's `VideoGenerator` over a charengine live session. It
  takes the agent's audio frames at any rate from 8 to 192 kHz, mono or stereo (others are
  dropped, the log saying so once), yields paced video frames, each speaking frame followed
  by exactly one frame's worth of audio (1,000 samples at 24 kHz, 2,000 at 48 kHz), an
  `AudioSegmentEnd` once a turn's audio has played, listening frames (video only, so the
  runner's playback position counts the turn's audio alone) between turns, and on
  `clear_buffer` (barge-in) drops the queued audio, the steps not yet started and the frames
  not yet played.
- In-process mode: the agent's audio output is a `QueueAudioOutput` that is also the
  `AvatarRunner`'s receiver (`start_in_process`).
- Data-stream mode: `CharengineAvatarSession` (agent side) dispatches the avatar worker to the
  room and sends it audio with `DataStreamAudioOutput`; `charrun --livekit` runs that worker
  (`run_worker`): it registers with the LiveKit server named by LIVEKIT_URL, LIVEKIT_API_KEY
  and LIVEKIT_API_SECRET, joins each dispatched room with `DataStreamAudioReceiver` and an
  `AvatarRunner`, serves one session at a time (`AvatarJobs`) and reports itself fully
  loaded while it streams, so the server's dispatch spreads sessions over the fleet. Its
  readiness (runtime/probes.py) reads ready once LiveKit has registered it, busy in a job,
  and loading again while its connection to LiveKit is down (it reconnects); SIGTERM tells
  LiveKit it takes no more jobs, lets the job in progress go on within --grace-period, then
  ends it: the turn playing reported interrupted to the agent, the avatar leaving the room.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import os
import signal
import threading
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import av
import numpy as np
import torch
from livekit import api, rtc
from livekit.agents import AgentServer, JobContext, JobExecutorType, JobRequest, WorkerOptions
from livekit.agents.voice.avatar import (AudioSegmentEnd, AvatarOptions, AvatarRunner,
                                         AvatarSession, DataStreamAudioOutput,
                                         DataStreamAudioReceiver, QueueAudioOutput,
                                         VideoGenerator)

from .formats import (ImageFit, MediaError, data_url_bytes, prompt_problem,
                      stream_audio_problem, upload_message)
from .garbage import collect_after_session
from .images import read_image
from .lifecycle import STOP_SIGNALS, Drain, keep_ranks
from .live import LiveSession
from .metrics import Metrics
from .pacer import Step
from .probes import Readiness
from .run_config import livekit_setup_error
from .worker import Worker

log = logging.getLogger("charengine.livekit")
AGENT_NAME = "charengine-avatar"
# how far short of full (in sessions) the load threshold sits: a worker of N lanes reports
# load sessions / N and takes no job at (N - LOAD_THRESHOLD) / N or above
LOAD_THRESHOLD = 0.5
NOTIFY_FLUSH_S = 0.2  # lets the agent's interrupted-playback message leave before the avatar
CLAIM_TIMEOUT_S = 15.0  # an accepted job LiveKit never assigned frees the worker after this
CONNECTION_POLL_S = 0.25  # how often the LiveKit connection's state is read for /readyz
REACH_POLL_S = 2.0  # how often the LiveKit server is tried with a TCP connection of its own
REACH_TIMEOUT_S = 2.0  # how long that connection may take to open


class LiveKitSetupError(RuntimeError):
    pass


class SessionFailed(RuntimeError):
    """The live session behind the avatar failed (a rank died): the job ends with it."""


class BadDispatch(ValueError):
    """A job's dispatch metadata that does not describe a character (one line)."""


DISPATCH_FIELDS = ("image", "prompt", "identity", "sender")  # strings where given


def dispatch_metadata(text: str | None) -> dict:
    """The character a job's dispatch metadata describes, as CharengineAvatarSession writes
    it: a JSON object whose fields image (a data: URL), prompt, identity and sender are
    strings where given (others are ignored); BadDispatch naming the first that is not."""
    try:
        meta = json.loads(text or "{}")
    except (json.JSONDecodeError, RecursionError):
        raise BadDispatch("the job's metadata is not JSON") from None
    if not isinstance(meta, dict):
        raise BadDispatch(f"the job's metadata is a JSON {type(meta).__name__}, not an "
                          "object")
    for key in DISPATCH_FIELDS:
        if meta.get(key) is not None and not isinstance(meta[key], str):
            raise BadDispatch(f"the job's metadata: '{key}' must be a string, not "
                              f"{type(meta[key]).__name__}")
    if (why := prompt_problem(meta.get("prompt") or "")) is not None:
        raise BadDispatch(f"the job's metadata: 'prompt' {why}")
    dispatch_image(meta)
    return meta


def dispatch_image(meta: dict) -> bytes | None:
    """The bytes of the image a job's metadata carries as a data: URL (None: none given);
    BadDispatch where it is no data: URL or holds nothing."""
    try:
        return data_url_bytes(meta.get("image"), "the job's image")
    except MediaError as e:
        raise BadDispatch(str(e)) from None


def frame_samples(rate: int, fps: int) -> int:
    if rate % fps:
        raise ValueError(f"audio at {rate} Hz does not divide into {fps} fps frames; use a rate "
                         f"that is a multiple of {fps} (24000 or 48000)")
    return rate // fps


class CharacterVideoGenerator(VideoGenerator):
    def __init__(self, worker: Worker, image: torch.Tensor, prompt: str = "", *,
                 audio_rate: int = 24000, slack: int = 2, metrics: Metrics | None = None):
        spec = worker.spec
        self.worker, self.image, self.prompt = worker, image, prompt
        self.rate, self.fps = audio_rate, spec.fps
        self.spf = frame_samples(audio_rate, spec.fps)
        self.width, self.height = spec.out_w, spec.out_h
        self.loop = asyncio.get_running_loop()
        self.out: asyncio.Queue = asyncio.Queue()
        self.failed: asyncio.Future = self.loop.create_future()
        self.session = LiveSession(worker, self._publish, slack, metrics,
                                   on_step_done=self._step_done,
                                   on_error=lambda msg: self.loop.call_soon_threadsafe(
                                       self._fail, msg))
        # the agent's audio: one resampler, for the rate and channels it comes in (a change
        # hands on the old one's last samples first); audio it cannot take is dropped, said once
        self._in_key: tuple[int, int] | None = None
        self._in_rs: av.AudioResampler | None = None
        self._refused = False
        self._out_rs = av.AudioResampler(format="s16", layout="mono", rate=audio_rate)
        self._fifo = np.zeros(0, dtype=np.int16)
        self.started = False

    def options(self) -> AvatarOptions:
        return AvatarOptions(video_width=self.width, video_height=self.height,
                             video_fps=self.fps, audio_sample_rate=self.rate, audio_channels=1)

    async def start(self) -> None:
        await self.loop.run_in_executor(None, self.session.start, self.image, self.prompt)
        self.started = True

    async def aclose(self) -> None:
        await self.loop.run_in_executor(None, self.session.stop)

    # ---- VideoGenerator --------------------------------------------------------------
    async def push_audio(self, frame: rtc.AudioFrame | AudioSegmentEnd) -> None:
        if isinstance(frame, AudioSegmentEnd):
            self._flush_input()  # the turn's last samples, held in the resampler
            self.session.end_turn()
            return
        key = (frame.sample_rate, frame.num_channels)
        problem = stream_audio_problem(*key)
        if problem is not None:
            if not self._refused:
                log.warning("the agent's audio is dropped: %s", problem)
            self._refused = True
            return
        if key != self._in_key:
            self._flush_input()
            self._in_key = key
            self._in_rs = av.AudioResampler(format="flt", layout="mono",
                                            rate=self.worker.spec.side.sample_rate)
        pcm = np.frombuffer(frame.data, dtype=np.int16).reshape(1, -1)
        af = av.AudioFrame.from_ndarray(pcm, format="s16",
                                        layout="mono" if frame.num_channels == 1 else "stereo")
        af.sample_rate = frame.sample_rate
        self._say(self._in_rs.resample(af))

    def _flush_input(self) -> None:
        if self._in_rs is not None:
            self._say(self._in_rs.resample(None))
        self._in_key = self._in_rs = None

    def _say(self, frames: list[av.AudioFrame]) -> None:
        for f in frames:
            self.session.say(torch.from_numpy(f.to_ndarray().reshape(-1).copy()))

    def clear_buffer(self) -> None:
        self._in_key = self._in_rs = None  # what the resampler holds is the dropped turn's
        self.session.interrupt()

    def __aiter__(self) -> AsyncIterator[rtc.VideoFrame | rtc.AudioFrame | AudioSegmentEnd]:
        return self._frames()

    def _fail(self, message: str) -> None:
        if not self.failed.done():
            self.failed.set_result(message)
        self.out.put_nowait(SessionFailed(message))

    async def _frames(self):
        while True:
            item = await self.out.get()
            if isinstance(item, SessionFailed):
                return  # the runner's stream ends; serve_room raises the failure
            yield item

    # ---- the pacer's thread ----------------------------------------------------------
    def _publish(self, frame: torch.Tensor, audio: torch.Tensor, t: float, voiced: bool) -> None:
        rgba = torch.cat([frame.clamp(0, 1), torch.ones_like(frame[:1])])
        rgba = (rgba * 255).round().to(torch.uint8).permute(1, 2, 0).contiguous().numpy()
        video = rtc.VideoFrame(self.width, self.height, rtc.VideoBufferType.RGBA, rgba.tobytes())
        self.loop.call_soon_threadsafe(self.out.put_nowait, video)
        if not voiced:  # listening: no audio, and the resampler starts afresh next turn
            if self._fifo.size:
                self._out_rs = av.AudioResampler(format="s16", layout="mono", rate=self.rate)
                self._fifo = np.zeros(0, dtype=np.int16)
            return
        af = av.AudioFrame.from_ndarray(audio.float().numpy().reshape(1, -1), format="flt",
                                        layout="mono")
        af.sample_rate = self.worker.spec.side.sample_rate
        chunks = [f.to_ndarray().reshape(-1) for f in self._out_rs.resample(af)]
        self._fifo = np.concatenate([self._fifo, *chunks]) if chunks else self._fifo
        pcm = self._fifo[: self.spf]
        self._fifo = self._fifo[self.spf:]
        pcm = np.pad(pcm, (0, self.spf - pcm.size))  # only while the resampler fills
        sound = rtc.AudioFrame(pcm.astype(np.int16).tobytes(), self.rate, 1, self.spf)
        self.loop.call_soon_threadsafe(self.out.put_nowait, sound)

    def _step_done(self, step: Step) -> None:
        if step.segment_end:
            self.loop.call_soon_threadsafe(self.out.put_nowait, AudioSegmentEnd())


async def start_in_process(room: rtc.Room, worker: Worker, image: torch.Tensor, prompt: str = "",
                           *, audio_rate: int = 24000) -> tuple[QueueAudioOutput, AvatarRunner,
                                                                CharacterVideoGenerator]:
    """In-process mode: returns the QueueAudioOutput to set as the agent session's audio
    output (`session.output.audio = audio`), the running AvatarRunner and the generator."""
    gen = CharacterVideoGenerator(worker, image, prompt, audio_rate=audio_rate)
    await gen.start()
    audio = QueueAudioOutput(sample_rate=audio_rate)
    runner = AvatarRunner(room, audio_recv=audio, video_gen=gen, options=gen.options())
    await runner.start()
    return audio, runner, gen


class CharengineAvatarSession(AvatarSession):
    """Agent side of the data-stream mode: dispatch a charengine avatar worker to the room
    and route the agent's speech to it."""

    def __init__(self, image_path: str, prompt: str = "", *, avatar_identity: str = AGENT_NAME,
                 agent_name: str = AGENT_NAME, sample_rate: int = 24000):
        super().__init__()
        with open(image_path, "rb") as f:
            self.image_url = "data:image;base64," + base64.b64encode(f.read()).decode()
        self.prompt, self.agent_name, self.sample_rate = prompt, agent_name, sample_rate
        self._identity = avatar_identity

    @property
    def avatar_identity(self) -> str:
        return self._identity

    @property
    def provider(self) -> str:
        return "charengine"

    async def start(self, agent_session, room: rtc.Room, *, livekit_url: str | None = None,
                    api_key: str | None = None, api_secret: str | None = None) -> None:
        await super().start(agent_session, room)
        metadata = json.dumps({"image": self.image_url, "prompt": self.prompt,
                               "identity": self._identity,
                               "sender": room.local_participant.identity})
        async with api.LiveKitAPI(livekit_url, api_key, api_secret) as lk:
            await lk.agent_dispatch.create_dispatch(api.CreateAgentDispatchRequest(
                agent_name=self.agent_name, room=room.name, metadata=metadata))
        agent_session.output.audio = DataStreamAudioOutput(
            room, destination_identity=self._identity, sample_rate=self.sample_rate,
            wait_remote_track=rtc.TrackKind.KIND_VIDEO)


async def serve_room(room: rtc.Room, worker: Worker, meta: dict, audio_rate: int = 24000,
                     image_fit: ImageFit = ImageFit(), metrics: Metrics | None = None,
                     stop: asyncio.Event | None = None) -> None:
    """The data-stream worker's job in a joined room: the character from the dispatch
    metadata (image as a data URL, prompt, the agent's identity), driven by the agent's audio
    streams, until the runner completes, `stop` is set (the worker drains) or the job is
    cancelled. A session that fails (a rank died) ends the job with SessionFailed, its message
    the cause; an image that does not read ends it with BadDispatch. On `stop`, a turn still
    playing ends as a barge-in ends it, so the agent hears that its speech was interrupted and
    where, before the avatar leaves."""
    spec = worker.spec
    image = torch.full((3, spec.out_h, spec.out_w), 0.5)
    data = dispatch_image(meta)
    if data is not None:
        try:
            image = await asyncio.get_running_loop().run_in_executor(
                None, read_image, data, spec.out_h, spec.out_w, image_fit)
        except MediaError as e:
            raise BadDispatch(f"the job's image: {upload_message(e)}") from None
    gen = CharacterVideoGenerator(worker, image, meta.get("prompt") or "", audio_rate=audio_rate,
                                  metrics=metrics)
    await gen.start()
    receiver = DataStreamAudioReceiver(room, sender_identity=meta.get("sender"))
    runner = AvatarRunner(room, audio_recv=receiver, video_gen=gen, options=gen.options())
    waits = []
    try:
        await runner.start()
        done = asyncio.ensure_future(runner.wait_for_complete())
        stopped = asyncio.ensure_future((stop or asyncio.Event()).wait())
        waits = [done, stopped]
        await asyncio.wait([done, gen.failed, stopped], return_when=asyncio.FIRST_COMPLETED)
        if gen.failed.done():
            raise SessionFailed(gen.failed.result())
        if stopped.done():
            receiver.emit("clear_buffer")  # the runner reports the turn interrupted
            await asyncio.sleep(NOTIFY_FLUSH_S)
    finally:
        for w in waits:
            w.cancel()
        await runner.aclose()
        await gen.aclose()


class AvatarJobs:
    """The worker's LiveKit request and entrypoint functions over its lanes (one session
    each, runtime/lanes.py; a worker without lanes is one): a job is accepted only while a
    lane is free (and the worker not draining, not restarting ranks), the worker reports
    load = sessions / lanes (accepted jobs not yet started counted), so LiveKit dispatches
    elsewhere once it is full, and end() ends every job in progress as a drain does: the
    turn playing reported interrupted to the agent, the job shut down (the avatar leaves the
    room). Jobs run on LiveKit's thread executor: their loop is not the worker's."""

    def __init__(self, worker: Worker, agent_name: str = AGENT_NAME, audio_rate: int = 24000,
                 image_fit: ImageFit = ImageFit(), metrics: Metrics | None = None):
        self.worker, self.agent_name, self.audio_rate = worker, agent_name, audio_rate
        self.image_fit, self.metrics = image_fit, metrics
        self.lanes = getattr(worker, "lanes", None) or [worker]
        self.lock = asyncio.Lock()  # held while the ranks restart (worker's loop)
        self.guard = threading.Lock()  # the counts below, across LiveKit's threads
        self.draining = False
        # lane -> its job's (loop, stop event)
        self.jobs: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Event]] = {}
        self.pending: list[int] = []  # accepted claims not yet started, by number
        self.claims = 0  # accepts so far
        self.reason, self.ending = "", False

    @property
    def capacity(self) -> int:
        return len(self.lanes)

    def active(self) -> int:
        """Jobs running and accepted ones to come."""
        with self.guard:
            return len(self.jobs) + len(self.pending)

    def busy(self) -> bool:
        """Every lane taken (what /readyz calls busy; LiveKit sends no job meanwhile)."""
        return self.active() >= self.capacity

    def in_session(self) -> bool:
        """A job in progress or about to start (what a drain waits for)."""
        return self.active() > 0

    def load(self, *_) -> float:
        return self.active() / self.capacity

    @property
    def load_threshold(self) -> float:
        """LiveKit sends no job at or above it: half a session short of full."""
        return (self.capacity - LOAD_THRESHOLD) / self.capacity

    async def request(self, req: JobRequest) -> None:
        try:
            meta = dispatch_metadata(req.job.metadata)
        except BadDispatch as e:
            log.warning("a job was rejected: %s", e)
            await req.reject()
            return
        with self.guard:
            full = len(self.jobs) + len(self.pending) >= self.capacity
            if not (full or self.draining or self.lock.locked()):
                self.claims += 1
                claim = self.claims
                self.pending.append(claim)
        if full or self.draining or self.lock.locked():
            await req.reject()
            return
        # the claim is freed if LiveKit never assigns the job, an accept that failed included
        asyncio.get_running_loop().call_later(CLAIM_TIMEOUT_S, self._unclaim, claim)
        await req.accept(identity=meta.get("identity") or self.agent_name, name="charengine")

    def _unclaim(self, claim: int) -> None:
        with self.guard:
            if claim in self.pending:
                self.pending.remove(claim)
                log.warning("an accepted job was not assigned within %g s; its place is free "
                            "again", CLAIM_TIMEOUT_S)

    async def entrypoint(self, ctx: JobContext) -> None:
        loop, stop = asyncio.get_running_loop(), asyncio.Event()
        with self.guard:
            if self.pending:
                self.pending.pop(0)
            lane = next((i for i in range(self.capacity) if i not in self.jobs), None)
            if lane is not None:
                self.jobs[lane] = (loop, stop)
        if lane is None:  # LiveKit assigned more jobs than were accepted: no place for it
            ctx.shutdown(reason="charengine: every session of this worker is in progress")
            return
        if self.ending:  # assigned after the drain ended the jobs in progress: leave at once
            stop.set()
        try:
            connect = asyncio.ensure_future(ctx.connect())
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait([connect, stopped], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if not connect.done():  # still joining the room when the drain ended the job
                connect.cancel()
            else:
                connect.result()
                await serve_room(ctx.room, self.lanes[lane],
                                 dispatch_metadata(ctx.job.metadata), self.audio_rate,
                                 self.image_fit, self.metrics, stop)
            if stop.is_set():
                ctx.shutdown(reason=f"charengine: {self.reason}")
        except BadDispatch as e:  # its metadata, or its image, does not read as one
            log.warning("the job in room %s was ended: %s", ctx.room.name, e)
            ctx.shutdown(reason=f"charengine: {e}")
        except SessionFailed as e:
            log.error("session in room %s failed: %s", ctx.room.name, e)
            ctx.shutdown(reason=f"charengine: {e}")
        finally:
            with self.guard:
                self.jobs.pop(lane, None)
            collect_after_session()  # its room's and pipeline's cycles freed now

    def end(self, reason: str) -> None:
        """End every job in progress (any thread)."""
        self.reason, self.ending = reason, True
        with self.guard:
            jobs = list(self.jobs.values())
        for loop, stop in jobs:
            loop.call_soon_threadsafe(stop.set)


def connecting(server: AgentServer) -> bool:
    """Whether the agent server is (re)connecting to LiveKit rather than registered there.
    livekit-agents gives an event for each registration (`worker_registered`) but none for a
    dropped connection, after which it reconnects on its own: its `_connecting` flag is set
    from the start of each connection attempt to the register response (the dropped
    connection test in tests/test_probes.py holds this to the library installed)."""
    return bool(server._connecting)


async def unreachable(url: str, timeout_s: float = REACH_TIMEOUT_S) -> str | None:
    """Why a TCP connection to the LiveKit server at `url` does not open within timeout_s
    (None where it opens)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme in ("wss", "https") else 80)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, port),
                                           timeout_s)
    except (OSError, asyncio.TimeoutError) as e:
        return (e.strerror if isinstance(e, OSError) and e.strerror else str(e)) or \
            f"no answer within {timeout_s:g} s"
    writer.close()
    return None


async def watch_connection(server: AgentServer, readiness: Readiness, registered: asyncio.Event,
                           drain: Drain) -> None:
    """While the worker runs, once LiveKit has registered it: a dropped connection (the
    worker reconnecting) or a LiveKit server that no longer accepts connections (looked at
    every REACH_POLL_S: a server gone without closing the connection goes unnoticed by the
    WebSocket's heartbeat for up to a minute) reads loading on /readyz, saying why (LiveKit
    can send no job meanwhile), and ready again once the connection is back."""
    url = os.environ["LIVEKIT_URL"]
    await registered.wait()
    down, probed, away = None, -math.inf, None
    while not drain.begun:
        await asyncio.sleep(CONNECTION_POLL_S)
        if drain.begun:
            return
        loop_now = asyncio.get_running_loop().time()
        if loop_now - probed >= REACH_POLL_S:
            probed, away = loop_now, await unreachable(url)
        if connecting(server):
            why = f"the connection to the LiveKit server at {url} dropped: reconnecting"
        elif away is not None:
            why = f"the LiveKit server at {url} cannot be reached ({away})"
        else:
            why = None
        if why is not None and down is None and not drain.begun:
            log.warning(why)
            readiness.loading(why)
        elif why is None and down is not None and not drain.begun:
            log.info("the LiveKit server at %s is reachable and the worker registered", url)
            readiness.ready()
        down = why


async def _worker_main(jobs: AvatarJobs, opts: WorkerOptions, readiness: Readiness,
                       drain: Drain) -> None:
    """Run the LiveKit worker until SIGTERM or SIGINT, then drain (runtime/lifecycle.py):
    LiveKit is told the worker is full, the job in progress goes on until it ends or its time
    is up, then ends (jobs.end), and the worker closes."""
    if drain.begun:  # the signal came while the engine loaded: nothing to register
        readiness.draining(f"stopping ({drain.signame})")
        return
    server = AgentServer.from_server_options(opts)
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if drain.begin(sig.name, now=sig == signal.SIGINT):
            jobs.draining = True
            left = drain.session_left_s()
            readiness.draining(f"stopping ({sig.name})" + (
                f": the sessions in progress end within {left:.0f} s"
                if jobs.in_session() and left > 0 else ""))
        wake.set()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    registered = asyncio.Event()

    def on_registered(*_) -> None:
        readiness.ready(jobs.busy, healthy=getattr(jobs.worker, "alive", None))
        registered.set()

    server.on("worker_registered", on_registered)
    readiness.loading(f"registering with the LiveKit server at {os.environ['LIVEKIT_URL']}")
    run = asyncio.ensure_future(server.run())
    woken = asyncio.ensure_future(wake.wait())
    ranks = asyncio.ensure_future(keep_ranks(jobs.worker, readiness, jobs.lock,
                                             jobs.in_session, drain))
    watch = asyncio.ensure_future(watch_connection(server, readiness, registered, drain))
    try:
        await asyncio.wait([run, woken], return_when=asyncio.FIRST_COMPLETED)
        if run.done():
            e = run.exception()
            why = f"{e}" if e else "the worker stopped"
            readiness.failed(f"the LiveKit server at {os.environ['LIVEKIT_URL']}: {why}")
            raise LiveKitSetupError(f"the LiveKit server at {os.environ['LIVEKIT_URL']}: {why}")
        drained = asyncio.ensure_future(server.drain(timeout=None))  # LiveKit: no more jobs
        await drain.until_sessions_end(jobs.in_session)
        if jobs.in_session():
            log.info("stopping: ending the sessions in progress")
        jobs.end("the worker is stopping")  # and any job LiveKit still assigns
        await drained
    finally:
        woken.cancel()
        ranks.cancel()
        watch.cancel()
        await asyncio.gather(ranks, watch, return_exceptions=True)
        await server.aclose()
        if not run.done():
            run.cancel()
        await asyncio.gather(run, return_exceptions=True)


def run_worker(worker: Worker, agent_name: str = AGENT_NAME, audio_rate: int = 24000,
               image_fit: ImageFit = ImageFit(), readiness: Readiness | None = None,
               metrics: Metrics | None = None, drain: Drain | None = None,
               host: str = "127.0.0.1") -> None:
    """charrun --livekit: an avatar worker that serves one session at a time; a session
    that fails ends its job with the error (the room sees the avatar leave) and the next
    one starts on fresh ranks. `readiness` reads ready once LiveKit has registered the
    worker and busy while it has a job; `metrics` are the worker's; `drain` carries
    --grace-period. LiveKit's own health server listens on an ephemeral port of `host`:
    charrun's probe server is the one to probe."""
    error = livekit_setup_error()
    if error:
        raise LiveKitSetupError(error)
    jobs = AvatarJobs(worker, agent_name, audio_rate, image_fit, metrics)
    opts = WorkerOptions(entrypoint_fnc=jobs.entrypoint, request_fnc=jobs.request,
                         agent_name=agent_name, job_executor_type=JobExecutorType.THREAD,
                         load_fnc=jobs.load, load_threshold=jobs.load_threshold, host=host,
                         port=0)
    asyncio.run(_worker_main(jobs, opts, readiness or Readiness(), drain or Drain()))
