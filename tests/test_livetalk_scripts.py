"""The numerics comparison, waterfall and long-session scripts on the tiny presets (CPU): the
JSON they write, the waterfall's arms as each family makes them, and a long session's drift
between two arms."""

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from charengine.config import preset
from charengine.livetalk.spec import (FP8_CACHE, LiveTalkSwitches, WATERFALL_FP8_GEMM,
                                      WATERFALL_PLAIN, WATERFALL_PRODUCTION, waterfall_arms,
                                      waterfall_config)

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
PRESET = "tiny-livetalk"


def script(name: str, *args) -> str:
    r = subprocess.run([sys.executable, str(SCRIPTS / name), *map(str, args)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def on(cfg) -> set[str]:
    return {n for n in LiveTalkSwitches.ORDER if getattr(cfg.switches, n)}


def test_waterfall_arms_are_cumulative_and_end_at_the_preset():
    base = preset(PRESET)
    arms = waterfall_arms()
    # every switch of ORDER is an arm, in its order, with the FP8 GEMMs right before the cache
    assert [a for a in arms if a in LiveTalkSwitches.ORDER] == list(LiveTalkSwitches.ORDER)
    assert arms[0] == WATERFALL_PLAIN and arms[-1] == WATERFALL_PRODUCTION
    assert arms.index(WATERFALL_FP8_GEMM) + 1 == arms.index(FP8_CACHE)
    plain = waterfall_config(base, WATERFALL_PLAIN)
    assert not on(plain) and not plain.numerics.fp8_gemm and not plain.numerics.fp8_attention
    assert waterfall_config(base, WATERFALL_PRODUCTION) == base
    prev = plain
    for arm in arms[1:-1]:
        cfg = waterfall_config(base, arm)
        assert on(cfg) >= on(prev) and len(on(cfg)) - len(on(prev)) == (arm != WATERFALL_FP8_GEMM)
        assert cfg.numerics.fp8_gemm == (arms.index(arm) >= arms.index(WATERFALL_FP8_GEMM))
        assert cfg.numerics.fp8_attention == cfg.switches.fp8_kv  # the FP8 cache needs it
        assert not cfg.numerics.fast_accum
        prev = cfg
    assert on(prev) == on(base) and dataclasses.replace(prev.numerics, fast_accum=True) == \
        base.numerics
    with pytest.raises(ValueError, match="unknown waterfall arm"):
        waterfall_config(base, "no_such_arm")


def test_numerics_compare_against_fp32(tmp_path):
    chunks, exclude = 8, 2  # the first position reset is chunk 7
    script("numerics_compare.py", "--preset", PRESET, "--device", "cpu", "--gpu-tag", "cpu",
           "--steps", chunks, "--exclude", exclude, "--out", tmp_path)
    d = json.loads((tmp_path / f"numerics_{PRESET}_tp1_cpu_vs-fp32_plain.json").read_text())
    assert d["order"] == ["fp32_plain", "bf16_plain", "bf16", "fp8_gemm", "fp8_kv", "fused",
                          "production", "production_again"]
    assert list(d["arms"]) == d["order"]
    # the steps (indices, not times) that reset positions, within the steps kept
    assert d["reset_steps"] and all(exclude <= c < chunks for c in d["reset_steps"])
    for name, arm in d["arms"].items():
        err = arm["rel_l2_per_step"]
        assert len(err) == chunks and all(math.isfinite(e) for e in err), name
        assert arm["rel_l2_median"] <= arm["rel_l2_max"] == max(err[exclude:])
        if name == "fp32_plain":
            assert max(err) == 0.0
        else:  # rounded differently, yet close
            assert 0.0 < arm["rel_l2_median"] < 0.1, name
    a = d["arms"]
    # the emulated FP8 on the CPU runs the same every time; FP8 moves more than bf16 alone
    assert a["production_again"]["rel_l2_per_step"] == a["production"]["rel_l2_per_step"]
    assert a["production"]["rel_l2_median"] > a["bf16_plain"]["rel_l2_median"]
    assert a["production"]["numerics"]["fast_accum"] and not a["fused"]["numerics"]["fast_accum"]


def test_waterfall_runs_and_summarizes(tmp_path):
    arms = [WATERFALL_PRODUCTION, WATERFALL_PLAIN]  # given out of order
    out = script("bench_waterfall.py", "--preset", PRESET, "--device", "cpu", "--gpu-tag",
                 "cpu", "--runs", 1, "--steps", 2, "--arms", ",".join(arms), "--out", tmp_path)
    assert out.count("diffusion p50") == 2 * len(arms)  # a line per run, one per arm
    key = f"{PRESET}_tp1_cpu"
    for arm in arms:
        run = json.loads((tmp_path / f"bench_{PRESET}_tp1_cpu_{arm}_1.json").read_text())
        assert run["arm"] == arm and run["steady_steps"] == 2 and run["date"]
        assert 0 < run["diffusion_p50_ms"] <= run["diffusion_p90_ms"] < math.inf
        assert run["memory_peak_mb"] > 0
    summary_path = tmp_path / f"summary_{key}.json"
    summary = json.loads(summary_path.read_text())
    assert summary["order"] == list(summary["arms"]) == [WATERFALL_PLAIN, WATERFALL_PRODUCTION]
    assert summary["step_budget_ms"] == 750.0  # 12 frames at 16 fps
    assert all(s["runs"] == 1 for s in summary["arms"].values())
    assert not summary["arms"][WATERFALL_PLAIN]["switches_on"]
    assert summary["arms"][WATERFALL_PRODUCTION]["switches_on"] == list(LiveTalkSwitches.ORDER)
    summary_path.unlink()
    script("bench_waterfall.py", "--preset", PRESET, "--gpu-tag", "cpu", "--summarize-only",
           "--out", tmp_path)
    assert json.loads(summary_path.read_text())["arms"] == summary["arms"]


def test_the_characters_waterfall_and_a_long_sessions_drift(tmp_path):
    """The same scripts on the characters family: its waterfall's arms from the family (the
    baseline first, production last), and the write-time path's drift from the plain one in
    fp32 over a session crossing a position reset, within the tests' fp32 bound."""
    from charengine.family import family

    fam = family("characters")
    assert fam.waterfall()[0] == "baseline" and fam.waterfall()[-1] == "production"
    out = script("bench_waterfall.py", "--preset", "tiny", "--device", "cpu", "--gpu-tag",
                 "cpu", "--runs", 1, "--steps", 3, "--arms", "production,baseline",
                 "--out", tmp_path)
    assert out.count("diffusion p50") == 4
    summary = json.loads((tmp_path / "summary_tiny_tp1_cpu.json").read_text())
    assert summary["order"] == ["baseline", "production"] and summary["family"] == "characters"
    assert summary["step_budget_ms"] == 1000 * 4 / 24
    script("long_session.py", "--preset", "tiny", "--steps", 44, "--compare",
           "fp32_plain:fp32", "--out", tmp_path / "long.json")
    d = json.loads((tmp_path / "long.json").read_text())
    assert d["resets"] == 1 and d["steady_steps"] == 44  # step 42 resets
    assert 0 < d["drift"]["fp32_plain:fp32"]["max"] < 1e-5


@pytest.mark.parametrize("name", ["tiny", "tiny-livetalk"])
def test_where_a_steps_time_goes_for_either_family(tmp_path, name):
    """bench_session.py on a CPU: the steps timed after the family's first steady one, the
    step's FLOPs from the family, a new session's first steps, (where the family's model
    labels its regions, the characters family's) the regions' times and the floors measured
    alone, and (where it has a batched step, LiveTalk's) batches of 2 and 3 sessions."""
    script("bench_session.py", "--preset", name, "--device", "cpu", "--gpu-tag", "cpu",
           "--steps", 12, "--profile-steps", 1, "--profile-graph-steps", 0,
           "--fill-sessions", 1, "--batches", "2,3", "--batch-runs", 2, "--out", tmp_path)
    d = json.loads((tmp_path / f"session_{name}_tp1_cpu_production_1.json").read_text())
    # every step timed, the median one of the steady ones
    assert len(d["diffusion_ms"]) == 12
    assert d["diffusion_p50_ms"] in d["diffusion_ms"][d["exclude"]:]
    assert d["step_tflop"]["gemm"] > 0 and d["step_tflop"]["attention"] > 0  # counted, not timed
    assert [f["step"] for f in d["fill_steps"]] == list(range(len(d["fill_steps"])))
    if name == "tiny":
        # the labelled regions the step went through (a region is listed once it took time)
        # and both floors measured
        assert {"fp8_gemm", "attention", "total"} <= set(d["components_ms"])
        assert set(d["floors_ms"]) == {"fp8_gemm_ms", "attention_ms"}
        assert d["batched"] is None  # the characters family steps each session alone
    else:
        assert d["components_ms"] == {} and d["floors_ms"] is None
        assert [b["sessions"] for b in d["batched"]] == [2, 3]
        assert all(len(b["batch_ms"]) == 2 and not b["graphed"] for b in d["batched"])
