"""The playback simulator reproduces paper Appendix B; the pacer keeps 24 fps on its clock,
holds and shifts on an underrun, applies backpressure, and drops frames only on a flush.
The pacer's schedule is checked on a clock the test moves (tests/manual_clock.py), so each
frame's time is exact whatever the machine's load."""

import threading

import pytest
import torch

from charengine.runtime.pacer import Pacer, Step, split_audio
from charengine.runtime.playout import Playout, paper_periods, simulate
from tests.manual_clock import ManualClock


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
    """On a clock the test moves: every frame at its slot exactly, and with slack 2 a step's
    push would wait until the step before it has been taken to play."""
    clock, out = ManualClock(), []
    pacer = Pacer(lambda f, a, t, v: out.append((t, f[0, 0, 0].item(), a.numel())), slack=2,
                  clock=clock)
    steps = _steps(6)
    assert pacer.push(steps[0], timeout=0)
    clock.advance(0)  # step 0 taken to play: its first frame now
    assert out == [(0.0, 0.0, 667)] and pacer.schedule() == (pytest.approx(1 / 6), 4)
    assert pacer.push(steps[1], timeout=0)  # step 0 started: step 1 may wait in the queue
    for k in range(2, 6):
        assert not pacer.push(steps[k], timeout=0)  # step k - 1 not yet taken: push waits
        clock.advance(1 / 6)  # step k - 1 is taken after step k - 2's last frame
        assert pacer.queued_steps() == 1 and pacer.schedule()[1] == 4 * k
    clock.advance(1)
    pacer.close(drain=True)
    assert [t for t, _, _ in out] == pytest.approx([j / 24 for j in range(24)])
    assert [v for _, v, _ in out] == [i for i in range(6) for _ in range(4)]
    assert sum(n for _, _, n in out) == 6 * 2667 and pacer.playout.stalls == []


def test_pacer_on_the_machines_clock_plays_every_frame_in_order_never_before_its_slot():
    seen = []
    pacer = Pacer(lambda f, a, t, v: seen.append(f[0, 0, 0].item()), slack=2,
                  on_frame=lambda t, slot: seen.append(t >= slot))
    for s in _steps(3):
        assert pacer.push(s)
    pacer.close(drain=True)
    assert seen == [x for i in range(3) for _ in range(4) for x in (float(i), True)]


def test_pacer_holds_on_underrun_and_shifts_its_schedule():
    clock, out = ManualClock(), []
    pacer = Pacer(lambda f, a, t, v: out.append(t), slack=2, clock=clock)
    a, b = _steps(2)
    pacer.push(a)
    clock.advance(0.5)  # the next step comes 1/3 s after its slot
    pacer.push(b)
    clock.advance(1)
    pacer.close(drain=True)
    assert pacer.playout.stalls == [(pytest.approx(1 / 6), pytest.approx(0.5 - 1 / 6))]
    # nothing dropped; the late step plays at full rate from its new slot
    assert out == pytest.approx([j / 24 for j in range(4)] + [0.5 + j / 24 for j in range(4)])


def test_flush_drops_frames_not_yet_played():
    clock, out = ManualClock(), []
    pacer = Pacer(lambda f, a, t, v: out.append((t, v)), slack=3, clock=clock)
    for s in _steps(3, voiced=True):
        pacer.push(s, timeout=0)
    clock.advance(0.1)
    assert pacer.flush() == 0.1
    pacer.push(_steps(1)[0])  # the step after a barge-in plays at once
    clock.advance(1)
    pacer.close(drain=True)
    assert out == [(pytest.approx(j / 24), True) for j in range(3)] + [  # those due by 0.1 s
        (pytest.approx(0.1 + j / 24), False) for j in range(4)]
    assert pacer.playout.stalls == []


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

    clock = ManualClock()
    pacer = Pacer(publish, slack=3, clock=clock)
    for s in _steps(3, voiced=True):
        pacer.push(s, timeout=0)
    assert publishing.wait(10)  # the first frame is due at once
    flushed = threading.Thread(target=lambda: (pacer.flush(), events.append("flushed")))
    flushed.start()
    flushed.join(0.2)
    assert flushed.is_alive() and events == ["frame"]  # the flush waits for the frame
    release.set()
    flushed.join(10)
    clock.advance(1)  # frames a flush let through would be published by now
    pacer.close()
    assert events[-1] == "flushed" and set(events[:-1]) == {"frame"}, events


def test_pieces_of_a_step_play_back_to_back_and_backpressure_counts_frames():
    # steps of 12 frames pushed in pieces of 4 (a live session's latents as they are decoded)
    clock, out = ManualClock(), []
    pacer = Pacer(lambda f, a, t, v: out.append((t, a.numel())), fps=24, frames_per_step=12,
                  slack=2, clock=clock)
    assert pacer.schedule() == (None, 0)  # nothing started: no slot yet
    pieces = [Step(torch.zeros(4, 3, 8, 8), torch.zeros(2000), last=j == 2) for j in range(3)]
    for p in pieces:  # a whole step's frames may wait: these return without waiting
        assert pacer.push(p, timeout=0)
    assert pacer.queued_steps() == 1
    clock.advance(0)  # the first piece taken to play
    more = [Step(torch.zeros(4, 3, 8, 8), torch.zeros(2000), last=j == 2) for j in range(3)]
    assert pacer.push(more[0], timeout=0)  # 12 frames may wait behind the playing piece
    assert pacer.schedule() == (pytest.approx(4 / 24), 4)
    assert not pacer.push(more[1], timeout=0)  # 16 would: its push waits ...
    clock.advance(3.5 / 24)  # ... until the second piece is taken, after the first's last frame
    assert pacer.schedule() == (pytest.approx(8 / 24), 8)  # 12 frames wait: it would return
    assert not pacer.push(more[2], timeout=0)
    clock.advance(2)
    pacer.close(drain=True)
    assert [t for t, _ in out] == pytest.approx([j / 24 for j in range(24)])  # back to back
    assert sum(n for _, n in out) == 6 * 2000 and pacer.playout.stalls == []
    assert pacer.schedule()[1] == 24
