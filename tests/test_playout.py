"""The playback simulator reproduces paper Appendix B; the pacer keeps 24 fps on its clock,
holds and shifts on an underrun, applies backpressure, and drops frames only on a flush."""

import threading
import time

import pytest
import torch

from charengine.runtime.pacer import Pacer, Step, split_audio
from charengine.runtime.playout import Playout, paper_periods, simulate


def test_paper_production_figures_stall_at_slack_1_only():
    periods = paper_periods(6 * 60 * 5)  # five minutes of 161 ms steps, a 263 ms reset per 42
    one, two = simulate(periods, 1), simulate(periods, 2)
    assert 7 <= one.stalls_per_minute <= 11  # paper: about 10 per minute (some from slow steps)
    assert 90 <= one.mean_stall_ms <= 110  # paper: about 100 ms (the reset is 96 ms late)
    assert two.stalls == []


def test_slack_2_lead_is_rebuilt_between_resets():
    # paper: a reset cuts the lead to 70 ms, rebuilt within 18 steps; two resets in a row are
    # more than the lead absorbs
    spaced = [0.161] * 60 + [0.263] + [0.161] * 20 + [0.263] + [0.161] * 10
    assert simulate(spaced, 2).stalls == []
    back_to_back = [0.161] * 60 + [0.263, 0.263] + [0.161] * 10
    assert len(simulate(back_to_back, 2).stalls) == 1


def test_a_late_step_shifts_every_later_slot():
    p = Playout(fps=24, frames_per_step=4)
    assert p.start(1.0) == 1.0
    assert p.start(1.1) == pytest.approx(1.0 + 1 / 6)
    late = p.start(2.0)
    assert late == 2.0 and p.stalls == [(pytest.approx(1 + 2 / 6), pytest.approx(2 - (1 + 2 / 6)))]
    assert p.start(2.05) == pytest.approx(2.0 + 1 / 6)


def test_audio_rides_with_frames():
    parts = split_audio(torch.arange(2667.0), 4)
    assert sorted(p.numel() for p in parts) == [666, 667, 667, 667]
    assert torch.equal(torch.cat(parts), torch.arange(2667.0))


def _steps(n, voiced=False, h=8):
    return [Step(torch.full((4, 3, h, h), float(i)), torch.zeros(2667), voiced) for i in range(n)]


def test_pacer_publishes_at_24fps_in_order_with_backpressure():
    out, pushed_back = [], []
    pacer = Pacer(lambda f, a, t, v: out.append((t, f[0, 0, 0].item(), a.numel())), slack=2)
    t0 = time.monotonic()
    for s in _steps(6):
        assert pacer.push(s)
        pushed_back.append(time.monotonic() - t0)
    pacer.close(drain=True)
    time.sleep(0.2)
    times = [t for t, _, _ in out]
    assert [v for _, v, _ in out] == [i for i in range(6) for _ in range(4)]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert abs(sum(gaps) / len(gaps) - 1 / 24) < 0.004
    assert max(gaps) < 1 / 24 + 0.08
    # slack 2: push(k) returns only once step k - 1 started playing
    assert pushed_back[-1] > 3.5 / 6
    assert sum(n for _, _, n in out) == 6 * 2667


def test_pacer_holds_on_underrun_and_shifts_its_schedule():
    out = []
    pacer = Pacer(lambda f, a, t, v: out.append(t), slack=2)
    a, b = _steps(2)
    pacer.push(a)
    time.sleep(0.5)  # the next step is 1/3 s late
    pacer.push(b)
    pacer.close(drain=True)
    time.sleep(0.25)
    assert len(out) == 8  # nothing dropped
    assert len(pacer.playout.stalls) == 1 and 0.25 < pacer.playout.stalls[0][1] < 0.45
    gaps = [y - x for x, y in zip(out[4:], out[5:])]
    assert max(gaps) < 1 / 24 + 0.08  # the late step plays at full rate from its new slot


def test_flush_drops_frames_not_yet_played():
    out = []
    pacer = Pacer(lambda f, a, t, v: out.append((t, v)), slack=3)
    steps = _steps(3, voiced=True)
    threading.Thread(target=lambda: [pacer.push(s) for s in steps], daemon=True).start()
    time.sleep(0.1)
    t_flush = pacer.flush()
    time.sleep(0.3)
    pacer.close()
    assert out and len(out) < 12
    assert max(t for t, _ in out) <= t_flush


def test_a_frame_being_published_finishes_before_a_flush_returns_and_none_follows_it():
    """A barge-in's flush and a frame's publish exclude each other: what the caller does
    after flush() returns (a session reads "interrupted") comes after every frame of the
    steps it dropped (the flush may wait for the frames already due), so no voiced frame can
    say "speaking" after it."""
    events, publishing, release = [], threading.Event(), threading.Event()

    def publish(f, a, t, v):
        events.append("frame")
        if not publishing.is_set():
            publishing.set()
            release.wait(10)  # the first frame's publish is slow

    pacer = Pacer(publish, slack=3)
    steps = _steps(3, voiced=True)
    threading.Thread(target=lambda: [pacer.push(s) for s in steps], daemon=True).start()
    assert publishing.wait(10)
    flushed = threading.Thread(target=lambda: (pacer.flush(), events.append("flushed")))
    flushed.start()
    flushed.join(0.2)
    assert flushed.is_alive() and events == ["frame"]  # the flush waits for the frame
    release.set()
    flushed.join(10)
    time.sleep(0.2)  # frames a flush let through would be published in this time
    pacer.close()
    assert events[-1] == "flushed" and set(events[:-1]) == {"frame"}, events


def test_pieces_of_a_step_play_back_to_back_and_backpressure_counts_frames():
    # steps of 12 frames pushed in pieces of 4 (a live session's latents as they are decoded)
    out = []
    pacer = Pacer(lambda f, a, t, v: out.append((t, a.numel())), fps=24, frames_per_step=12,
                  slack=2)
    assert pacer.schedule() == (None, 0)  # nothing started: no slot yet
    pieces = [Step(torch.zeros(4, 3, 8, 8), torch.zeros(2000), last=j == 2) for j in range(3)]
    t0 = time.monotonic()
    for p in pieces:  # a whole step's frames may wait: these return without waiting
        assert pacer.push(p, timeout=0)
    assert pacer.queued_steps() <= 1
    more = [Step(torch.zeros(4, 3, 8, 8), torch.zeros(2000), last=j == 2) for j in range(3)]
    assert pacer.push(more[0])  # 12 frames may wait ahead of the playing piece
    slot, started = pacer.schedule()
    assert started >= 4 and slot is not None
    # returns once the pacer takes the first step's second piece, after the first's last frame
    assert pacer.push(more[1])
    assert time.monotonic() - t0 > 3 / 24 - 0.02
    pacer.push(more[2])
    pacer.close(drain=True)
    times = [t for t, _ in out]
    assert len(times) == 24 and sum(n for _, n in out) == 6 * 2000
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert pacer.playout.stalls == [] and max(gaps) < 1 / 24 + 0.03  # the pieces back to back
    assert pacer.schedule()[1] == 24
