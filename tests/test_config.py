import dataclasses

import pytest

from charengine.characters.spec import PRESETS, RankShape
from charengine.config import EngineConfig, Numerics, preset
from charengine.characters.config import CacheSpec, Switches


def test_characters_57b_numbers_match_the_paper():
    m = PRESETS["characters-57b"]
    assert m.tokens_per_frame == 757
    assert m.global_tokens == 1246
    assert m.global_tokens + CacheSpec().window * m.tokens_per_frame == 5788
    assert m.head_dim == 128 and m.n_heads == 60
    assert (m.out_h, m.out_w) == (704, 1088)
    assert 56.0e9 < m.block_linear_params() < 57.5e9
    # GEMM FLOP per step: 2 * params * tokens * passes ~ 343 TFLOP (paper §2)
    tflop = 2 * m.block_linear_params() * m.tokens_per_frame * 4 / 1e12
    assert 340 < tflop < 346


def test_fused_pre_attention_needs_rope_at_write():
    with pytest.raises(ValueError, match="fused_pre_attention"):
        preset("tiny", switches=Switches(rope_at_write=False, delta_rotation=False,
                                         ring_cache=False))


def test_ring_without_rope_at_write_is_rejected():
    with pytest.raises(ValueError, match="rope_at_write"):
        preset("tiny", switches=Switches(rope_at_write=False, delta_rotation=False))


def test_tp_larger_than_heads_is_rejected():
    with pytest.raises(ValueError, match="heads are split whole"):
        preset("tiny", tp=5)


def test_window_longer_than_reset_period_is_rejected():
    with pytest.raises(ValueError, match="reset period"):
        preset("tiny", cache=CacheSpec(window=50))


def test_fp8_kv_needs_fp8_attention():
    with pytest.raises(ValueError, match="fp8_attention"):
        preset("tiny", numerics=Numerics(fp8_attention=False))


def test_delta_rotation_goes_with_rope_at_write():
    with pytest.raises(ValueError, match="delta_rotation"):
        preset("tiny", switches=Switches(delta_rotation=False))


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(ValueError, match="tiny"):
        preset("nope")


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 5, 6, 7, 8])
def test_rank_shapes_cover_heads_and_mlp_exactly_once(tp):
    spec = PRESETS["characters-57b"]
    shapes = [RankShape.of(spec, tp, r) for r in range(tp)]
    assert sum(s.heads for s in shapes) == spec.n_heads
    assert sum(s.mlp for s in shapes) == spec.mlp_hidden
    assert all(s.mlp % spec.mlp_align == 0 for s in shapes)
    assert max(s.heads for s in shapes) - min(s.heads for s in shapes) <= 1
    for a, b in zip(shapes, shapes[1:]):
        assert b.head_offset == a.head_offset + a.heads
        assert b.mlp_offset == a.mlp_offset + a.mlp


def test_tp7_splits_unevenly_and_aligned():
    spec = PRESETS["characters-57b"]
    heads = [RankShape.of(spec, 7, r).heads for r in range(7)]
    assert heads == [9, 9, 9, 9, 8, 8, 8]
    # 30,720 / 7 is not whole: blocks of 128 go unevenly (_scaled_mm needs a multiple of 16)
    assert [RankShape.of(spec, 7, r).mlp for r in range(7)] == [4480, 4480, 4352, 4352, 4352,
                                                                  4352, 4352]


def test_cumulative_arms_follow_figure_2():
    assert Switches.cumulative("baseline") == Switches.baseline()
    ring = Switches.cumulative("ring_cache")
    assert ring.baked_adaln and ring.rope_at_write and ring.delta_rotation and ring.ring_cache
    assert not ring.fp8_kv and not ring.conditioning_cache
    assert Switches.cumulative(Switches.ORDER[-1]) == Switches()
    for name in Switches.ORDER:  # every arm is a valid config
        EngineConfig(model=PRESETS["tiny"], switches=Switches.cumulative(name))


def test_configs_are_frozen():
    cfg = preset("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tp = 2


def test_fast_accumulation_names_its_linears_and_reads_back_from_json():
    """The numerics say which block linears sum without promotion; a manifest's JSON list reads
    back as the same numerics, unset means every linear, and a linear the family does not
    have is refused by name."""
    import json

    n = Numerics(fast_accum=True, fast_accum_linears=("w_in",))
    assert n.fast_accum_for("w_in") and not n.fast_accum_for("w_out")
    assert Numerics().fast_accum_for("w_in") and Numerics().fast_accum_for("w_out")
    assert not Numerics(fast_accum=False).fast_accum_for("w_in")
    assert Numerics(**json.loads(json.dumps(n.__dict__))) == n
    with pytest.raises(ValueError, match="w_up"):
        preset("tiny", numerics=Numerics(fast_accum_linears=("w_up",)))
