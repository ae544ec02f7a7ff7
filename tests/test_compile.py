"""The steady-state step takes only tensors and mutates only tensors: it traces into one graph
with no break (a host sync such as .item() would break it) and replays across steps, ring
wraps and resets without recompiling (a Python int position would be a guard that fails)."""

import torch

from charengine.config import preset
from charengine.assemble import rank_session, rank_state
from charengine.mapping import Mapping
from charengine.characters.step import ar_step
from charengine.characters.weights import random_weights
from rollout import session_inputs


def test_step_compiles_fullgraph_and_never_recompiles():
    torch._dynamo.reset()
    cfg = preset("tiny")
    compiled = torch.compile(ar_step, fullgraph=True, backend="aot_eager")
    eager = rank_session(cfg, rank_state(cfg, random_weights(cfg.model, 0)), Mapping.single())
    fast = rank_session(cfg, rank_state(cfg, random_weights(cfg.model, 0)), Mapping.single(),
                        step_fn=compiled)
    steps = 90
    ref, prompt, noise, audio = session_inputs(cfg.model, steps)
    eager.start(ref, prompt)
    fast.start(ref, prompt)
    warm = cfg.cache.reset_period + 1  # filling, calibration, steady and reset graphs seen
    for k in range(steps):
        if k == warm:
            torch.compiler.set_stance("fail_on_recompile")
        try:
            a = eager.step(noise[k], audio[k])
            b = fast.step(noise[k], audio[k])
        finally:
            torch.compiler.set_stance("default")
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), k
    assert fast.k == steps
