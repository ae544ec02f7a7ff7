"""scripts/livetalk_latency.py on a tiny-livetalk engine: a paced live session with speech
fed in 20 ms frames, every measured chunk's latency from its last audio frame to its first
frame at the sink (just in time: under a chunk), the first frames' time, and the results
document's figures."""

import math

import pytest

from engines import build_target


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    return build_target(tmp_path_factory.mktemp("lt"), "cpu-tiny-livetalk")


def test_latency_per_chunk_is_measured_for_each_chunk(engine_dir, load_script):
    lat = load_script("livetalk_latency")
    doc = lat.run(engine_dir, chunks=3, warmup=1, unpaced=2, decode_reps=1)
    assert doc["preset"] == "tiny-livetalk" and doc["chunks"] == 3
    rows = doc["per_chunk"]
    assert [r["chunk"] for r in rows] == [1, 2, 3]
    # a chunk whose take found speech (how many did is the machine's timing: a take at its
    # deadline pads what has not arrived) has its latency measured, the others none
    timed = [r for r in rows if "latency_s" in r]
    assert doc["chunks_with_speech"] == len(timed) == sum(r["speech_samples"] > 0 for r in rows)
    for r in rows:
        assert 0 <= r["speech_samples"] <= 12000  # at most a chunk's 12 frames at 1000 each
    for r in timed:
        assert math.isfinite(r["latency_s"]) and r["latency_s"] > 0
        # the frame reaches the sink after its audio arrived, then the parts add up to it
        assert r["first_frame_t"] > r["last_audio_t"]
        assert sum(r["parts_s"].values()) == pytest.approx(r["latency_s"], abs=1e-6)
        assert all(v >= 0 for k, v in r["parts_s"].items() if k != "to_take")
    if timed:
        assert doc["latency_ms"]["min"] <= doc["latency_p50_ms"] <= doc["latency_p90_ms"]
    # the first frame follows the session's start, before any measured chunk's frame
    assert 0 < doc["first_frames_s"] < rows[0]["first_frame_t"]
    first = doc["first_chunk"]  # its session start and stages come before its first frames
    assert 0 < first["start_s"] and all(first[k] > 0 for k in (
        "audio_ms", "diffusion_ms", "decode_to_first_frames_ms"))
    assert first["start_s"] + 1e-3 * first["diffusion_ms"] < doc["first_frames_s"]
    # a CPU worker does not warm up: the script measures the steady estimate itself
    assert doc["estimate_measured"] == "by the script" and doc["processing_estimate_s"] > 0
    assert doc["ready_s"] > 0
    for stage in ("audio", "diffusion", "decode"):
        assert doc["unpaced_stage_ms"][stage]["p50"] > 0
    # unpaced, a chunk's 12 frames reach the sink once a period
    unpaced = doc["unpaced_stage_ms"]
    assert doc["capacity_fps"] == pytest.approx(12e3 / unpaced["period_ms"]["p50"])
    assert 0 < doc["decode_ms"]["first_latent"]["p50"]
    assert doc["engine"]["target"] == "cpu-tiny-livetalk"
    # just in time (how far a take runs ahead of its first frame, and the latency, are the
    # machine's: the script measures them)
    assert doc["just_in_time"] and doc["stream_decode"]
    assert doc["take_to_first_frame_chunks_p50"] > 0
    assert 0 <= doc["chunks_taken_whole"] <= 3 and doc["dropped_ms"] >= 0
    assert doc["padded_ms"] == pytest.approx(
        sum(r["take_samples"] - r["speech_samples"] for r in rows) / 16)
    assert doc["dropped_ms"] == pytest.approx(sum(r["dropped_samples"] for r in rows) / 16)
    # the session's own speech-to-lips figure, as /metrics reports it
    sl = doc["speech_latency_ms"]
    assert sl["p50"] is not None and 0 < sl["min"] <= sl["p50"] <= sl["max"], sl


def test_speech_in_turns_arrives_in_bursts_and_its_speech_to_lips_is_measured(
        engine_dir, load_script):
    """--turn-s 1 --pause-s 0.5 --burst 4: a turn's 50 frames of 20 ms arrive 5 ms apart,
    the next turn 1.5 s after the last began, nothing between; the paced session's
    speech-to-lips figure is kept."""
    import torch

    lat = load_script("livetalk_latency")
    speaking = lat.Speaking(1.0, 0.5, 4.0)
    feeder = lat.Feeder(None, torch.zeros(16000), 16000, speaking=speaking)
    due = [feeder.due(k) for k in range(101)]
    assert due[1] == pytest.approx(0.005) and due[49] == pytest.approx(49 * 0.005)
    assert due[50] == pytest.approx(1.5) and due[100] == pytest.approx(3.0)
    assert [k for k in range(101) if feeder.starts_turn(k)] == [0, 50, 100]
    assert lat.Feeder(None, torch.zeros(16000), 16000).due(50) == pytest.approx(1.0)
    assert speaking.tag() == "_turns-1-0.5_burst-4"
    doc = lat.run(engine_dir, chunks=12, warmup=1, unpaced=0, decode_reps=0, speaking=speaking)
    assert doc["speaking"] == {"turn_s": 1.0, "pause_s": 0.5, "rate": 4.0}
    sl = doc["speech_latency_ms"]
    assert sl["p50"] is not None and 0 < sl["p50"] <= sl["max"], sl
    # each measured turn: its first speech to the first voiced frame after it
    # how many turns fall after the warm-up depends on the machine's speed: at least one
    assert doc["turns"] >= 1 and doc["turn_start_ms"]["p50"] is not None, doc["turn_start_ms"]
