"""The steady-state step takes only tensors and mutates only tensors: it traces into one graph
with no break (a host sync such as .item() would break it) and replays across steps, ring
wraps and resets without recompiling (a Python int position would be a guard that fails)."""

import torch
from torch._dynamo.testing import CompileCounterWithBackend

from charengine.config import EngineConfig, preset
from charengine.assemble import rank_session, rank_state
from charengine.family import family
from charengine.livetalk.spec import TINY as LIVETALK_TINY, LiveTalkSwitches
from charengine.livetalk.step import ChunkSteps, chunk_step
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


class TracedGraphs:
    """StepGraphs' choice of a step on the CPU, with a traced step for the graphs: a chunk
    that has a graph runs `traced` with the static arguments that graph is captured with;
    the others run eagerly, and the first steady one names the graphs (rule.captures)."""

    def __init__(self, rule, traced):
        self.rule, self.traced = rule, traced
        self.statics: dict = {}  # each graph's static arguments, as StepGraphs captures them
        self.replayed: set = set()

    def __call__(self, model, cache, noise, audio, **kind):
        key = self.rule.graph_key(cache, kind)
        if key in self.statics:
            self.replayed.add(key)
            return self.traced(model, cache, noise, audio, **self.statics[key])
        out = chunk_step(model, cache, noise, audio, **kind)
        if not self.statics and key is not None and self.rule.captures_at(cache, kind):
            self.statics = dict(self.rule.captures(cache, kind))
        return out


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
    graphs = CompileCounterWithBackend("aot_eager")  # counts the graphs traced
    replays = TracedGraphs(ChunkSteps(cfg), torch.compile(chunk_step, fullgraph=True,
                                                          dynamic=False, backend=graphs))

    def session(step_fn=None):
        return rank_session(cfg, fam.rank_state(cfg, full), Mapping.single(),
                            tables=fam.bake_tables(cfg, full), graphed=False, step_fn=step_fn)

    eager, fast = session(), session(replays)
    shapes = fam.step_shapes(LIVETALK_TINY)
    steps = fast.rule.steady_step + 3 * cfg.cache.reset_period + 1  # wraps and resets in each
    with torch.inference_mode(), torch._dynamo.config.patch(recompile_limit=64):
        for n in range(3):
            g = torch.Generator().manual_seed(n)
            ref, prompt = torch.randn(shapes.reference, generator=g), \
                torch.randn(shapes.prompt, generator=g)
            eager.start(ref, prompt)
            fast.start(ref, prompt)
            replays.replayed.clear()
            if n == 2:  # every graph seen: the third session only replays
                torch.compiler.set_stance("fail_on_recompile")
            try:
                for k in range(steps):
                    noise = torch.randn(shapes.noise_shape, generator=g)
                    audio = torch.randn(shapes.features, generator=g)
                    assert torch.equal(eager.step(noise, audio), fast.step(noise, audio)), (n, k)
            finally:
                torch.compiler.set_stance("default")
    assert replays.replayed == set(replays.statics), (replays.replayed, replays.statics)
    assert len(replays.statics) > 2  # the fill chunks' graphs besides the steady and reset ones
    assert graphs.frame_count == len(replays.statics)  # one trace a graph: none in the third
