"""Engines start without compiling (GPU; skipped without CUDA, run on the device): a fresh
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
