"""Batched steps (stepping.Together over the LiveTalk family's chunk_steps): sessions over
one model stepped together in batches whose members change from step to step (some sessions
stepping alone between), across position resets, give each session's latents as it gives
them alone: bit for bit in bf16 with FP8 (the tiny engine's numerics on the CPU), within
FP32_BOUND in fp32 (the CPU's GEMMs block a larger M differently); on a GPU the graphs
captured per batch size replay what the eager batches compute, bit for bit."""

import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from charengine.assemble import rank_session
from charengine.config import EngineConfig, Numerics
from charengine.family import family
from charengine.livetalk.spec import TINY, LiveTalkSwitches
from charengine.livetalk.step import chunk_steps
from charengine.mapping import Mapping
from charengine.stepping import Together

FAM = family("livetalk")
FP32 = Numerics(dtype="float32", fp8_gemm=False, fp8_attention=False)
FP32_BOUND = 1e-5  # fp32 latents, batched against alone
SESSIONS, STEPS = 3, 16


def first_session(numerics, switches, device="cpu", graphed=False):
    cfg = EngineConfig(model=TINY, switches=switches, numerics=numerics)
    full = FAM.random_weights(TINY, 0)
    return rank_session(cfg, FAM.rank_state(cfg, full), Mapping.single(device),
                        tables=FAM.bake_tables(cfg, full), graphed=graphed)


def feeds(seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    sh = FAM.step_shapes(TINY)
    start = (torch.randn(sh.reference, generator=g).to(device),
             torch.randn(sh.prompt, generator=g).to(device))
    return start, [(torch.randn(sh.noise_shape, generator=g).to(device),
                    torch.randn(sh.features, generator=g).to(device)) for _ in range(STEPS)]


def members(k: int) -> list[int]:
    """The sessions of step k's batch: a changing set (the others step alone)."""
    return [i for i in range(SESSIONS) if (k + i) % 4]


def together(first, together_of, device="cpu"):
    """Every session's latents, stepped in changing batches where their steps may join one;
    and how many batches ran."""
    ins = [feeds(10 + i, device) for i in range(SESSIONS)]
    sessions = [first.sibling() for _ in range(SESSIONS)]
    run = together_of(sessions)
    outs, batches = [[] for _ in sessions], 0
    with torch.inference_mode():
        for s, (start, _) in zip(sessions, ins):
            s.start(*start)
        for k in range(STEPS):
            joined = [i for i in members(k) if sessions[i].batch_kind() is not None]
            if len(joined) < 2:
                joined = []
            else:
                batches += 1
                latents = run([sessions[i] for i in joined], [ins[i][1][k][0] for i in joined],
                              [ins[i][1][k][1] for i in joined])
                for i, x in zip(joined, latents):
                    outs[i].append(x.cpu())
            for i, s in enumerate(sessions):
                if i not in joined:
                    outs[i].append(s.step(*ins[i][1][k]).cpu())
    return outs, batches


def alone(first, device="cpu"):
    outs = []
    with torch.inference_mode():
        for i in range(SESSIONS):
            s = first.sibling()
            start, steps = feeds(10 + i, device)
            s.start(*start)
            outs.append([s.step(*x).cpu() for x in steps])
    return outs


@pytest.mark.parametrize("numerics", ["fp8", "fp32"])
def test_sessions_stepped_in_changing_batches_give_their_latents_alone(numerics):
    nm, sw = (Numerics(), LiveTalkSwitches()) if numerics == "fp8" else \
        (FP32, dataclasses.replace(LiveTalkSwitches(), fp8_kv=False))
    first = first_session(nm, sw)
    solo = alone(first)
    batched, batches = together(first, lambda ss: Together(first, SESSIONS))
    cache = first.cache
    resets = [k for k in range(STEPS) if cache.is_reset(k)]
    assert batches >= 6 and len(resets) >= 2
    for i in range(SESSIONS):
        assert len(batched[i]) == STEPS
        for a, b in zip(solo[i], batched[i]):
            if numerics == "fp8":
                assert torch.equal(a, b), i
            else:
                assert (a - b).abs().max() <= FP32_BOUND, i
    assert not torch.equal(batched[0][-1], batched[1][-1])


def test_a_batch_step_traces_into_one_graph_per_batch_size():
    """The batched step as a GPU's graphs replay it: traced whole (no host sync or branch on
    a device value breaks it) once per batch size, whatever sessions make up a batch and
    across their resets; each session's latents still its latents alone, bit for bit."""
    torch._dynamo.reset()
    first = first_session(Numerics(), LiveTalkSwitches())
    solo = alone(first)
    graphs = CompileCounterWithBackend("aot_eager")  # counts the graphs traced
    counts = BatchSizes(torch.compile(chunk_steps, fullgraph=True, dynamic=False,
                                      backend=graphs))

    def traced(sessions):
        run = Together(first, SESSIONS)
        run.step = counts
        return run

    batched, batches = together(first, traced)
    assert batches >= 6 and counts.sizes == set(range(2, SESSIONS + 1)), counts.sizes
    assert graphs.frame_count == len(counts.sizes)
    for i in range(SESSIONS):
        assert all(torch.equal(a, b) for a, b in zip(solo[i], batched[i])), i


class BatchSizes:
    """A batched step's calls: the batch sizes it was called with."""

    def __init__(self, step):
        self.step, self.sizes = step, set()

    def __call__(self, model, caches, noises, audios, kinds):
        self.sizes.add(len(caches))
        return self.step(model, caches, noises, audios, kinds)


def test_a_batch_takes_only_steps_that_may_join_one():
    first = first_session(Numerics(), LiveTalkSwitches())
    run = Together(first, 2)
    a, b = first.sibling(), first.sibling()
    start, steps = feeds(3, "cpu")
    with torch.inference_mode():
        a.start(*start)
        b.start(*start)
        assert a.batch_kind() is None  # a session's first chunk fills its cache: alone
        with pytest.raises(ValueError, match="does not join a batch"):
            run([a, b], [steps[0][0]] * 2, [steps[0][1]] * 2)
        with pytest.raises(ValueError, match="takes 2 to 2"):
            run([a, b, a], [steps[0][0]] * 3, [steps[0][1]] * 3)
    plain = first_session(Numerics(), dataclasses.replace(LiveTalkSwitches(), ring_cache=False))
    with torch.inference_mode():
        plain.start(*start)
        for x in steps:
            plain.step(*x)
            assert plain.batch_kind() is None  # without the ring every chunk runs alone


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_batch_graphs_replay_what_eager_batches_compute_on_a_gpu(fp8):
    """tiny-livetalk on the GPU: the batches replayed from graphs captured once per batch
    size (Together.capture, from a warmed-up session, as charrun's worker does) against the
    same batches stepped eagerly, bit for bit, across resets and changing members."""
    sw = LiveTalkSwitches() if fp8 else dataclasses.replace(LiveTalkSwitches(), fp8_kv=False)
    nm = Numerics() if fp8 else Numerics(fp8_gemm=False, fp8_attention=False)
    outs = {}
    for graphed in (False, True):
        first = first_session(nm, sw, "cuda", graphed=True)
        FAM.warm_up(first)
        run = Together(first, SESSIONS)
        if graphed:
            run.capture(first, FAM.step_shapes(TINY))
            assert sorted(run.graphs) == list(range(2, SESSIONS + 1))
        outs[graphed], _ = together(first, lambda ss: run, "cuda")
    for a, b in zip(outs[False], outs[True]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
