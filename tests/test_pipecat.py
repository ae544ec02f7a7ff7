"""charengine.pipecat against the real server on the tiny engine, in a network namespace of the
test's own (WebRTC peers need an address other than loopback): Pipecat pipelines
(scripts/pipecat_turns.py: a TTS-like source, CharacterVideoService, a recording sink) and
the example bot on Pipecat's SmallWebRTCTransport with an aiortc peer as its visitor.

What holds: the character's frames leave the service at the engine's size, as many to a
second of its audio as the engine's fps; its audio is the TTS's speech, delayed (WebRTC
carries it as Opus both ways: equal in loudness, its 10 ms envelope matching at one delay,
not sample for sample); the mouth follows that speech
as docs/QUALITY.md measures it; other frames pass in order and the TTS's own audio does not;
a barge-in ends the speech (within a chunk and the receiver's jitter buffer: measured by
scripts/bench_pipecat.py, not asserted here, as no test asserts a wall-clock figure) and the
next turn plays; EndFrame frees the server's place; a full server is an ErrorFrame with its
sentence, and so is an address that answers but not as charrun --serve."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import av
import numpy as np
import pytest
import soundfile as sf
from PIL import Image

pytest.importorskip("pipecat", reason="the extra `pipecat` is not installed")

from charengine.builder.build import build  # noqa: E402
from charengine.builder.build_config import BuildConfig  # noqa: E402
from netns import can_netns, namespace  # noqa: E402
from tinychar.quality import lip_sync  # noqa: E402
from tinychar.synth import clip  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
PAGE, PROBES, BOT = "http://127.0.0.1:8080/", "http://127.0.0.1:8081/", "http://127.0.0.1:7860/"
SPEECH_S = 4.0
TRAINED = ROOT / "charengine" / "checkpoints" / "tiny.safetensors"  # its mouth follows speech
SEED = 424242  # a clip training never drew
# aiortc's audio jitter buffer holds 4 packets of 20 ms before it plays: audio the server sent
# before a barge-in may still arrive this long after it
INTERRUPT_AFTER_S = 1.0  # the barge-in, this long into a turn's voice
# the TTS's speed where the speech is compared: a burst, as TTS services send a turn, so a
# loaded machine's late TTS frame finds speech waiting (at real time, the service would send
# silence in its place: the speech would come back whole, but at a delay that grows)
TTS_BURST = 4.0
ENVELOPE_S = 0.01


def wait(pred, most_s: float) -> bool:
    end = time.monotonic() + most_s
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """charrun --serve --sessions 1 on the tiny engine in a namespace; a face and a speech
    clip of the kind the tiny character was trained on."""
    if not can_netns():
        pytest.skip("needs root and iproute2 (network namespaces) for WebRTC peers")
    tmp = tmp_path_factory.mktemp("pipecat")
    engine = tmp / "cpu-tiny"
    build(BuildConfig("cpu-tiny", engine, weights=TRAINED), log=lambda s: None)
    c = clip(SPEECH_S, 64, np.random.default_rng(SEED))
    Image.fromarray(c.frames[0]).save(tmp / "face.png")
    sf.write(tmp / "speech.wav", c.audio, c.sample_rate)
    with namespace("charpc", "10.233.6") as name:
        netns = ["ip", "netns", "exec", name]
        server = subprocess.Popen([*netns, sys.executable, "-m", "charengine.runtime.cli",
                                   "--engine", str(engine), "--serve", "--port", "8080",
                                   "--health-port", "8081", "--sessions", "1"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(iter(server.stdout.readline, "")),
                         daemon=True).start()
        try:
            assert wait(lambda: any("serving on" in ln for ln in lines), 120), "".join(lines)
            yield {"netns": netns, "tmp": tmp, "engine": engine, "lines": lines}
        finally:
            server.terminate()
            server.wait(30)
        assert "Traceback" not in "".join(lines), "".join(lines)


def turns(served, *extra: str, npz: str | None = None) -> dict:
    out = ["--out", str(served["tmp"] / npz)] if npz else []
    r = subprocess.run([*served["netns"], sys.executable, str(ROOT / "scripts/pipecat_turns.py"),
                        "--url", PAGE, "--image", str(served["tmp"] / "face.png"), "--speech",
                        str(served["tmp"] / "speech.wav"), "--quiet", *out, *extra],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def status(served) -> dict:
    r = subprocess.run([*served["netns"], sys.executable, "-c",
                        "import json, urllib.request; print(urllib.request.urlopen("
                        f"'{PAGE}status', timeout=10).read().decode())"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def resampled(pcm: np.ndarray, rate: int, to: int) -> np.ndarray:
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm[None]), format="s16",
                                       layout="mono")
    frame.sample_rate = rate
    rs = av.AudioResampler(format="flt", layout="mono", rate=to)
    parts = [p.to_ndarray().reshape(-1) for p in rs.resample(frame)]
    parts += [p.to_ndarray().reshape(-1) for p in rs.resample(None)]
    return np.concatenate(parts).astype(np.float64)


def envelope(x: np.ndarray, n: int) -> np.ndarray:
    m = len(x) // n
    return np.sqrt(np.mean(x[: m * n].reshape(m, n) ** 2, axis=1))


def test_a_turn_of_tts_speech_becomes_the_character_speaking_it(served):
    r = turns(served, "--turns", "1", "--tts-speed", str(TTS_BURST), npz="turn.npz")
    engine = r["engine"]
    assert r["errors"] == [], r["errors"]
    # the frames: the engine's size, at its fps: as many to each second of the character's
    # audio (the two leave the server together, however fast this machine makes them)
    assert r["sizes"] == [[engine["width"], engine["height"]]] == [[64, 64]]
    fps = r["frames"] / r["audio_s"]
    assert abs(fps - engine["fps"]) < 0.1 * engine["fps"], (r["frames"], r["audio_s"])
    # the character's speech in place of the TTS's audio; other frames in their order
    assert r["audio_kinds"] == ["SpeechOutputAudioRawFrame"], r["audio_kinds"]
    assert r["texts"] == ["turn 1", "end of turn 1"]
    order = [k for k in r["kinds"] if k in ("TextFrame", "TTSStartedFrame", "TTSStoppedFrame")]
    assert order == ["TextFrame", "TTSStartedFrame", "TTSStoppedFrame", "TextFrame"], r["kinds"]
    assert r["turns"][0]["latency_s"] is not None and r["turns"][0]["latency_s"] > 0

    d = np.load(served["tmp"] / "turn.npz")
    rate = int(d["out_rate"])
    out = d["audio"].astype(np.float64) / 32768
    said = d["speech"].astype(np.float64) / 32768  # at the TTS's rate, which is rate too
    # the speech comes back whole and as loud, delayed: its 10 ms envelope at the best delay
    n = round(rate * ENVELOPE_S)
    e_out, e_in = envelope(out, n), envelope(said, n)
    corr = {k: np.corrcoef(e_out[k: k + len(e_in)], e_in)[0, 1]
            for k in range(len(e_out) - len(e_in))}
    delay = max(corr, key=corr.get)
    assert corr[delay] > 0.9, corr[delay]
    back = out[delay * n: delay * n + len(said)]
    level_db = 10 * np.log10(np.mean(back ** 2) / np.mean(said ** 2))
    assert abs(level_db) < 1.0, level_db
    # the mouth follows the speech leaving beside it (the frames from the first audio's time)
    a16 = resampled(d["audio"], rate, 16000)
    shift = int(round((d["audio_t"][0] - d["image_t"][0]) * 16000))
    a16 = np.concatenate([np.zeros(max(shift, 0)), a16[max(-shift, 0):]])
    a16 = np.pad(a16, (0, max(0, int(len(d["images"]) / engine["fps"] * 16000) + 16000
                                 - len(a16))))
    sync = lip_sync(d["images"], a16, 16000, engine["fps"])
    assert sync.near > 0.3, sync
    # EndFrame freed the server's place
    assert wait(lambda: status(served)["active"] == 0, 30), status(served)


def test_an_interruption_ends_the_speech_within_a_chunk_and_the_next_turn_plays(served):
    r = turns(served, "--scenario", "interrupt", "--interrupt-after-s", str(INTERRUPT_AFTER_S))
    assert r["errors"] == [], r["errors"]
    assert "InterruptionFrame" in r["kinds"]
    assert r["interrupt"] is not None, r
    # the voice stops long before the rest of the turn would have played: of the turn's
    # voice left, less than half leaves after the interruption (counted in seconds of audio,
    # not of the clock; the time itself, within a chunk and the receiver's jitter buffer, is
    # scripts/bench_pipecat.py's)
    left_s = SPEECH_S - INTERRUPT_AFTER_S
    assert r["interrupt"]["voiced_audio_after_s"] < left_s / 2, r["interrupt"]
    assert r["turns"][0]["latency_s"] is not None, r  # the next turn's voice left the service


def test_a_full_server_is_an_error_frame_and_end_frees_it(served):
    """One pipeline holds the only session; a second one gets the server's sentence as an
    ErrorFrame and ends at once; once the first has ended, the next opens."""
    holder = subprocess.Popen(
        [*served["netns"], sys.executable, str(ROOT / "scripts/pipecat_turns.py"), "--url",
         PAGE, "--image", str(served["tmp"] / "face.png"), "--scenario", "open", "--lead-s",
         "6", "--tail-s", "0", "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        assert wait(lambda: status(served)["active"] == 1, 30)
        t0 = time.monotonic()
        r = turns(served, "--scenario", "open", "--lead-s", "0", "--tail-s", "0")
        assert time.monotonic() - t0 < 30
        assert len(r["errors"]) == 1 and "full: 1 session in progress" in r["errors"][0], r
        assert r["frames"] == 0
    finally:
        out, err = holder.communicate(timeout=60)
    assert json.loads(out.strip().splitlines()[-1])["errors"] == [], err[-2000:]
    assert wait(lambda: status(served)["active"] == 0, 30)
    r = turns(served, "--scenario", "open", "--lead-s", "0.5", "--tail-s", "0")
    assert r["errors"] == [] and r["frames"] > 0, r


def test_a_lost_connection_is_opened_again_and_the_turn_plays_there(served):
    """The bot's side of the connection cut mid-session: the service opens a new session on
    its policy, the speech said meanwhile plays there (never as the bare TTS audio), and the
    server frees the lost one."""
    r = turns(served, "--scenario", "lose", "--reconnects", "3", "--lose-after-s", "2")
    assert r["errors"] == [] and r["sessions_opened"] == 2, r
    assert r["audio_kinds"] == ["SpeechOutputAudioRawFrame"], r["audio_kinds"]
    assert r["turns"][0]["latency_s"] is not None, r
    # the turn played out on the new session: most of its voice, and the frames it rides on
    assert r["voiced_audio_after_loss_s"] > SPEECH_S / 2, r
    assert r["frames"] > r["frames_before_loss"] + 2 * r["engine"]["fps"], r
    assert wait(lambda: status(served)["active"] == 0, 10), status(served)


def test_the_tts_audio_reaches_the_session_whole_across_rates_and_what_cannot_be_is_dropped():
    """A turn whose TTS audio changes rate reaches the session whole (the resampler's last
    samples handed on at the change and at TTSStoppedFrame); frames at 1 Hz are dropped
    with one line. The session is a stand-in that records what the service says to it."""
    import asyncio
    import types

    from loguru import logger
    from pipecat.frames.frames import (EndFrame, TTSAudioRawFrame, TTSStartedFrame,
                                       TTSStoppedFrame)
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineWorker
    from pipecat.workers.runner import WorkerRunner

    from charengine.pipecat import CharacterVideoService
    from charengine.pipecat.client import EngineInfo

    said, warned = [], []

    class Session:
        speech = types.SimpleNamespace(queued=0)

        async def open(self):
            return EngineInfo("livetalk", "tiny-livetalk", 16, 64, 64, 16000, 12)

        def say(self, pcm):
            said.append(pcm.size)

        async def close(self, tell_server=True):
            pass

    class Service(CharacterVideoService):
        def _new_client(self):
            return Session()

    def tts(seconds, rate):
        pcm = (0.3 * np.sin(np.arange(int(seconds * rate)) * 0.05) * 32767).astype(np.int16)
        n = rate // 50
        return [TTSAudioRawFrame(audio=pcm[i: i + n].tobytes(), sample_rate=rate,
                                 num_channels=1) for i in range(0, pcm.size, n)]

    async def run():
        worker = PipelineWorker(Pipeline([Service(PAGE, b"image")]),
                                cancel_on_idle_timeout=False)
        bad = [TTSAudioRawFrame(audio=bytes(320), sample_rate=1, num_channels=1)] * 3
        for f in [TTSStartedFrame(), *tts(0.5, 24000), *bad, *tts(0.5, 22050),
                  TTSStoppedFrame(), EndFrame()]:
            await worker.queue_frame(f)
        runner = WorkerRunner()
        await runner.add_workers(worker)
        await runner.run()

    sink = logger.add(lambda m: warned.append(m.record["message"]), level="WARNING")
    try:
        asyncio.run(run())
    finally:
        logger.remove(sink)
    assert abs(sum(said) - 16000) <= 2, sum(said)
    assert [w.split(": ", 1)[1] for w in warned] == [
        "the TTS's audio is dropped: 1 Hz, outside 8,000 to 192,000 Hz (send it at the usual "
        "16, 24 or 48 kHz)"], warned


def test_a_tts_streaming_at_real_time_with_late_frames_plays_without_gaps(monkeypatch):
    """A TTS that sends 20 ms frames at real time, a third of them up to 35 ms late (in
    order): on a clock the test moves, the track sends the turn's speech whole and in order,
    with no silence inside it. Sent as it comes (no lead), the same speech has gaps."""
    import asyncio

    from charengine.pipecat import client

    rate, n, count = 16000, 320, 100
    rng = np.random.default_rng(SEED)
    late = np.where(rng.random(count) < 1 / 3, rng.uniform(0, 0.035, count), 0.0)
    arrive = np.maximum.accumulate(0.5 + np.arange(count) * 0.02 + late)
    speech = (np.arange(count * n) % 30000 + 1).astype(np.int16)  # no zero inside it

    def sent() -> np.ndarray:
        now, pushed, out = [0.0], [0], []

        def deliver():
            while pushed[0] < count and arrive[pushed[0]] <= now[0]:
                track.push(speech[pushed[0] * n: (pushed[0] + 1) * n])
                pushed[0] += 1

        async def sleep(s):
            now[0] += s
            deliver()

        track = client.SpeechTrack(rate, clock=lambda: now[0], sleep=sleep)

        async def run():
            while now[0] < arrive[-1] + 1.0:
                deliver()
                out.append((await track.recv()).to_ndarray().reshape(-1))

        asyncio.run(run())
        return np.concatenate(out)

    def gaps(pcm) -> int:  # silent samples between the speech's first and last
        voiced = np.flatnonzero(pcm)
        return int((pcm[voiced[0]: voiced[-1] + 1] == 0).sum())

    held = sent()
    assert np.array_equal(held[held != 0], speech) and gaps(held) == 0
    monkeypatch.setattr(client, "SPEECH_LEAD_S", 0.0)
    as_it_comes = sent()
    assert np.array_equal(as_it_comes[as_it_comes != 0], speech) and gaps(as_it_comes) > 0


def test_the_speech_track_owes_silence_after_a_barge_in():
    """After clear() (a barge-in) the track sends SILENCE_AFTER_CLEAR silent frames before
    any speech pushed meanwhile: the server drops the speech in flight up to the first."""
    import asyncio

    from charengine.pipecat.client import SILENCE_AFTER_CLEAR, SpeechTrack

    track = SpeechTrack(16000)
    loud = np.full(320 * 4, 1000, np.int16)

    async def frames(n):
        return [int(np.abs((await track.recv()).to_ndarray()).max()) for _ in range(n)]

    async def run():
        track.push(loud)
        first = await frames(2)
        assert track.clear() == 320 * 2
        track.push(loud)  # the next turn, at once
        return first, await frames(SILENCE_AFTER_CLEAR + 2)

    first, after = asyncio.run(run())
    assert first == [1000, 1000]
    assert after == [0] * SILENCE_AFTER_CLEAR + [1000, 1000]


def test_a_server_that_does_not_answer_is_an_error_frame_and_the_voice_goes_on(tmp_path):
    """No server at the URL (no namespace needed): one ErrorFrame saying so, at once; the
    bot's speech passes through as it came."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]  # closed again below: nothing listens there
    c = clip(1.0, 64, np.random.default_rng(SEED))
    sf.write(tmp_path / "speech.wav", c.audio, c.sample_rate)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(ROOT / "scripts/pipecat_turns.py"), "--url",
                        f"http://127.0.0.1:{port}/", "--speech", str(tmp_path / "speech.wav"),
                        "--lead-s", "0", "--tail-s", "0.2", "--quiet"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert time.monotonic() - t0 < 60
    assert len(got["errors"]) == 1 and "does not answer" in got["errors"][0], got
    assert got["frames"] == 0 and got["audio_kinds"] == ["TTSAudioRawFrame"], got
    assert got["audio_s"] >= 0.99, got  # the second of speech, whole


def test_an_image_path_that_is_no_file_is_refused_when_the_bot_is_made(tmp_path):
    """By the service's constructor, and by the example's --image as it starts (not as
    each visitor comes)."""
    from charengine.pipecat import CharacterVideoService

    with pytest.raises(ValueError, match=r"^CharacterVideoService: the image .*absent.png: "
                                         r"no such file$"):
        CharacterVideoService(PAGE, tmp_path / "absent.png")
    with pytest.raises(ValueError, match="is a directory"):
        CharacterVideoService(PAGE, tmp_path)
    assert CharacterVideoService(PAGE, b"any bytes: the server reads them")._image
    r = subprocess.run([sys.executable, str(ROOT / "examples/pipecat_bot.py"), "--image",
                        str(tmp_path / "absent.png")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].endswith(
        f"error: argument --image: {tmp_path / 'absent.png'}: no such file"), r.stderr[-2000:]


ENGINE = {"family": "characters", "preset": "tiny", "fps": 16, "width": 64, "height": 64,
          "sample_rate": 16000, "frames_per_step": 4}


@pytest.mark.parametrize("status, offer, said", [
    ("<html>a router's page</html>", None, "/status is not a JSON object"),
    ('["a", "list"]', None, "/status is not a JSON object"),
    ('{"engine": {"fps": 16}}', None, "its /status names no engine (KeyError: 'family')"),
    (json.dumps({"engine": ENGINE}), '{"ok": true}',
     "its answer to the offer has no session, sdp and type"),
])
def test_an_address_that_is_not_charrun_is_one_error_frame(tmp_path, status, offer, said):
    """The URL of some other HTTP server (a common slip: another port of the machine): one
    ErrorFrame saying the address does not answer as charrun --serve, no exception in the
    pipeline, the bot's speech passing through."""
    import http.server

    class Other(http.server.BaseHTTPRequestHandler):
        def answer(self, body: str | None):
            data = (body or "<html>not found</html>").encode()
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.answer(status if self.path == "/status" else None)

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.answer(offer if self.path == "/offer" else None)

        def log_message(self, *args):
            pass

    c = clip(1.0, 64, np.random.default_rng(SEED))
    sf.write(tmp_path / "speech.wav", c.audio, c.sample_rate)
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Other) as other:
        threading.Thread(target=other.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{other.server_address[1]}/"
        r = subprocess.run([sys.executable, str(ROOT / "scripts/pipecat_turns.py"), "--url",
                            url, "--speech", str(tmp_path / "speech.wav"), "--lead-s", "0",
                            "--tail-s", "0.2", "--quiet"],
                           capture_output=True, text=True, timeout=120)
        other.shutdown()
    assert r.returncode == 0, r.stderr[-3000:]
    assert "exception processing" not in r.stderr, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["errors"] == [f"{url} answers, but not as charrun --serve does: {said}; is it "
                             "the address of charrun --serve's page?"], got
    assert got["frames"] == 0 and got["audio_kinds"] == ["TTSAudioRawFrame"], got
    assert got["audio_s"] >= 0.99, got


def test_the_example_bot_streams_the_character_to_a_visitor(served):
    """examples/pipecat_bot.py on SmallWebRTCTransport, an aiortc peer as the visitor
    speaking into it: the visitor receives the character's video and voice."""
    bot = subprocess.Popen([*served["netns"], sys.executable, str(ROOT / "examples/pipecat_bot.py"),
                            "--charrun", PAGE, "--image", str(served["tmp"] / "face.png"),
                            "--host", "127.0.0.1", "--port", "7860"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(bot.stdout.readline, "")),
                     daemon=True).start()
    try:
        assert wait(lambda: any("Uvicorn running" in ln for ln in lines), 60), "".join(lines)
        v = subprocess.run([*served["netns"], sys.executable, str(ROOT / "tests/pipecat_visitor.py"),
                            "--url", BOT, "--speech", str(served["tmp"] / "speech.wav"),
                            "--frames", "120", "--voiced-s", "1", "--seconds", "120"],
                           capture_output=True, text=True, timeout=180)
        assert v.returncode == 0, v.stderr[-3000:]
        got = json.loads(v.stdout.strip().splitlines()[-1])
        assert got["sizes"] == [[64, 64]], got
        assert got["frames"] >= 120, got  # five seconds of video
        assert got["voiced_s"] >= 1.0, got  # the character's voice: the visitor's speech
        # the visitor left: the bot's pipeline ended and freed the character's server
        assert wait(lambda: status(served)["active"] == 0, 15), "".join(lines[-40:])
    finally:
        bot.terminate()
        bot.wait(30)


def test_the_example_bot_without_its_server_is_heard_without_its_character(tmp_path):
    """examples/pipecat_bot.py whose charrun is not running: each visitor hears the bot
    (their speech echoed) with no video, the bot says why in one line a visitor (no
    traceback) and stays up for the next."""
    if not can_netns():
        pytest.skip("needs root and iproute2 (network namespaces) for WebRTC peers")
    c = clip(1.0, 64, np.random.default_rng(SEED))
    sf.write(tmp_path / "speech.wav", c.audio, c.sample_rate)
    with namespace("charpb", "10.233.7") as name:
        netns = ["ip", "netns", "exec", name]
        bot = subprocess.Popen([*netns, sys.executable, str(ROOT / "examples/pipecat_bot.py"),
                                "--charrun", PAGE, "--host", "127.0.0.1", "--port", "7860"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(iter(bot.stdout.readline, "")),
                         daemon=True).start()
        try:
            assert wait(lambda: any("Uvicorn running" in ln for ln in lines), 60), \
                "".join(lines)
            for _ in range(2):
                v = subprocess.run([*netns, sys.executable, str(ROOT / "tests/pipecat_visitor.py"),
                                    "--url", BOT, "--speech", str(tmp_path / "speech.wav"),
                                    "--lead-s", "0", "--seconds", "4"],
                                   capture_output=True, text=True, timeout=120)
                assert v.returncode == 0, v.stderr[-3000:]
                got = json.loads(v.stdout.strip().splitlines()[-1])
                assert got["state"] == "connected" and got["frames"] == 0, got
                assert got["voiced_s"] > 0, got  # the speech, echoed: heard at all
            assert bot.poll() is None, "".join(lines[-40:])
        finally:
            bot.terminate()
            bot.wait(30)
    said = [ln for ln in lines if "hears the bot without its character" in ln]
    assert len(said) == 2 and all(f"charrun at {PAGE} does not answer" in ln for ln in said), \
        "".join(lines[-40:])
    assert "Traceback" not in "".join(lines), "".join(lines[-80:])


def test_two_bots_share_a_server_one_session_each(served):
    """charrun --serve --sessions 2: two bots' pipelines at once, each its own session
    (the server's capacity reads 2 and both are active while they run)."""
    server = subprocess.Popen([*served["netns"], sys.executable, "-m", "charengine.runtime.cli",
                               "--engine", str(served["engine"]), "--serve", "--port", "8090",
                               "--health-port", "8091", "--sessions", "2", "--over-capacity"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(server.stdout.readline, "")),
                     daemon=True).start()
    try:
        assert wait(lambda: any("serving on" in ln for ln in lines), 120), "".join(lines)
        url = "http://127.0.0.1:8090/"
        bots = [subprocess.Popen(
            [*served["netns"], sys.executable, str(ROOT / "scripts/pipecat_turns.py"), "--url",
             url, "--image", str(served["tmp"] / "face.png"), "--speech",
             str(served["tmp"] / "speech.wav"), "--quiet", "--lead-s", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        outs = [b.communicate(timeout=120) for b in bots]
        for out, err in outs:
            r = json.loads(out.strip().splitlines()[-1])
            assert r["errors"] == [] and r["turns"][0]["latency_s"] is not None, (r, err[-2000:])
            assert r["sizes"] == [[64, 64]] and r["frames"] > 2 * 24
        sessions = [ln for ln in lines if "session" in ln and "started (lane" in ln]
        assert sorted(ln.split("(lane ")[1][0] for ln in sessions) == ["0", "1"], lines
    finally:
        server.terminate()
        server.wait(30)
