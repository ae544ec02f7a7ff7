"""The steady-state step takes only tensors and mutates only tensors: it traces into one graph
with no break (a host sync such as .item() would break it) and replays across steps, ring
wraps and resets without recompiling (a Python int position would be a guard that fails)."""

import torch
from torch._dynamo.testing import CompileCounterWithBackend

from charengine.config import EngineConfig, preset
from charengine.assemble import rank_session, rank_state
from charengine.family import family
from charengine.livetalk.spec import TINY as LIVETALK_TINY, LiveTalkSwitches
from charengine.livetalk.step import chunk_step
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


def test_livetalk_chunks_compile_fullgraph_and_replay_across_wraps_and_resets():
    """LiveTalk's chunk step as its CUDA graphs replay it: each graphed chunk (the fill
    chunks, the steady and the reset chunk) runs with the static arguments its graph was
    captured with, traced into one graph with no break, and a third session replays every
    one across ring wraps and resets without recompiling; each chunk equals the eager
    session's."""
    torch._dynamo.reset()
    fam = family("livetalk")
    cfg = EngineConfig(model=LIVETALK_TINY, switches=LiveTalkSwitches())
    full = fam.random_weights(LIVETALK_TINY, 0)

    def session():
        return rank_session(cfg, fam.rank_state(cfg, full), Mapping.single(),
                            tables=fam.bake_tables(cfg, full), graphed=False)

    eager, fast = session(), session()
    graphs = CompileCounterWithBackend("aot_eager")  # counts the graphs traced
    rule = fast.rule
    compiled = torch.compile(chunk_step, fullgraph=True, dynamic=False, backend=graphs)
    shapes = fam.step_shapes(LIVETALK_TINY)
    steps = rule.steady_step + 3 * cfg.cache.reset_period + 1  # wraps and resets in each
    statics: dict = {}  # each graph's static arguments, as StepGraphs captures them
    replayed = set()
    with torch.inference_mode(), torch._dynamo.config.patch(recompile_limit=64):
        for n in range(3):
            g = torch.Generator().manual_seed(n)
            ref, prompt = torch.randn(shapes.reference, generator=g), \
                torch.randn(shapes.prompt, generator=g)
            eager.start(ref, prompt)
            fast.start(ref, prompt)
            if n == 2:  # every graph seen: the third session only replays
                torch.compiler.set_stance("fail_on_recompile")
            try:
                for k in range(steps):
                    noise = torch.randn(shapes.noise_shape, generator=g)
                    audio = torch.randn(shapes.features, generator=g)
                    a = eager.step(noise, audio)
                    kind = rule.kind(k)
                    key = rule.graph_key(fast.cache, kind)
                    rule.before(fast.cache, k)
                    if key in statics:
                        b = compiled(fast.model, fast.cache, noise, audio, **statics[key])
                        replayed.add((n, key))
                    else:
                        b = chunk_step(fast.model, fast.cache, noise, audio, **kind)
                        if not statics and key is not None and rule.captures_at(fast.cache,
                                                                                kind):
                            statics = dict(rule.captures(fast.cache, kind))
                    fast.k += 1
                    assert torch.equal(a, b), (n, k, key)
            finally:
                torch.compiler.set_stance("default")
    assert {key for n, key in replayed if n == 2} == set(statics), (replayed, statics)
    assert len(statics) > 2  # the fill chunks' graphs besides the steady and reset ones
    assert graphs.frame_count == len(statics)  # one trace a graph: none in the third session
