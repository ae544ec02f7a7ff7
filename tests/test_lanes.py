"""Many sessions in one worker (runtime/lanes.py) on the tiny engines of both families: one
copy of the engine, three lanes rendering at once from different images and speech (and a
fourth beside them fed NaN speech), each lane's frames equal to its frames rendered alone,
bit for bit; a worker of one lane is the worker it was; steps take their turns earliest
deadline first; more sessions than the machine holds are refused in one line."""

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
