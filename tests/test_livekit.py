"""The LiveKit avatar contract (charengine[livekit]): CharacterVideoGenerator driven by a real
AvatarRunner and QueueAudioOutput, against a stand-in room (no LiveKit server can run here).
Tests against a real server are opt-in: they run only when LIVEKIT_URL is set."""

import asyncio
import json
import os
import time

import numpy as np
import pytest
import torch

lk = pytest.importorskip("livekit.agents.voice.avatar")
from livekit import rtc  # noqa: E402

from charengine.runtime.engine import Engine  # noqa: E402
from charengine.runtime.livekit_avatar import CharacterVideoGenerator, frame_samples  # noqa: E402
from charengine.runtime.worker import Worker  # noqa: E402
from engines import build_target  # noqa: E402

LISTENED_FRAMES = 12  # half a second at 24 fps: long enough for speech to come back, were it to


class Publication:
    async def wait_for_subscription(self):
        return None


class LocalParticipant:
    identity = "charengine-avatar"

    def __init__(self):
        self.published = []

    async def publish_track(self, track, options):
        self.published.append((track.name, options.source))
        return Publication()


class Room(rtc.EventEmitter):
    """What AvatarRunner uses of rtc.Room: connection state, events, track publishing."""

    name = "test-room"

    def __init__(self):
        super().__init__()
        self.local_participant = LocalParticipant()

    def isconnected(self):
        return True


class Tap(lk.VideoGenerator):
    """Records what the generator hands the runner, with the time of each item."""

    def __init__(self, gen):
        self.gen, self.items = gen, []

    async def push_audio(self, frame):
        await self.gen.push_audio(frame)

    def clear_buffer(self):
        return self.gen.clear_buffer()

    def __aiter__(self):
        return self._it()

    async def _it(self):
        async for item in self.gen:
            self.items.append((time.monotonic(), item))
            yield item


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    return Worker(Engine.load(build_target(tmp_path_factory.mktemp("eng"))))


def tone(seconds, rate, chunk_ms=10):
    n = int(rate * chunk_ms / 1000)
    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype(np.int16)
    return [rtc.AudioFrame(pcm[i: i + n].tobytes(), rate, 1, n) for i in range(0, pcm.size, n)]


async def until(pred, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        await asyncio.sleep(0.01)
    return pred()


def after_listening(items, t_clear) -> list | None:
    """The items from the first listening frame (video with no audio after it) after a
    barge-in on, None before one: the frames the barge-in found in flight may still play,
    then the character listens."""
    after = [x for t, x in items if t > t_clear]
    k = next((k for k, x in enumerate(after) if isinstance(x, rtc.VideoFrame) and
              (k + 1 == len(after) or isinstance(after[k + 1], rtc.VideoFrame))), None)
    return None if k is None else after[k:]


def listened_for(items, t_clear, frames: int) -> bool:
    """Whether `frames` video frames have followed the first listening frame after a
    barge-in (the time speech had to come back in, were it to)."""
    rest = after_listening(items, t_clear)
    return rest is not None and sum(isinstance(x, rtc.VideoFrame) for x in rest) > frames


def silent_after_the_clear(items, t_clear) -> bool:
    """Whether, once the first listening frame follows a barge-in, no speech follows it."""
    rest = after_listening(items, t_clear)
    return rest is not None and not any(isinstance(x, rtc.AudioFrame) for x in rest)


def test_audio_per_frame_must_divide_the_frame_rate():
    assert frame_samples(24000, 24) == 1000 and frame_samples(48000, 24) == 2000
    with pytest.raises(ValueError, match="16000 Hz does not divide"):
        frame_samples(16000, 24)


def test_the_agents_audio_loses_no_sample_across_rates_and_drops_what_it_cannot_take(
        worker, caplog):
    """A turn whose audio changes rate twice reaches the session whole (each resampler's
    last samples handed on before the next, the last at the turn's end); frames at 1 Hz or
    of five channels are dropped with one line."""
    said = []

    async def scenario():
        gen = CharacterVideoGenerator(worker, torch.rand(3, 64, 64), audio_rate=24000)
        gen.session.say = lambda samples: said.append(samples.numel())  # what it would queue
        bad = [rtc.AudioFrame(bytes(2 * 160), 1, 1, 160),
               rtc.AudioFrame(bytes(2 * 5 * 160), 48000, 5, 160)]
        for f in tone(0.5, 24000) + bad * 3 + tone(0.5, 44100) + tone(0.25, 48000):
            await gen.push_audio(f)
        await gen.push_audio(lk.AudioSegmentEnd())

    with caplog.at_level("WARNING", logger="charengine.livekit"):
        asyncio.run(scenario())
    assert abs(sum(said) - 1.25 * 16000) <= 3, sum(said)
    refused = [r.getMessage() for r in caplog.records]
    assert refused == ["the agent's audio is dropped: 1 Hz, outside 8,000 to 192,000 Hz (send "
                       "it at the usual 16, 24 or 48 kHz)"], refused


@pytest.mark.parametrize("agent_rate", [24000, 44100])
def test_turn_plays_then_segment_end_then_listening(worker, agent_rate):
    async def scenario():
        room = Room()
        gen = CharacterVideoGenerator(worker, torch.rand(3, 64, 64), audio_rate=24000)
        await gen.start()
        tap = Tap(gen)
        audio = lk.QueueAudioOutput(sample_rate=agent_rate)
        finished = []
        audio.on("playback_finished", finished.append)
        runner = lk.AvatarRunner(room, audio_recv=audio, video_gen=tap, options=gen.options())
        await runner.start()
        await until(lambda: len(tap.items) >= 12, 20)  # listening frames before the turn
        for f in tone(1.0, agent_rate):
            await audio.capture_frame(f)
        audio.flush()
        ok = await until(lambda: any(isinstance(x, lk.AudioSegmentEnd) for _, x in tap.items), 20)
        await until(lambda: finished, 30)
        n_before = len(tap.items)
        await until(lambda: sum(isinstance(x, rtc.VideoFrame)
                                for _, x in tap.items[n_before:]) >= LISTENED_FRAMES, 60)
        after = tap.items[n_before:]
        await runner.aclose()
        await gen.aclose()
        return ok, tap.items, after, finished, room

    ok, items, after, finished, room = asyncio.run(scenario())
    assert ok
    kinds = [type(x).__name__ for _, x in items]
    end = kinds.index("AudioSegmentEnd")
    audio_frames = [x for _, x in items[:end] if isinstance(x, rtc.AudioFrame)]
    assert all(f.samples_per_channel == 1000 and f.sample_rate == 24000 for f in audio_frames)
    # every audio frame follows its video frame
    for i, k in enumerate(kinds[:end]):
        if k == "AudioFrame":
            assert kinds[i - 1] == "VideoFrame"
    played = len(audio_frames) / 24
    assert 1.0 <= played <= 1.0 + 1 / 6 + 1e-6  # the turn, rounded up to whole steps
    assert kinds[:end].count("VideoFrame") >= len(audio_frames) + 12
    # back to listening: video keeps coming, without audio
    assert sum(isinstance(x, rtc.VideoFrame) for _, x in after) >= LISTENED_FRAMES
    assert not any(isinstance(x, rtc.AudioFrame) for _, x in after)
    assert len(finished) == 1 and not finished[0].interrupted
    assert finished[0].playback_position == pytest.approx(played, abs=1e-3)
    assert [s for _, s in room.local_participant.published] == [
        rtc.TrackSource.SOURCE_MICROPHONE, rtc.TrackSource.SOURCE_CAMERA]


def test_clear_buffer_is_a_barge_in(worker):
    async def scenario():
        gen = CharacterVideoGenerator(worker, torch.rand(3, 64, 64), audio_rate=48000)
        await gen.start()
        tap = Tap(gen)
        audio = lk.QueueAudioOutput(sample_rate=48000)
        finished = []
        audio.on("playback_finished", finished.append)
        runner = lk.AvatarRunner(Room(), audio_recv=audio, video_gen=tap, options=gen.options())
        await runner.start()
        for f in tone(5.0, 48000):
            await audio.capture_frame(f)
        await until(lambda: sum(isinstance(x, rtc.AudioFrame) for _, x in tap.items) >= 24, 20)
        t_clear = time.monotonic()
        audio.clear_buffer()
        await until(lambda: finished, 30)
        # half a second of frames once it listens, however fast this machine plays them
        await until(lambda: listened_for(tap.items, t_clear, LISTENED_FRAMES), 60)
        await runner.aclose()
        await gen.aclose()
        return t_clear, tap.items, finished

    t_clear, items, finished = asyncio.run(scenario())
    voiced = [t for t, x in items if isinstance(x, rtc.AudioFrame)]
    assert all(x.samples_per_channel == 2000 for _, x in items if isinstance(x, rtc.AudioFrame))
    assert silent_after_the_clear(items, t_clear)  # how soon: scripts/bench_bargein.py
    assert len(voiced) < 24 * 5  # the rest of the 5 s turn was dropped
    assert listened_for(items, t_clear, LISTENED_FRAMES)  # listening
    assert len(finished) == 1 and finished[0].interrupted


def test_livekit_worker_without_a_server_says_what_is_missing(tmp_path):
    import subprocess
    import sys

    engine = build_target(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVEKIT_")}
    r = subprocess.run([sys.executable, "-m", "charengine.runtime.cli", "--engine", str(engine),
                        "--livekit"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "set LIVEKIT_URL, LIVEKIT_API_KEY, LIVEKIT_API_SECRET" in r.stderr


@pytest.mark.skipif(not os.environ.get("LIVEKIT_URL"), reason="needs a LiveKit server (LIVEKIT_URL)")
def test_dispatched_worker_joins_and_publishes_video(tmp_path):
    """Against a real server: charrun --livekit registers; a dispatch to a new room brings
    the avatar in, publishing its video."""
    import json
    import subprocess
    import sys
    import uuid

    from livekit import api

    engine = build_target(tmp_path)
    room_name = f"charengine-test-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([sys.executable, "-m", "charengine.runtime.cli", "--engine",
                             str(engine), "--livekit"])

    async def scenario():
        async with api.LiveKitAPI() as lkapi:
            await lkapi.room.create_room(api.CreateRoomRequest(name=room_name))
            await asyncio.sleep(5)  # the worker registers
            await lkapi.agent_dispatch.create_dispatch(api.CreateAgentDispatchRequest(
                agent_name="charengine-avatar", room=room_name,
                metadata=json.dumps({"identity": "charengine-avatar"})))
            token = (api.AccessToken().with_identity("tester")
                     .with_grants(api.VideoGrants(room_join=True, room=room_name)).to_jwt())
            room = rtc.Room()
            await room.connect(os.environ["LIVEKIT_URL"], token)
            try:
                ok = await until(lambda: any(
                    p.identity == "charengine-avatar" and any(
                        t.kind == rtc.TrackKind.KIND_VIDEO for t in p.track_publications.values())
                    for p in room.remote_participants.values()), 60)
            finally:
                await room.disconnect()
                await lkapi.room.delete_room(api.DeleteRoomRequest(room=room_name))
            return ok

    try:
        assert asyncio.run(scenario())
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_data_stream_mode_turn_and_barge_in_over_rpc_and_byte_streams(worker):
    """The agent's DataStreamAudioOutput sends speech as byte streams to the avatar's
    DataStreamAudioReceiver; playback-finished and clear_buffer travel as RPCs."""
    from livekit_loopback import pair

    async def scenario():
        agent_room, avatar_room = pair()
        gen = CharacterVideoGenerator(worker, torch.rand(3, 64, 64), audio_rate=24000)
        await gen.start()
        tap = Tap(gen)
        receiver = lk.DataStreamAudioReceiver(avatar_room, sender_identity="agent")
        runner = lk.AvatarRunner(avatar_room, audio_recv=receiver, video_gen=tap,
                                 options=gen.options())
        await runner.start()
        out = lk.DataStreamAudioOutput(agent_room, destination_identity="charengine-avatar",
                                       sample_rate=24000)
        finished = []
        out.on("playback_finished", finished.append)
        for f in tone(1.0, 24000):
            await out.capture_frame(f)
        out.flush()
        await until(lambda: finished, 20)
        first_turn = list(tap.items)
        for f in tone(5.0, 24000):
            await out.capture_frame(f)
        await until(lambda: sum(isinstance(x, rtc.AudioFrame) for _, x in tap.items)
                    >= sum(isinstance(x, rtc.AudioFrame) for _, x in first_turn) + 24, 20)
        t_clear = time.monotonic()
        out.clear_buffer()
        await until(lambda: len(finished) >= 2, 30)
        await until(lambda: listened_for(tap.items, t_clear, LISTENED_FRAMES), 60)
        await runner.aclose()
        await gen.aclose()
        return first_turn, tap.items, finished, t_clear, avatar_room

    first_turn, items, finished, t_clear, avatar_room = asyncio.run(scenario())
    kinds = [type(x).__name__ for _, x in first_turn]
    assert "AudioSegmentEnd" in kinds
    played = sum(k == "AudioFrame" for k in kinds[: kinds.index("AudioSegmentEnd")]) / 24
    assert 1.0 <= played <= 1.0 + 1 / 6 + 1e-6
    assert not finished[0].interrupted
    assert finished[0].playback_position == pytest.approx(played, abs=1e-3)
    assert len(finished) >= 2 and finished[1].interrupted
    assert silent_after_the_clear(items, t_clear)
    assert avatar_room.local_participant.published == [rtc.TrackSource.SOURCE_MICROPHONE,
                                                       rtc.TrackSource.SOURCE_CAMERA]


def test_data_stream_worker_job_serves_the_dispatched_character(worker):
    """What charrun --livekit runs in a joined room: the image from the dispatch metadata,
    the agent's audio from byte streams, playback reports back over RPC."""
    import base64

    from charengine.runtime.livekit_avatar import serve_room
    from engines import ROOT
    from livekit_loopback import pair

    face = "data:image/png;base64," + base64.b64encode((ROOT / "assets/face.png").read_bytes()).decode()

    async def scenario():
        agent_room, avatar_room = pair()
        job = asyncio.create_task(serve_room(avatar_room, worker, {"image": face, "sender": "agent"}))
        out = lk.DataStreamAudioOutput(agent_room, destination_identity="charengine-avatar",
                                       sample_rate=24000)
        finished = []
        out.on("playback_finished", finished.append)
        await until(lambda: avatar_room.local_participant.published, 20)
        for f in tone(0.5, 24000):
            await out.capture_frame(f)
        out.flush()
        await until(lambda: finished, 20)
        job.cancel()
        try:
            await job
        except asyncio.CancelledError:
            pass
        return finished, avatar_room

    finished, avatar_room = asyncio.run(scenario())
    assert len(finished) == 1 and not finished[0].interrupted
    assert 0.5 <= finished[0].playback_position <= 0.5 + 1 / 6 + 1e-6
    assert rtc.TrackSource.SOURCE_CAMERA in avatar_room.local_participant.published


def test_a_rank_that_dies_ends_the_livekit_job_with_the_error(tmp_path):
    """charrun --livekit on a TP engine: a rank that dies mid-session ends serve_room with
    SessionFailed naming the rank (the job then shuts down with it), and the worker's next
    session runs on fresh ranks."""
    import os
    import signal

    from charengine.runtime.distributed import DistributedWorker
    from charengine.runtime.engine import Engine
    from charengine.runtime.livekit_avatar import SessionFailed, serve_room
    from engines import build_target
    from livekit_loopback import pair

    worker = DistributedWorker(Engine.load(build_target(tmp_path, "cpu-tiny-tp2")))

    async def scenario(kill: bool):
        _, avatar_room = pair()
        job = asyncio.create_task(serve_room(avatar_room, worker, {"sender": "agent"}))
        await until(lambda: avatar_room.local_participant.published, 30)
        if not kill:
            await asyncio.sleep(1.0)
            job.cancel()
            try:
                await job
            except asyncio.CancelledError:
                pass
            return None
        os.kill(worker.ctx.processes[0].pid, signal.SIGKILL)
        try:
            await asyncio.wait_for(job, 30)
        except SessionFailed as e:
            return str(e)
        return "no error"

    try:
        said = asyncio.run(scenario(kill=True))
        assert said is not None and "rank 1 died (exit -9)" in said, said
        asyncio.run(scenario(kill=False))  # fresh ranks
        assert worker.alive()
    finally:
        worker.close()


def test_a_livetalk_avatar_publishes_16fps_frames_each_with_its_audio(tmp_path):
    lt = Worker(Engine.load(build_target(tmp_path, "cpu-tiny-livetalk")))

    async def scenario():
        room = Room()
        gen = CharacterVideoGenerator(lt, torch.rand(3, 64, 64), audio_rate=48000)
        await gen.start()
        tap = Tap(gen)
        audio = lk.QueueAudioOutput(sample_rate=48000)
        runner = lk.AvatarRunner(room, audio_recv=audio, video_gen=tap, options=gen.options())
        await runner.start()
        await until(lambda: len(tap.items) >= 9, 30)
        for f in tone(1.0, 48000):
            await audio.capture_frame(f)
        audio.flush()
        ok = await until(lambda: any(isinstance(x, lk.AudioSegmentEnd)
                                     for _, x in tap.items), 30)
        await runner.aclose()
        await gen.aclose()
        return ok, tap.items, gen.options()

    ok, items, options = asyncio.run(scenario())
    assert ok and options.video_fps == 16
    kinds = [type(x).__name__ for _, x in items]
    end = kinds.index("AudioSegmentEnd")
    audio_frames = [x for _, x in items[:end] if isinstance(x, rtc.AudioFrame)]
    assert audio_frames and all(f.samples_per_channel == 3000 for f in audio_frames)  # 48k/16
    for i, k in enumerate(kinds[:end]):
        if k == "AudioFrame":
            assert kinds[i - 1] == "VideoFrame"
    assert 1.0 <= len(audio_frames) / 16 <= 1.0 + 12 / 16 + 1e-6  # whole chunks


class JobRequest:
    """What AvatarJobs.request uses of LiveKit's JobRequest: the job's metadata, accept
    and reject."""

    def __init__(self, metadata: str = "{}"):
        self.job = type("Job", (), {"metadata": metadata})()
        self.answer = None

    async def accept(self, **_):
        self.answer = "accepted"

    async def reject(self):
        self.answer = "rejected"


class JobContext:
    """What AvatarJobs.entrypoint uses of LiveKit's JobContext: the room, the job's
    metadata, connect and shutdown (its reason kept)."""

    def __init__(self, room, metadata: str = '{"sender": "agent"}'):
        self.room, self.job, self.ended = room, type("Job", (), {"metadata": metadata})(), None

    async def connect(self):
        return None

    def shutdown(self, reason=""):
        self.ended = reason


def test_a_worker_of_two_sessions_takes_two_jobs_reports_its_load_and_ends_both(tmp_path):
    """charrun --livekit --sessions 2: LiveKit's requests are accepted while a lane is free
    (a third is rejected), the load reads sessions / 2 (so dispatch spreads jobs), each job
    runs in a lane of its own and publishes the character in its room, and a drain's end()
    stops both jobs; the worker is idle again after."""
    from charengine.runtime.livekit_avatar import AvatarJobs
    from livekit_loopback import pair

    two = Worker(Engine.load(build_target(tmp_path)), sessions=2, over_capacity=True)
    jobs = AvatarJobs(two)

    async def scenario():
        asked = [JobRequest() for _ in range(3)]
        for r in asked:
            await jobs.request(r)
        answers, load = [r.answer for r in asked], jobs.load()
        threshold, full = jobs.load_threshold, jobs.busy()
        rooms = [pair()[1] for _ in range(2)]
        contexts = [JobContext(room) for room in rooms]
        running = [asyncio.create_task(jobs.entrypoint(c)) for c in contexts]
        await until(lambda: all(room.local_participant.published for room in rooms), 30)
        lanes = sorted(jobs.jobs)
        jobs.end("the worker is stopping")
        await asyncio.wait_for(asyncio.gather(*running), 30)
        return answers, load, threshold, full, lanes, contexts

    answers, load, threshold, full, lanes, contexts = asyncio.run(scenario())
    assert answers == ["accepted", "accepted", "rejected"]
    assert load == 1.0 and full and threshold == pytest.approx(0.75)
    assert lanes == [0, 1]
    assert all(c.ended == "charengine: the worker is stopping" for c in contexts)
    assert jobs.load() == 0.0 and not jobs.in_session()


@pytest.mark.parametrize("metadata,says", [
    ("{not json", "not JSON"), ("[1, 2]", "a JSON list, not an object"),
    ('{"image": 5}', "'image' must be a string, not int"),
    ('{"prompt": ["a"]}', "'prompt' must be a string, not list"),
    (json.dumps({"prompt": "a" * 10_001}), "'prompt' is 10,001 characters long; at most"),
    ('{"image": "http://example.com/face.png"}', "image: expected a data: URL"),
    ('{"image": "data:image/png;base64,"}', "image: the file is empty"),
])
def test_a_job_whose_metadata_is_no_character_is_rejected_in_one_line_and_takes_no_place(
        worker, caplog, metadata, says):
    """A dispatch whose metadata does not describe a character is rejected with one line in
    the log; the worker's place stays free (the next good job is accepted)."""
    from charengine.runtime.livekit_avatar import AvatarJobs

    jobs = AvatarJobs(worker)

    async def scenario():
        bad, good = JobRequest(metadata), JobRequest('{"sender": "agent"}')
        await jobs.request(bad)
        active = jobs.active()
        await jobs.request(good)
        return bad.answer, active, good.answer

    assert asyncio.run(scenario()) == ("rejected", 0, "accepted")
    lines = [r.getMessage() for r in caplog.records if r.name == "charengine.livekit"]
    assert len(lines) == 1 and says in lines[0] and "\n" not in lines[0], lines


def test_a_job_whose_image_does_not_read_ends_with_one_line_and_frees_its_place(worker, caplog):
    """An image in the metadata that is no image ends the job (shut down with the reason,
    one line in the log, nothing published) and leaves the worker idle."""
    import base64

    from charengine.runtime.livekit_avatar import AvatarJobs
    from livekit_loopback import pair

    jobs = AvatarJobs(worker)
    damaged = "data:image/png;base64," + base64.b64encode(b"GIF89a no").decode()
    room = pair()[1]
    context = JobContext(room, json.dumps({"image": damaged, "sender": "agent"}))
    asyncio.run(asyncio.wait_for(jobs.entrypoint(context), 30))
    assert context.ended is not None and context.ended.startswith(
        "charengine: the job's image: not an image"), context.ended
    assert "BytesIO" not in context.ended
    assert not room.local_participant.published and not jobs.in_session()
    lines = [r.getMessage() for r in caplog.records if r.name == "charengine.livekit"]
    assert len(lines) == 1 and "not an image" in lines[0], lines
