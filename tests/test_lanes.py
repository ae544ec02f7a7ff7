"""Many sessions in one worker (runtime/lanes.py) on the tiny engines of both families: one
copy of the engine, three lanes rendering at once from different images and speech (and a
fourth beside them fed NaN speech), each lane's frames equal to its frames rendered alone,
bit for bit; a worker of one lane is the worker it was; steps take their turns earliest
deadline first, and with --batch those that wait together run as one batch (each session's
latents as alone, within BATCH_BOUND; a NaN in one reaches no other); more sessions than the
machine holds, a batch past the sessions, on a family without batched steps or on a rank
group are refused in one line."""

import threading
import time

import pytest
import torch

from charengine.runtime.engine import Engine
from charengine.runtime.lanes import Turns
from charengine.runtime.worker import Worker
from engines import build_target


@pytest.fixture(scope="module", params=["cpu-tiny", "cpu-tiny-livetalk"])
def engine_dir(request, tmp_path_factory):
    return build_target(tmp_path_factory.mktemp("eng"), request.param)


def inputs(spec, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(3, spec.out_h, spec.out_w, generator=g),
            0.1 * torch.randn(spec.side.sample_rate * 2, generator=g))


def render(lane, image, speech, steps: int, seed: int) -> list[torch.Tensor]:
    frames = []
    lane.start(image, "")
    lane.run(speech, steps, lambda i, f, *meta: frames.append(f.clone()), seed=seed)
    return frames


def test_three_lanes_render_at_once_as_each_renders_alone(engine_dir):
    engine = Engine.load(engine_dir)
    worker = Worker(engine, sessions=4, over_capacity=True)
    spec, steps = worker.spec, 5
    assert len(worker.lanes) == 4
    cap = worker.capacity  # measured on lane 0, which then renders as a fresh worker's does
    assert cap.budget_s == worker.family.step_frames(spec, 1) / spec.fps
    assert cap.shared_device and (cap.batch, cap.batch_s) == (1, None)
    assert all(lane.session.model is worker.session.model for lane in worker.lanes)
    assert len({id(lane.session.cache) for lane in worker.lanes}) == 4
    together: dict[int, list] = {}

    def go(i):
        image, speech = inputs(spec, 10 + i)
        if i == 3:  # a fourth session fed NaN speech beside them
            speech = torch.full_like(speech, float("nan"))
        together[i] = render(worker.lanes[i], image, speech, steps, seed=i)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(together) == [0, 1, 2, 3] and worker.turns.taken >= 4 * steps
    alone = Worker(Engine.load(engine_dir))
    assert len(alone.lanes) == 1
    for i in range(3):
        solo = render(alone.lanes[0], *inputs(spec, 10 + i), steps, seed=i)
        assert len(solo) == len(together[i]) == steps
        assert all(torch.equal(a, b) for a, b in zip(solo, together[i])), i
    assert not torch.equal(together[0][-1], together[1][-1])


def test_turns_go_to_the_earliest_deadline_waiting():
    turns, order, started = Turns(), [], threading.Event()

    def hold():
        with turns.turn(0.0):
            started.set()
            while turns.waiting < 3:  # the others queue meanwhile
                time.sleep(0.01)

    def ask(name, deadline):
        with turns.turn(deadline):
            order.append(name)

    first = threading.Thread(target=hold)
    first.start()
    assert started.wait(5)
    late = [threading.Thread(target=ask, args=(n, d)) for n, d in
            (("c", 30.0), ("a", 10.0), ("b", 20.0))]
    for t in late:
        t.start()
    for t in [first, *late]:
        t.join(5)
    assert order == ["a", "b", "c"] and turns.taken == 4


def test_more_sessions_than_the_machine_holds_are_refused_in_one_line_and_auto_takes_them(
        engine_dir):
    import re
    import subprocess
    import sys

    charrun = [sys.executable, "-m", "charengine.runtime.cli", "--engine", str(engine_dir),
               "--check"]
    r = subprocess.run([*charrun, "--sessions", "64"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert re.search(r"--sessions 64: this machine holds \d+ real-time sessions? of .*; give "
                     r"--sessions \d+ or fewer, or --sessions auto", r.stderr), r.stderr
    r = subprocess.run([*charrun, "--sessions", "auto"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    found = re.search(r"sessions: (\d+); this machine holds (\d+) real-time", r.stdout)
    assert found and int(found[1]) == max(1, int(found[2])), r.stdout


BATCH_BOUND = 0.05  # a batched session's frames against its frames alone: the larger GEMMs'
# roundings (on the tiny LiveTalk engine they come out bit for bit; a wrong cache or row
# would be far past it)


def steady_inputs(worker, seed: int, steps: int):
    g = torch.Generator().manual_seed(seed)
    shapes = worker.family.step_shapes(worker.spec)
    return [(torch.randn(shapes.noise_shape, generator=g),
             torch.randn(shapes.features, generator=g)) for _ in range(steps)]


def test_steps_waiting_together_run_as_one_batch_each_as_it_runs_alone(tmp_path):
    """Three sessions' steps queue while the device is held, then run as one batch (its
    GEMMs over their stacked tokens): each session's latents equal its latents stepped alone
    within BATCH_BOUND, across a position reset, and a fourth session's NaN speech in the
    same batch reaches no other."""
    engine = Engine.load(build_target(tmp_path, "cpu-tiny-livetalk"))
    worker = Worker(engine, sessions=4, over_capacity=True, batch=4)
    turns, lanes = worker.turns, worker.lanes
    assert worker.capacity.batch == 4 and worker.capacity.batch_s is not None
    cache = lanes[0].session.cache
    steps = cache.first_steady() + cache.R + 3  # past the first reset in the steady part
    feeds = [steady_inputs(worker, 20 + i, steps) for i in range(4)]
    feeds[3] = [(n, torch.full_like(a, float("nan"))) for n, a in feeds[3]]
    shapes = worker.family.step_shapes(worker.spec)
    g = torch.Generator().manual_seed(5)
    refs = [(torch.randn(shapes.reference, generator=g), torch.randn(shapes.prompt, generator=g))
            for _ in range(4)]

    def alone(i):
        s = lanes[0].session.sibling()
        with torch.inference_mode():
            s.start(*refs[i])
            return [s.step(*x) for x in feeds[i]]

    solo = [alone(i) for i in range(3)]
    sessions = [lane.session for lane in lanes]
    with torch.inference_mode():
        for s, ref in zip(sessions, refs):
            s.start(*ref)
    outs: list[list] = [[] for _ in range(4)]
    batched = 0
    for k in range(steps):
        due = [s.batch_kind() is not None for s in sessions]
        assert len(set(due)) == 1  # the four step in lockstep here
        taken, batches = turns.taken, turns.batches
        threads = [threading.Thread(target=torch.inference_mode()(lambda i=i: outs[i].append(
            turns.step(sessions[i], *feeds[i][k])[0]))) for i in range(4)]
        with turns.turn(0.0):  # the device held while all four queue
            for t in threads:
                t.start()
            while turns.waiting < 4:
                time.sleep(0.01)
        for t in threads:
            t.join(60)
        assert turns.taken == taken + 1 + 4  # the held turn and the four steps
        assert turns.batches == batches + due[0]  # steady steps together, the others alone
        batched += due[0]
    assert batched >= cache.R + 2 and any(cache.is_reset(k) for k in range(steps - batched,
                                                                            steps))
    for i in range(3):
        assert len(outs[i]) == steps
        worst = max((a - b).abs().max().item() for a, b in zip(solo[i], outs[i]))
        assert worst <= BATCH_BOUND, (i, worst)
        assert torch.isfinite(torch.stack(outs[i])).all()
    assert not torch.equal(outs[0][-1], outs[1][-1])


def test_a_family_without_batched_steps_is_refused_a_batch_in_one_line(tmp_path):
    from charengine.runtime.engine import EngineError

    engine = Engine.load(build_target(tmp_path, "cpu-tiny"))
    with pytest.raises(EngineError, match=r"^--batch 2: the characters family steps each "
                                          r"session alone; give --batch 1$"):
        Worker(engine, sessions=2, over_capacity=True, batch=2)


def test_a_batch_past_the_sessions_or_on_a_rank_group_is_refused_in_one_line(tmp_path):
    import subprocess
    import sys

    engine = build_target(tmp_path, "cpu-tiny-tp2")
    charrun = [sys.executable, "-m", "charengine.runtime.cli", "--engine", str(engine),
               "--check", "--sessions", "2"]
    r = subprocess.run([*charrun, "--batch", "3"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--batch 3 is more than the 2 session(s) of --sessions" in \
        r.stderr, r.stderr
    r = subprocess.run([*charrun, "--batch", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--batch 2: engine cpu-tiny-tp2 runs its ranks in processes of their own, which " \
           "step sessions one at a time; give --batch 1" in r.stderr, r.stderr
