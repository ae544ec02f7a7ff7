"""GPU paths against their plain references (skipped without CUDA)."""

import pytest
import torch

from charengine import fp8
from charengine.config import preset
from charengine.characters.config import Switches
from charengine.assemble import rank_session, rank_state
from charengine.mapping import Mapping
from charengine.characters.weights import random_weights
from rollout import rel_err, session_inputs

pytestmark = pytest.mark.gpu
STEPS = 60  # filling, calibration, steady, one reset (42)


def run(cfg, device, graphed=False, sync_check=False, gemm_plan=None):
    kw = {"gemm_plan": gemm_plan} if gemm_plan else {}
    s = rank_session(cfg, rank_state(cfg, random_weights(cfg.model, 0)), Mapping.single(device),
                     graphed=graphed, **kw)
    ref, prompt, noise, audio = (t.to(device) for t in session_inputs(cfg.model, STEPS))
    outs = []
    with torch.inference_mode():
        s.start(ref, prompt)
        for k in range(STEPS):
            if sync_check and k == cfg.cache.calibration_steps + 2:
                torch.cuda.set_sync_debug_mode("error")
            outs.append(s.step(noise[k], audio[k]))
        torch.cuda.set_sync_debug_mode("default")
    return torch.stack(outs).cpu()


def test_graphed_steps_equal_eager_steps_and_never_sync():
    cfg = preset("tiny")
    eager = run(cfg, "cuda")
    graphed = run(cfg, "cuda", True, sync_check=True)
    assert rel_err(eager, graphed).max() < 1e-3


def test_graphed_steps_with_the_residual_in_the_gemm_epilogue_match_the_plain_add():
    """gemm_residual (cuBLASLt's C input, called through ctypes) captured in CUDA graphs,
    against the default path's residual add inside the norm kernel, eager."""
    cfg = preset("tiny")
    on = run(cfg.replace(switches=Switches(gemm_residual=True)), "cuda", True,
             sync_check=True)
    assert rel_err(run(cfg, "cuda"), on).max() < 5e-3


@pytest.mark.parametrize("plan", [None, {"w_in": "quack:128,64,2,1,0",
                                          "w_out": "quack:128,192,2,1,1"}])
def test_graphed_steps_with_swiglu_in_the_gemm_epilogue_match_the_plain_block(plan):
    """gemm_swiglu (QuACK's epilogue; skipped without quack-kernels) and the residual in the
    output projection's epilogue, captured in CUDA graphs, against the default block."""
    pytest.importorskip("quack")
    cfg = preset("tiny")
    on = run(cfg.replace(switches=Switches(gemm_swiglu=True, gemm_residual=True)), "cuda",
             True, sync_check=True, gemm_plan=plan)
    assert rel_err(run(cfg, "cuda"), on).max() < 5e-3


def test_gpu_step_matches_cpu_step():
    cfg = preset("tiny")
    assert rel_err(run(cfg, "cpu"), run(cfg, "cuda")).max() < 3e-2


@pytest.mark.parametrize("m,k,n", [(757, 7680, 28160), (757, 12800, 7680), (33, 64, 48)])
def test_scaled_mm_matches_cpu_emulation(m, k, n):
    g = torch.Generator().manual_seed(0)
    aq, a_s = fp8.quantize_rows(torch.randn(m, k, generator=g))
    wq, ws = fp8.quantize_rows(torch.randn(n, k, generator=g))
    ref = fp8.scaled_mm(aq, a_s, wq, ws[:, 0], torch.float32)
    out = fp8.scaled_mm(aq.cuda(), a_s.cuda(), wq.cuda(), ws[:, 0].cuda(), torch.bfloat16).float().cpu()
    assert ((out - ref).norm() / ref.norm()) < 1e-2
