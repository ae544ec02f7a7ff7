"""The decoder rank + TP group as real processes over gloo (the paper's layout, on CPU):
frames equal the in-process TP-1 worker's, decoding of step i-1 overlaps diffusion of step
i, and faults end a session with a clear error while the next session runs."""

import os
import signal
import time

import pytest
import torch

from charengine.runtime.distributed import DistributedWorker, RankFailure
from charengine.runtime.engine import Engine
from charengine.runtime.worker import Worker
from engines import build_target

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    d = tmp_path_factory.mktemp("eng")
    return (build_target(d, "cpu-tiny"), build_target(d, "cpu-tiny-tp2"),
            build_target(d, "cpu-tiny-tp2", name="cpu-tiny-tp3", tp=3))


def frames_of(worker, image, speech, steps, on_step=None):
    out = []

    def sink(i, frames):
        out.append(frames)
        if on_step:
            on_step(i)

    worker.start(image, "hello")
    times = worker.run(speech, steps, sink, seed=3)
    return torch.stack(out), times


@pytest.mark.parametrize("tp", [2, 3])  # tiny's 4 heads over 3 ranks: 2, 1, 1
def test_tp_with_decoder_rank_equals_tp1_and_overlaps(engines, tp):
    tp1, tpn = engines[0], engines[tp - 1]
    g = torch.Generator().manual_seed(0)
    image, speech = torch.rand(3, 64, 64, generator=g), torch.randn(16000 * 2, generator=g) * 0.1
    ref, _ = frames_of(Worker(Engine.load(tp1)), image, speech, 12)
    worker = DistributedWorker(Engine.load(tpn))
    try:
        got, t = frames_of(worker, image, speech, 12)
    finally:
        worker.close()
    assert (got - ref).abs().max() < 2e-2  # TP changes FP8 rounding of the output projection
    assert len(t.diffusion) == len(t.decode) == 12
    # rank 0 broadcasts audio i before decoding i-1, so the ranks denoise step i while rank 0
    # decodes i-1 (how much they overlap is the machine's: scripts/bench_session.py)
    assert all(t.audio[i][1] <= t.decode[i - 1][0] for i in range(1, 12))
    assert all(t.diffusion[i][0] >= t.audio[i][0] for i in range(12))
    assert len(t.busy_s("diffusion")) == 12 and min(t.busy_s("diffusion")) > 0


def _kill_a_rank_at(worker, step, sig):
    def on_step(i):
        if i == step:
            os.kill(worker.ctx.processes[1].pid, sig)
    return on_step


def test_a_dead_rank_ends_the_session_and_the_next_one_runs(engines):
    worker = DistributedWorker(Engine.load(engines[1]), timeout_s=20)
    image, speech = torch.rand(3, 64, 64), torch.randn(16000 * 3) * 0.1
    try:
        with pytest.raises(RankFailure, match=r"rank 2 died \(exit -9\)"):
            frames_of(worker, image, speech, 18, _kill_a_rank_at(worker, 3, signal.SIGKILL))
        frames, _ = frames_of(worker, image, speech, 6)  # a fresh group, same worker
        assert frames.shape == (6, 4, 3, 64, 64)
    finally:
        worker.close()


def test_a_hung_rank_is_detected_by_the_timeout(engines):
    worker = DistributedWorker(Engine.load(engines[1]), timeout_s=5)
    image, speech = torch.rand(3, 64, 64), torch.randn(16000 * 3) * 0.1
    try:
        with pytest.raises(RankFailure, match="did not answer within 5 s"):
            frames_of(worker, image, speech, 18, _kill_a_rank_at(worker, 3, signal.SIGSTOP))
        frames, _ = frames_of(worker, image, speech, 6)
        assert frames.shape[0] == 6
    finally:
        worker.close()


def test_a_live_session_runs_on_the_rank_group_as_on_one_process(engines):
    """charrun --serve on a TP engine: a live session over the ranks (steps sent one at a
    time as speech arrives) publishes the frames a TP-1 live session publishes; afterwards
    the same group serves a rendered session."""
    from charengine.runtime.live import LiveSession, wait_until

    speech = torch.randn(16000 * 2, generator=torch.Generator().manual_seed(1)) * 0.1
    image = torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(2))

    def live(worker, frames=48):
        got = []
        s = LiveSession(worker, lambda f, a, t, v: got.append((f.clone(), v)), slack=8)
        s.say(speech)
        s.start(image, "hello")
        assert wait_until(lambda: len(got) >= frames, 60)
        s.stop()
        assert s.error is None
        return torch.stack([f for f, _ in got[:frames]]), [v for _, v in got[:frames]]

    ref, ref_voiced = live(Worker(Engine.load(engines[0])))
    worker = DistributedWorker(Engine.load(engines[1]))
    try:
        got, voiced = live(worker)
        again, _ = live(worker)  # the ranks returned to their command loop
        frames, _ = frames_of(worker, image, speech, 6)
    finally:
        worker.close()
    assert voiced == ref_voiced and any(voiced)
    assert (got - ref).abs().max() < 2e-2  # as the rendered TP-2 session against TP-1
    assert torch.equal(got, again)
    assert frames.shape[0] == 6


def test_a_damaged_rank_file_is_reported_by_its_rank(engines, tmp_path):
    """Rank 0 of a TP engine reads no rank file; each rank verifies its own, and its error
    reaches rank 0's one line."""
    import shutil

    copy = tmp_path / "engine"
    shutil.copytree(engines[1], copy)
    f = copy / "rank1.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01
    f.write_bytes(bytes(data))
    engine = Engine.load(copy)  # rank 0's own files are intact
    with pytest.raises(RankFailure, match=r"rank 2 died \(exit 1\): .*checksum mismatch in "
                                          r"rank1.safetensors"):
        DistributedWorker(engine)


def test_idle_ranks_outlive_the_session_timeout_and_the_next_session_runs(engines):
    """Between sessions the ranks wait for as long as rank 0 lives: idle for longer than
    the hand-off timeout, the group still serves the next session."""
    worker = DistributedWorker(Engine.load(engines[1]), timeout_s=2)
    image, speech = torch.rand(3, 64, 64), torch.randn(16000) * 0.1
    try:
        frames_of(worker, image, speech, 3)
        time.sleep(5)  # idle past the 2 s timeout
        assert worker.alive()
        frames, _ = frames_of(worker, image, speech, 3)
        assert frames.shape[0] == 3
    finally:
        worker.close()


def test_a_rank_that_dies_while_idle_is_replaced_before_the_next_session(engines):
    worker = DistributedWorker(Engine.load(engines[1]))
    image, speech = torch.rand(3, 64, 64), torch.randn(16000) * 0.1
    try:
        frames_of(worker, image, speech, 3)
        old = [p.pid for p in worker.ctx.processes]
        os.kill(old[0], signal.SIGKILL)
        time.sleep(0.5)
        frames, _ = frames_of(worker, image, speech, 3)  # on fresh ranks
        assert frames.shape[0] == 3
        assert not set(old) & {p.pid for p in worker.ctx.processes}
    finally:
        worker.close()


def test_a_rank_that_dies_at_start_up_ends_the_start_naming_it(engines):
    import multiprocessing
    import threading

    killed = []

    def kill_rank_2():
        end = time.monotonic() + 30
        while time.monotonic() < end and not killed:
            for p in multiprocessing.active_children():
                if p.name == "charengine-rank2" and p.pid:
                    time.sleep(0.3)
                    os.kill(p.pid, signal.SIGKILL)
                    killed.append(time.monotonic())
                    return
            time.sleep(0.01)

    threading.Thread(target=kill_rank_2, daemon=True).start()
    with pytest.raises(RankFailure, match=r"^start-up failed: rank 2 died \(exit -9\)") as e:
        DistributedWorker(Engine.load(engines[1]))
    assert killed, e.value  # found by its death (the message), not by the start's timeout
    assert "\n" not in str(e.value)


def test_close_ends_every_rank_and_leaves_no_temporary_directory(engines):
    import tempfile

    before = set(os.listdir(tempfile.gettempdir()))
    worker = DistributedWorker(Engine.load(engines[2]))  # TP-3
    procs = list(worker.ctx.processes)
    worker.close()  # lets them stop_grace_s, then kills them
    assert all(p.exitcode is not None for p in procs)
    left = set(os.listdir(tempfile.gettempdir())) - before
    assert not [n for n in left if n.startswith(("charengine-", "pymp-"))], left


def test_lanes_on_the_rank_group_step_in_turns_as_each_runs_alone(engines):
    """--sessions N on a TP engine: every rank holds a session per lane over its one model;
    three live pipelines (and a fourth fed NaN speech) step at once through the same rank
    processes, one exchange at a time, and each lane's frames equal its frames run alone on
    the group, bit for bit."""
    import threading

    worker = DistributedWorker(Engine.load(engines[1]), sessions=4, over_capacity=True)
    spec, steps = worker.spec, 6

    def inputs(i):
        g = torch.Generator().manual_seed(20 + i)
        return torch.rand(3, 64, 64, generator=g), torch.randn(16000 * 2, generator=g) * 0.1

    def live(lane, image, speech, seed):
        out = []

        def encode_audio(i):
            return lane.encode_window(lane.family.audio_window(spec, speech, i), i, timed=True)

        lane.start(image, "")
        lane.pipeline(encode_audio, seed).run(steps, lambda i, f, *meta: out.append(f.clone()))
        return out

    try:
        assert len(worker.lanes) == 4 and worker.startup["sessions"] == 4
        cap = worker.capacity  # the ranks' step time, lane 0 left to run as alone below
        assert cap.budget_s == worker.family.step_frames(spec, 1) / spec.fps
        assert cap.shared_device and (cap.batch, cap.batch_s) == (1, None)
        together = {}

        def go(i):
            image, speech = inputs(i)
            if i == 3:
                speech = torch.full_like(speech, float("nan"))
            together[i] = live(worker.lanes[i], image, speech, seed=i)

        threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert sorted(together) == [0, 1, 2, 3] and worker.turns.taken >= 4 * steps
        for i in range(3):
            alone = live(worker.lanes[0], *inputs(i), seed=i)
            assert len(alone) == len(together[i]) == steps
            assert all(torch.equal(a, b) for a, b in zip(alone, together[i])), i
        assert not torch.equal(together[0][-1], together[1][-1])
    finally:
        worker.close()


def test_a_group_that_holds_fewer_sessions_refuses_more_in_one_line(engines):
    from charengine.runtime.engine import EngineError

    with pytest.raises(EngineError, match=r"--sessions 64: this machine holds \d+ real-time "
                                          r"session"):
        DistributedWorker(Engine.load(engines[1]), sessions=64)
