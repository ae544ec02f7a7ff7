import pickle

import pytest
import torch
from safetensors.torch import save_file

from charengine.characters.spec import PRESETS
from charengine.checkpoint import CheckpointError
from charengine.characters.weights import load_checkpoint, param_shapes, random_weights

SPEC = PRESETS["tiny"]


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    state = random_weights(SPEC, 0)
    save_file(state, str(path))
    return path, state


def test_good_checkpoint_loads_exactly(good):
    path, state = good
    loaded, side = load_checkpoint(path, SPEC)
    assert side == {}
    assert set(loaded) == set(param_shapes(SPEC))
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_missing_tensor_is_named(good, tmp_path):
    _, state = good
    del state["blocks.1.w_out"]
    save_file(state, str(tmp_path / "m.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'blocks.1.w_out' \(shape \[64, 320\]"):
        load_checkpoint(tmp_path / "m.safetensors", SPEC)


def test_wrong_shape_names_tensor_and_both_shapes(good, tmp_path):
    _, state = good
    state["blocks.0.w_in"] = torch.zeros(10, 64)
    save_file(state, str(tmp_path / "s.safetensors"))
    with pytest.raises(CheckpointError,
                       match=r"'blocks.0.w_in' has shape \[10, 64\], tiny needs \[704, 64\]"):
        load_checkpoint(tmp_path / "s.safetensors", SPEC)


def test_wrong_dtype_is_named(good, tmp_path):
    _, state = good
    state["final.bias"] = torch.zeros(32, dtype=torch.int32)
    save_file(state, str(tmp_path / "d.safetensors"))
    with pytest.raises(CheckpointError, match="'final.bias' has dtype torch.int32"):
        load_checkpoint(tmp_path / "d.safetensors", SPEC)


def test_pickle_is_never_loaded(tmp_path):
    path = tmp_path / "evil.safetensors"
    path.write_bytes(pickle.dumps({"x": 1}))
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_checkpoint(path, SPEC)


def test_checkpoint_for_another_preset_is_refused(tmp_path):
    save_file(random_weights(PRESETS["tiny-10h"], 0), str(tmp_path / "o.safetensors"))
    with pytest.raises(CheckpointError, match="has shape"):
        load_checkpoint(tmp_path / "o.safetensors", SPEC)


def test_rank_weights_made_one_tensor_at_a_time_equal_the_sharded_checkpoint():
    from charengine.characters.spec import RankShape
    from charengine.characters.weights import RandomWeights, quantize_block_linears, rank_weights, shard

    spec = PRESETS["tiny-10h"]
    q = quantize_block_linears(spec, random_weights(spec, 0))
    for r in range(3):
        shape = RankShape.of(spec, 3, r)
        want = shard(spec, q, shape)
        got = rank_weights(spec, RandomWeights(spec, 0), shape)
        assert set(got) == set(want)
        for name in want:
            assert torch.equal(got[name].view(torch.uint8) if got[name].dtype == torch.float8_e4m3fn
                               else got[name], want[name].view(torch.uint8)
                               if want[name].dtype == torch.float8_e4m3fn else want[name]), name
    lean = rank_weights(spec, RandomWeights(spec, 0), RankShape.of(spec, 3, 0), keep_adaln=False)
    assert not any("adaln" in n for n in lean) and "time_mlp.0.weight" in lean
