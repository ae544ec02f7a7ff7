"""Engines start without compiling (GPU; skipped without CUDA): a fresh
charrun process loads an engine built with its kernels and compiles nothing, while the same
engine built without them compiles every kernel at start."""

import json
import re
import subprocess
import sys

import pytest

from engines import build_target

pytestmark = pytest.mark.gpu


def ready_check(engine) -> int:
    r = subprocess.run([sys.executable, "-m", "charengine.runtime.cli", "--engine", str(engine),
                        "--check"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    m = re.search(r"ready in .*; (\d+) kernels compiled at start", r.stdout)
    assert m, r.stdout
    return int(m.group(1))


def test_an_engine_with_its_kernels_compiles_nothing_at_start(tmp_path):
    baked = build_target(tmp_path / "a", "h200-tp1", preset="tiny-d64", kernels=True)
    m = json.loads((baked / "manifest.json").read_text())
    compiled = m["kernels"]["warm_up"]["0"]["compiled"]
    assert {"pre_attention_kernel", "attention_tma_kernel", "delta_rotation_kernel",
            "norm_modulate_quant_kernel", "swiglu_quant_row_kernel"} <= set(compiled)
    assert any(f.endswith(".cubin") for f in m["files"])
    plan = m["kernels"]["gemm_plan"]["0"]
    assert set(plan) == {"w_in", "w_out"} and set(plan.values()) <= {"scaled_mm", "triton"}
    assert m["kernels"]["shared_objects_checked"]  # Triton's launchers, checked
    assert ready_check(baked) == 0
    jit = build_target(tmp_path / "b", "h200-tp1", preset="tiny-d64", kernels=False)
    assert ready_check(jit) >= len(set(compiled))


def test_an_engine_on_quack_ships_its_gemms_and_compiles_nothing_at_start(tmp_path):
    """With gemm_swiglu and gemm_residual (skipped without quack-kernels), charbuild times
    QuACK's tiles for both projections' epilogues, records the winners, and the engine holds
    QuACK's compiled objects: a fresh charrun process loads them and compiles nothing."""
    pytest.importorskip("quack")
    switches = {"gemm_swiglu": True, "gemm_residual": True}
    engine = build_target(tmp_path, "h200-tp1", preset="tiny-d64", kernels=True,
                          switches=switches)
    m = json.loads((engine / "manifest.json").read_text())
    plan = m["kernels"]["gemm_plan"]["0"]
    assert plan["w_in"].startswith("quack:")  # the SwiGLU epilogue runs on QuACK only
    assert plan["w_out"] == "scaled_mm" or plan["w_out"].startswith("quack:")
    assert "scaled_mm" in m["kernels"]["warm_up"]["0"]["gemm_us"]["w_out"]  # cuBLASLt's C
    assert m["kernels"]["quack"]["dir"] == "kernels/quack"
    assert m["kernels"]["warm_up"]["0"]["quack_compiled"]
    assert any(f.startswith("kernels/quack/") and f.endswith(".o") for f in m["files"])
    assert ready_check(engine) == 0
