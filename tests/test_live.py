"""Live sessions on the tiny engine: speech turns, listening between them, barge-in, and the
Prometheus metrics served over HTTP on loopback."""

import time

import pytest
import torch

from charengine.runtime.engine import Engine
from charengine.runtime.live import LiveSession, wait_until
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
    time.sleep(1.0)
    s.stop()
    voiced_after = [t for t, v in log if v and t > t_int]
    last_voiced = max(t for t, v in log if v)
    assert voiced_after == [] and last_voiced - t_int <= 0.4  # goal: 0.4 s (paper 0.78)
    assert any(not v for t, v in log if t > t_int)  # listening frames flow again


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
