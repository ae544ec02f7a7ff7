"""The stepping machine both families share (charengine/stepping.py) and their phase rules:
the kind of each step a rule gives from the host's count, the graphs it asks for and at
which counts, and a warm-up that leaves nothing behind in the session it ran."""

import dataclasses

import pytest
import torch

from charengine.assemble import rank_session
from charengine.characters.step import FrameSteps
from charengine.config import EngineConfig, Numerics, preset
from charengine.characters.config import Switches
from charengine.family import family
from charengine.livetalk.cache import ChunkCache
from charengine.livetalk.spec import TINY, LiveTalkSwitches
from charengine.livetalk.step import RESET, STEADY, ChunkSteps
from charengine.mapping import Mapping
from charengine.stepping import StepGraphs

FP32 = Numerics(dtype="float32", fp8_gemm=False, fp8_attention=False)


def test_the_frame_rule_masks_the_fill_resets_on_its_period_and_calibrates_once():
    cfg = preset("tiny")
    cc, rule = cfg.cache, FrameSteps(cfg)
    kinds = [rule.kind(k) for k in range(3 * cc.reset_period + 1)]
    masked = [k for k, kind in enumerate(kinds) if kind["masked"]]
    assert masked == list(range(cc.window - 1))
    assert all(kinds[k]["filled"] == k + 1 for k in masked)
    assert [k for k, kind in enumerate(kinds) if kind["reset"]] == \
        [cc.reset_period, 2 * cc.reset_period, 3 * cc.reset_period]
    off = FrameSteps(cfg.replace(switches=Switches.baseline()))  # no delta rotation
    assert not any(off.kind(k)["reset"] for k in range(3 * cc.reset_period + 1))
    assert [key for key, _ in rule.captures(None, kinds[-1])] == [False, True]


def test_the_chunk_rule_names_fill_steady_and_reset_graphs_and_restores_the_cache_phase():
    cfg = EngineConfig(model=TINY)
    rule, cache = ChunkSteps(cfg), ChunkCache(cfg, "cpu", torch.float32)
    steady = cache.S + cache.W - 1
    assert cfg.cache.calibration_chunks >= steady  # the steady shape starts with the FP8 cache
    assert [rule.graph_key(cache, rule.kind(c)) for c in range(steady + 1)] == \
        list(range(steady + 1))  # before the calibration every chunk is a fill chunk
    assert not rule.captures_at(cache, rule.kind(steady))
    cache.quantized = True
    first_reset = next(c for c in range(steady, steady + cache.R + 2) if cache.is_reset(c))
    assert rule.graph_key(cache, rule.kind(first_reset)) == RESET
    assert rule.graph_key(cache, rule.kind(first_reset + 1)) == STEADY
    assert rule.captures_at(cache, rule.kind(cfg.cache.calibration_chunks))
    seen = []
    for key, kind in rule.captures(cache, rule.kind(cfg.cache.calibration_chunks)):
        seen.append((key, kind["c"], cache.quantized))
    at = cfg.cache.calibration_chunks + 1
    assert seen[:2] == [(STEADY, at, True), (RESET, first_reset, True)]
    assert [(k, c) for k, c, _ in seen[2:]] == [(f, f) for f in range(cache.first_steady())]
    assert all(q == cache.quantized_at(f) for f, _, q in seen[2:])
    assert cache.quantized  # the session's phase as it was
    no_ring = ChunkSteps(cfg.replace(switches=dataclasses.replace(cfg.switches,
                                                                  ring_cache=False)))
    assert {no_ring.graph_key(cache, no_ring.kind(c)) for c in range(12)} == {None}


def test_a_warm_up_without_graphs_runs_to_the_steady_chunk_and_leaves_no_state():
    fam = family("livetalk")
    cfg = EngineConfig(model=TINY, numerics=FP32,
                       switches=dataclasses.replace(LiveTalkSwitches(), ring_cache=False,
                                                    fp8_kv=False))
    full = fam.random_weights(TINY, 0)
    state, tables = fam.rank_state(cfg, full), fam.bake_tables(cfg, full)

    def made(graphed):
        return rank_session(cfg, state, Mapping.single("cpu"), tables=tables, graphed=graphed)

    warmed, fresh = made(True), made(False)
    assert isinstance(warmed.step_fn, StepGraphs)
    assert fam.warm_up(warmed) == warmed.rule.steady_step
    assert not warmed.step_fn.ready()  # nothing to capture without the ring
    with pytest.raises(TypeError):
        fam.warm_up(fresh)
    g = torch.Generator().manual_seed(3)
    shapes = fam.step_shapes(TINY)
    ref, prompt = torch.randn(shapes.reference, generator=g), torch.randn(shapes.prompt,
                                                                          generator=g)
    ins = [(torch.randn(shapes.noise_shape, generator=g), torch.randn(shapes.features,
                                                                      generator=g))
           for _ in range(warmed.rule.steady_step + 2)]
    outs = []
    with torch.inference_mode():
        for s in (warmed, fresh):
            s.start(ref, prompt)
            outs.append([s.step(n, a) for n, a in ins])
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def family_members() -> set[str]:
    from charengine.family import Family

    names = set()
    for part in Family.__mro__[1:]:
        if part.__module__ == "charengine.family":
            names |= {n for n in vars(part) if not n.startswith("_")}
            names |= set(getattr(part, "__annotations__", {}))
    return names


def test_both_families_have_every_declared_member_and_nothing_else_is_used():
    import pathlib
    import re

    from charengine.family import FAMILIES

    declared = family_members()
    for name in FAMILIES:
        fam = family(name)
        assert not [m for m in declared if not hasattr(fam, m)], name
    use = re.compile(r"(?:\bfam|\bfamily|self\.family|family_of\([^)]*\))\.([a-z_]+)\b")
    root = pathlib.Path(__file__).resolve().parent.parent / "charengine"
    used = {m.group(1) for sub in ("runtime", "builder") for p in (root / sub).rglob("*.py")
            for m in use.finditer(p.read_text())}
    assert used and used <= declared, sorted(used - declared)


def test_charbuild_takes_each_familys_declared_build_inputs():
    from click.testing import CliRunner

    from charengine.builder.cli import main
    from charengine.family import FAMILIES

    out = CliRunner().invoke(main, ["--help"]).output
    flags = [inp.flag for name in FAMILIES for inp in family(name).build_inputs]
    assert flags and all(flag in out for flag in flags)


@pytest.mark.parametrize("preset_name", ["tiny", "tiny-livetalk"])
def test_sibling_sessions_share_the_weights_and_step_as_if_alone(preset_name):
    """Three sessions over one model, each with its own cache, inputs and step count,
    stepped interleaved (in an uneven order, one joining late) give each session's frames
    bit for bit as it gives them alone: nothing of one session reaches another."""
    cfg = preset(preset_name) if preset_name == "tiny" else \
        EngineConfig(model=TINY, numerics=FP32,
                     switches=dataclasses.replace(LiveTalkSwitches(), fp8_kv=False))
    fam = family(cfg.family)
    full = fam.random_weights(cfg.model, 0)
    state, tables = fam.rank_state(cfg, full), fam.bake_tables(cfg, full)
    shapes, steps = fam.step_shapes(cfg.model), 8

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        ref, prompt = torch.randn(shapes.reference, generator=g), \
            torch.randn(shapes.prompt, generator=g)
        return ref, prompt, [(torch.randn(shapes.noise_shape, generator=g),
                              torch.randn(shapes.features, generator=g)) for _ in range(steps)]

    def alone(seed):
        s = rank_session(cfg, state, Mapping.single("cpu"), tables=tables)
        ref, prompt, ins = inputs(seed)
        with torch.inference_mode():
            s.start(ref, prompt)
            return [s.step(n, a) for n, a in ins]

    first = rank_session(cfg, state, Mapping.single("cpu"), tables=tables)
    sessions = [first, first.sibling(), first.sibling()]
    assert all(s.model is first.model for s in sessions)
    assert len({id(s.cache) for s in sessions}) == 3
    outs, feeds = [[] for _ in sessions], [inputs(10 + i) for i in range(3)]
    order = [0, 1, 0, 0, 1, 1, 0, 1] * 3 + [2] * 3 + [0, 1, 2] * 8
    with torch.inference_mode():
        for i in (0, 1):
            sessions[i].start(*feeds[i][:2])
        for i in order:
            if i == 2 and not outs[2] and sessions[2].k == 0:
                sessions[2].start(*feeds[2][:2])  # joins after the others have run
            if len(outs[i]) < steps:
                outs[i].append(sessions[i].step(*feeds[i][2][len(outs[i])]))
    assert [len(o) for o in outs] == [steps] * 3
    for i in range(3):
        assert all(torch.equal(a, b) for a, b in zip(outs[i], alone(10 + i))), i
    assert not torch.equal(outs[0][-1], outs[1][-1])
