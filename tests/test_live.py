"""Live sessions on the tiny engine: speech turns, listening between them, barge-in, and the
Prometheus metrics served over HTTP on loopback; just in time, speech fed live reaches its
frames without queueing, a silent microphone never starves playback, LiveTalk's frames
reach the pacer latent by latent as the whole chunk's would, and after a burst of speech the
takes come back to just in time."""

import threading
import time

import pytest
import torch

from charengine.runtime.engine import Engine
from charengine.runtime.live import DEADLINE_MARGIN_FRAMES, LiveSession, SpeechBuffer, wait_until
from charengine.runtime.metrics import Metrics
from charengine.runtime.worker import Worker
from engines import build_target


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    return Worker(Engine.load(build_target(tmp_path_factory.mktemp("eng"))))


def test_barge_in_stops_voiced_frames_at_once_and_returns_to_listening(worker):
    log = []
    s = LiveSession(worker, lambda f, a, t, v: log.append((t, v)), metrics=Metrics())
    s.start(torch.rand(3, 64, 64))
    s.say(torch.randn(16000 * 4) * 0.1)
    assert wait_until(lambda: sum(v for _, v in log) >= 24, 20)
    t_int = s.interrupt()
    # listening frames flow again: a second of them, however fast this machine plays them
    assert wait_until(lambda: sum(not v for t, v in log if t > t_int) >= 24, 60)
    s.stop()
    voiced_after = [t for t, v in log if v and t > t_int]
    assert voiced_after == []  # how soon the last one played: scripts/bench_bargein.py


def test_listening_between_turns_then_speaking(worker):
    log = []
    s = LiveSession(worker, lambda f, a, t, v: log.append((t, v, float(a.abs().max()))))
    s.start(torch.rand(3, 64, 64))
    assert wait_until(lambda: len(log) >= 24, 20)
    assert not any(v for _, v, _ in log)  # silent audio while listening
    s.say(torch.ones(16000) * 0.25)
    assert wait_until(lambda: sum(v for _, v, _ in log) >= 24, 20)
    s.stop()
    voiced = [peak for _, v, peak in log if v]
    assert max(voiced) == pytest.approx(0.25)


def test_metrics_count_sessions_and_flag_slow_ones(caplog):
    m = Metrics(target_fps=24, interval_s=1.0)
    m.session_started()
    t = 0.0
    for k in range(48):  # two seconds at 20 fps: below target
        m.frame(t, t)
        t += 1 / 20
    with caplog.at_level("WARNING"):
        fps = m.session_finished("s1")
    assert fps == pytest.approx(20, rel=1e-6)
    text = m.exposition().decode()
    assert "charengine_sessions_started_total 1.0" in text
    assert "charengine_sessions_below_target_total 1.0" in text
    assert "charengine_frame_drift_seconds_count 10.0" in text  # every fifth frame
    fps_line = next(ln for ln in text.splitlines() if ln.startswith("charengine_fps "))
    assert float(fps_line.split()[1]) == pytest.approx(20.0)
    assert "streamed below target" in caplog.text


@pytest.mark.parametrize("fps,first_gap_s", [(16, 0.0), (24, 0.0), (16, 0.5), (24, 0.9)])
def test_below_target_is_judged_against_the_engines_fps_over_the_steady_part(fps, first_gap_s):
    """A session that plays at its engine's fps is not below target, whatever the fps (a
    16-fps LiveTalk session at 16.00 fps included), nor for a slow first frame (its start)."""
    m = Metrics(target_fps=fps)
    m.session_started()
    frames = [0.0] + [first_gap_s + k / fps for k in range(1, 5 * fps)]
    for t in frames:
        m.frame(t, t)
    got = m.session_finished("s")
    assert got == pytest.approx(fps, rel=1e-6)
    assert "charengine_sessions_below_target_total 0.0" in m.exposition().decode()
    slow = Metrics(target_fps=fps)
    slow.session_started()
    for k in range(5 * fps):
        slow.frame(k / (0.95 * fps), k / (0.95 * fps))
    assert slow.session_finished("s") < 0.98 * fps
    assert "charengine_sessions_below_target_total 1.0" in slow.exposition().decode()


class TakeTimes(SpeechBuffer):
    """A session's speech buffer that records, for each step's take, whether its speech was
    all there (or a turn's end)."""

    def __init__(self):
        super().__init__()
        self.complete: list[bool] = []

    def take(self, n: int):
        with self.lock:
            self.complete.append(self._has(n))
        return super().take(n)


def _feed(session, speech, stop, frame=320, rate=16000):
    """Push speech into the session in real time, 20 ms at a time, until `stop`."""
    t0 = time.monotonic()
    for k, part in enumerate(speech.split(frame)):
        if stop.wait(max(0.0, t0 + k * frame / rate - time.monotonic())):
            return
        session.say(part)


def test_speech_fed_live_is_taken_just_in_time_for_its_frames(worker):
    """Each step takes its speech as it arrives: no take after the first happens before
    its speech is all there unless its deadline has come (its slot less the processing
    time), whatever the machine's speed; taken as the pipeline asks instead, takes run ahead
    of the speech (the control). How far ahead of its frames a take runs is the machine's:
    scripts/livetalk_latency.py measures it."""
    def run(just_in_time):
        s = LiveSession(worker, lambda f, a, t, v: None, just_in_time=just_in_time)
        s.speech = takes = TakeTimes()
        stop = threading.Event()
        feeder = threading.Thread(target=_feed, args=(s, torch.randn(16000 * 10) * 0.1, stop))
        feeder.start()
        s.start(torch.rand(3, 64, 64))
        assert wait_until(lambda: len(takes.complete) >= 12, 60)
        s.stop()
        stop.set()
        feeder.join()
        assert s.error is None
        return takes.complete[1:12], list(s.take_reasons)[1:12]

    complete, why = run(True)
    assert all(c or w == "deadline" for c, w in zip(complete, why)), (complete, why)
    complete, why = run(False)
    assert not all(complete) and why == []


def test_a_silent_microphone_never_starves_playback(worker):
    """No speech at all: every step after the first is taken at its deadline (none waits
    for speech that never comes), and frames keep playing, silent."""
    published = []
    s = LiveSession(worker, lambda f, a, t, v: published.append((t, v)))
    s.start(torch.rand(3, 64, 64))
    assert wait_until(lambda: len(published) >= 8 + 2 * worker.spec.fps, 60)
    s.stop()
    assert len(s.take_reasons) > 4 and set(s.take_reasons) == {"deadline"}, s.take_reasons
    assert not any(v for _, v in published)


@pytest.fixture(scope="module")
def livetalk(tmp_path_factory):
    return Worker(Engine.load(build_target(tmp_path_factory.mktemp("lt"), "cpu-tiny-livetalk")))


def test_livetalk_frames_reach_the_pacer_latent_by_latent_as_the_whole_chunk(livetalk):
    """A chunk's frames go to the pacer as each latent is decoded: its first frames reach
    the pacer before its last latent is decoded, and the session plays the frames and audio
    it plays with each chunk decoded whole."""
    spec = livetalk.spec
    speech = torch.randn(16000 * 2, generator=torch.Generator().manual_seed(1)) * 0.1
    image = torch.rand(3, spec.out_h, spec.out_w, generator=torch.Generator().manual_seed(2))
    frames = spec.first_step_frames + 3 * spec.frames_per_latent

    def live(stream_decode):
        got = []
        s = LiveSession(livetalk, lambda f, a, t, v: got.append((f.clone(), a.clone(), v)),
                        stream_decode=stream_decode)
        s.say(speech)
        s.start(image)
        assert wait_until(lambda: len(got) >= frames, 60)
        times = s.pipeline.times
        s.stop()
        assert s.error is None
        return got[:frames], times

    pieces, times = live(True)
    whole, _ = live(False)
    for (f, a, v), (g, b, w) in zip(pieces, whole):
        torch.testing.assert_close(f, g, atol=1e-5, rtol=0)
        assert torch.equal(a, b) and v == w
    assert any(v for _, _, v in pieces)
    for k in range(4):  # each chunk's first frames were sunk while its later latents decoded
        assert times.first_piece[k][1] < times.sink[k][0] < times.decode[k][1]


def test_only_leading_silence_is_dropped_from_the_speech_buffer():
    b = SpeechBuffer()
    b.push(torch.zeros(300))
    b.push(torch.cat([torch.zeros(50), torch.full((100,), 0.5), torch.zeros(200)]))
    assert b.drop_silence(1000) == 350  # up to the first loud sample, across chunks
    assert (b.taken, b.dropped, b.queued()) == (350, 350, 300)
    assert b.drop_silence(1000) == 0
    heard, voiced, _, _ = b.take(100)
    assert voiced and torch.equal(heard, torch.full((100,), 0.5))
    assert b.drop_silence(150) == 150 and b.queued() == 50  # at most what was asked


def test_speech_whose_leading_silence_is_dropped_keeps_its_arrival_mark():
    """A turn's first speech, pushed while nothing waits, is marked with its arrival; when
    the silence it starts with is dropped to catch up, its first loud sample is marked with
    the arrival of the push that brought it (here the second), so its latency is still
    reported."""
    now = [10.0]
    b = SpeechBuffer(clock=lambda: now[0])
    b.push(torch.zeros(300))
    now[0] = 10.02
    b.push(torch.cat([torch.zeros(50), torch.full((100,), 0.5)]))
    assert b.marks == [(0, 10.0)]
    assert b.drop_silence(1000) == 350
    assert b.marks == [(350, 10.02)]
    heard, voiced, _, marks = b.take(50)
    assert voiced and marks == [(0, 10.02)]
    b.push(torch.full((10,), 0.5))  # speech behind speech still waiting: no mark
    assert b.drop_silence(1000) == 0 and b.marks == []


def test_a_turns_first_words_taken_at_a_deadline_are_padded_in_front():
    """A take after one that found no speech, finding only the start of the next, pads it
    with silence in front, so the rest of the turn follows without a gap; the marks move
    with it. Speech taken whole, a turn's end, and speech that continues what the take
    before found are padded after."""
    now = [5.0]
    b = SpeechBuffer(clock=lambda: now[0])
    assert not b.take(300)[1]  # listening
    b.push(torch.full((100,), 0.5))
    heard, voiced, ended, marks = b.take(300)
    assert voiced and not ended and marks == [(200, 5.0)]
    assert torch.equal(heard, torch.cat([torch.zeros(200), torch.full((100,), 0.5)]))
    b.push(torch.full((250,), 0.25))  # the turn goes on, a little late: padded after
    heard, _, _, marks = b.take(300)
    assert marks == [(0, 5.0)] and torch.equal(heard[:250], torch.full((250,), 0.25))
    assert torch.equal(heard[250:], torch.zeros(50))
    now[0] = 6.0
    b.push(torch.full((100,), 0.5))  # a short turn, its end said: padded after
    b.end_segment()
    heard, _, ended, marks = b.take(300)
    assert ended and marks == [(0, 6.0)] and torch.equal(heard[100:], torch.zeros(200))
    assert not b.take(300)[1]
    b.push(torch.full((300,), 0.5))  # a turn's first words taken whole: no padding
    heard, _, _, marks = b.take(300)
    assert marks == [(0, 6.0)] and torch.equal(heard, torch.full((300,), 0.5))


def test_a_steady_estimate_moves_the_second_steps_deadline_later(livetalk):
    """Before a session has measured a step after its first, the next take's deadline is its
    slot less the worker's steady estimate where there is one, else less the first step's
    (longer) processing time: the estimate moves it later by their difference, so speech
    flowing from the session's first moment fills the second step instead of being cut."""
    s = LiveSession(livetalk, lambda f, a, t, v: None, processing_estimate=0.1)
    s.start(torch.rand(3, livetalk.spec.out_h, livetalk.spec.out_w))
    try:
        # no speech: step 1 waits for its deadline, about a chunk after step 0's first frames
        assert wait_until(lambda: s.first_processing is not None, 30)
        with_estimate = s.deadline()
        s.estimate = None
        without = s.deadline()
        assert not s.processing  # still before step 1's measure
    finally:
        s.stop()
    assert s.error is None
    assert s.first_processing > 0.1
    assert with_estimate - without == pytest.approx(s.first_processing - 0.1, abs=0.02)


@pytest.mark.parametrize("which", ["worker", "livetalk"])
def test_timing_a_steady_step_leaves_the_next_session_unchanged(which, request):
    """Worker.time_processing on a session at its steady point (as the GPU warm-up leaves
    it) gives a positive time, and the next session's frames are those it would have been."""
    w = request.getfixturevalue(which)
    g = torch.Generator().manual_seed(3)
    image = torch.rand(3, w.spec.out_h, w.spec.out_w, generator=g)
    speech = 0.1 * torch.randn(16000 * 2, generator=g)

    def frames():
        out = []
        w.start(image, "")
        w.run(speech, 3, lambda i, f: out.append(f))
        return torch.cat(out)

    before = frames()
    w.start(image, "")
    w.run(speech, 8, lambda i, f: None)  # past the cache's filling: the steady point
    assert w.time_processing() > 0
    assert torch.equal(frames(), before)


def test_the_deadlines_read_the_steady_steps_once_one_is_measured(livetalk):
    """The next take's deadline is its slot less the most processing time of the steps
    measured: of every step after the first until a step of the steady shape is among them
    (LiveTalk's cache-filling chunks take longer), then of the steady steps alone."""
    s = LiveSession(livetalk, lambda f, a, t, v: None)
    steady = livetalk.family.steady_from(livetalk.cfg)
    assert steady > 1  # tiny-livetalk fills its cache over several chunks
    s.first_processing = 0.5
    s.processing.extend((i, 0.9 if i == 1 else 0.8) for i in range(1, steady))
    filling = s.deadline()
    s.processing.append((steady, 0.3))
    assert s.deadline() - filling == pytest.approx(0.9 - 0.3, abs=0.01)
    s.processing.append((steady + 1, 0.4))
    assert s.deadline() - filling == pytest.approx(0.9 - 0.4, abs=0.01)


# frame times a step's first frames may take, beyond its stages' own work, in hand-offs from
# stage to stage (each a thread woken) on a loaded machine
HANDOFF_FRAMES = 4.0


class AheadAtTake(SpeechBuffer):
    """A session's speech buffer that records, at each take, the frames the session had
    ahead of playback (taken and not yet played: those waiting for the pacer's next slot and
    those after it) and whether any speech was waiting."""

    def __init__(self, session: LiveSession):
        super().__init__()
        self.session = session
        self.ahead: list[tuple[float, bool]] = []

    def take(self, n: int):
        s = self.session
        slot, started = s.pacer.schedule()
        to_slot = 0.0 if slot is None else max(0.0, slot - s.pacer.clock.now()) * s.spec.fps
        with self.lock:
            waiting = self.pushed > self.taken
        self.ahead.append((s.frames_committed - started + to_slot, waiting))
        return super().take(n)


def test_after_a_burst_of_speech_the_takes_come_back_to_just_in_time(livetalk):
    """Speech that arrives all at once (a TTS's turn) is taken as fast as the pacer's slack
    lets its frames queue; once it has played, the silent steps after it are taken just in
    time again: no more ahead of playback than the most a step's own work took (its speech
    encoded, its latent denoised, its first frames decoded), the margin and the hand-offs
    between the stages. A step taken early waits behind the step before it and for the
    pacer's room, and that wait is not counted in its processing time (were it, every step
    after a burst would keep the burst's lead, and the next turn would play seconds late)."""
    spec = livetalk.spec
    chunk = spec.frames_per_latent
    s = LiveSession(livetalk, lambda f, a, t, v: None)
    s.speech = takes = AheadAtTake(s)
    s.say(torch.randn(spec.side.sample_rate * 6) * 0.1)  # 6 s of speech, all at once
    s.start(torch.rand(3, spec.out_h, spec.out_w))
    try:
        assert wait_until(lambda: len(takes.ahead) >= 20, 120)
    finally:
        s.stop()
    assert s.error is None
    assert max(a for a, waiting in takes.ahead if waiting) >= chunk  # it ran ahead, as it must
    last = max(i for i, (_, waiting) in enumerate(takes.ahead) if waiting)
    after = [a for a, _ in takes.ahead[last + 4:]]  # the burst's frames have played out
    times = s.pipeline.times
    own = [sum(e - b for b, e in (times.audio[i], times.diffusion[i], times.first_piece[i]))
           for i in range(s.steady_from, len(times.first_piece))]
    bound = max(own) * spec.fps + DEADLINE_MARGIN_FRAMES + HANDOFF_FRAMES
    assert len(after) >= 3 and max(after) <= bound, (takes.ahead, own)
