"""Checkpoints as released models come: shards listed by their index, and a LoRA merged into
the weights before quantization (charbuild --weights DIR --lora FILE). On the tiny LiveTalk
engine: a sharded checkpoint builds the engine its single file builds, bit for bit; a LoRA in
PEFT's layout (a trainer's prefix, alpha in the metadata) and in kohya's (alpha tensors)
builds the engine of the checkpoint merged by W + alpha / rank * B @ A; a missing shard, a
tensor its index misplaces, a LoRA for another base (a module it lacks, a shape that does
not fit), a non-finite LoRA: one line naming the tensor, and no engine written."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from charengine.builder.build import build
from charengine.builder.build_config import BuildConfig
from charengine.checkpoint import CheckpointError
from charengine.family import family
from charengine.livetalk.spec import TINY
from charengine.lora import base_name, read_lora

FAM = family("livetalk")
TARGET = "cpu-tiny-livetalk"
RANK = 4
ADAPTED = ("blocks.0.self_attn.q", "blocks.1.ffn.0")


@pytest.fixture(scope="module")
def base():
    return {k: v.contiguous() for k, v in FAM.random_weights(TINY, 3).items()}


def engine(tmp_path, name, weights, lora=None):
    out = tmp_path / name
    build(BuildConfig(TARGET, out, weights=weights, random_side_networks=True, lora=lora),
          log=lambda s: None)
    with safe_open(str(out / "rank0.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, json.loads((out / "manifest.json")
                                                                   .read_text())


def shard(state: dict, folder, parts: int = 3):
    folder.mkdir()
    names = sorted(state)
    weight_map = {}
    for i in range(parts):
        file = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        chunk = names[i::parts]
        save_file({k: state[k] for k in chunk}, str(folder / file))
        weight_map |= {k: file for k in chunk}
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return folder


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(
        torch.uint8)) for k in a)


def adapters(base: dict, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m in ADAPTED:
        n_out, n_in = base[f"{m}.weight"].shape
        out[m] = (0.05 * torch.randn(RANK, n_in, generator=g),
                  0.05 * torch.randn(n_out, RANK, generator=g))
    return out


def merged(base: dict, ads: dict, alpha: float) -> dict:
    out = dict(base)
    for m, (a, b) in ads.items():
        w = base[f"{m}.weight"]
        out[f"{m}.weight"] = (w.float() + alpha / RANK * (b @ a)).to(w.dtype)
    return out


def test_a_sharded_checkpoint_builds_the_engine_of_its_single_file(tmp_path, base):
    save_file(base, str(tmp_path / "model.safetensors"))
    single, m1 = engine(tmp_path, "single", tmp_path / "model.safetensors")
    folder = shard(base, tmp_path / "shards")
    for i, weights in enumerate((folder, folder / "model.safetensors.index.json")):
        sharded, m2 = engine(tmp_path, f"sharded{i}", weights)
        assert equal(single, sharded)
        assert m2["weights"]["sha256"] != m1["weights"]["sha256"]  # the shards' own digest


def test_a_lora_in_either_layout_builds_the_engine_of_the_merged_checkpoint(tmp_path, base):
    ads = adapters(base, 1)
    save_file(merged(base, ads, alpha=8.0), str(tmp_path / "merged.safetensors"))
    want, _ = engine(tmp_path, "want", tmp_path / "merged.safetensors")
    save_file(base, str(tmp_path / "base.safetensors"))
    peft = {f"diffusion_model.{m}.lora_{x}.weight": t for m, (a, b) in ads.items()
            for x, t in (("A", a), ("B", b))}
    save_file(peft, str(tmp_path / "peft.safetensors"), metadata={"lora_alpha": "8"})
    kohya = {f"{m}.lora_{x}.weight": t for m, (a, b) in ads.items()
             for x, t in (("down", a), ("up", b))} | \
        {f"{m}.alpha": torch.tensor(8.0) for m in ads}
    save_file(kohya, str(tmp_path / "kohya.safetensors"))
    for layout in ("peft", "kohya"):
        got, manifest = engine(tmp_path, layout, tmp_path / "base.safetensors",
                               lora=tmp_path / f"{layout}.safetensors")
        assert equal(want, got), layout
        src = manifest["weights"]
        assert (src["modules"], src["ranks"], src["alphas"]) == (2, [RANK], [8.0]), src
    plain, _ = engine(tmp_path, "plain", tmp_path / "base.safetensors")
    assert not equal(plain, want)  # the LoRA changed what it adapts


def one_line(tmp_path, name, *args) -> str:
    out = tmp_path / name
    r = subprocess.run([sys.executable, "-m", "charengine.builder.cli", "--target", TARGET,
                        "--out", str(out), "--random-side-networks", *map(str, args)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists()
    return r.stderr


def test_a_damaged_checkpoint_or_a_lora_for_another_base_is_one_line(tmp_path, base):
    folder = shard(base, tmp_path / "shards")
    (folder / "model-00002-of-00003.safetensors").unlink()
    err = one_line(tmp_path, "e1", "--weights", folder)
    assert "shard 'model-00002-of-00003.safetensors' is missing (it holds" in err, err
    folder = shard(base, tmp_path / "shards2")
    index = folder / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    name = next(iter(doc["weight_map"]))
    doc["weight_map"][name] = "model-00003-of-00003.safetensors" \
        if doc["weight_map"][name] != "model-00003-of-00003.safetensors" \
        else "model-00001-of-00003.safetensors"
    index.write_text(json.dumps(doc))
    err = one_line(tmp_path, "e2", "--weights", index)
    assert f"no tensor {name!r}, which model.safetensors.index.json places in it" in err, err

    save_file(base, str(tmp_path / "base.safetensors"))
    ads = adapters(base, 2)
    a, b = ads["blocks.0.self_attn.q"]
    cases = {
        "other": ({"blocks.0.self_attn.zz.lora_A.weight": a,
                   "blocks.0.self_attn.zz.lora_B.weight": b},
                  "adapts 'blocks.0.self_attn.zz', which"),
        "shape": ({"blocks.0.ffn.2.lora_A.weight": a, "blocks.0.ffn.2.lora_B.weight": b},
                  "adapts 'blocks.0.ffn.2.weight' of shape"),
        "nan": ({"blocks.0.self_attn.q.lora_A.weight": torch.full_like(a, float("nan")),
                 "blocks.0.self_attn.q.lora_B.weight": b},
                "the down matrix of 'blocks.0.self_attn.q' holds non-finite values"),
        "rank": ({"blocks.0.self_attn.q.lora_A.weight": a[:2],
                  "blocks.0.self_attn.q.lora_B.weight": b},
                 "has rank 4 and 'blocks.0.self_attn.q.lora_A.weight' rank 2"),
    }
    for case, (tensors, said) in cases.items():
        save_file(tensors, str(tmp_path / f"{case}.safetensors"))
        err = one_line(tmp_path, f"l-{case}", "--weights", tmp_path / "base.safetensors",
                       "--lora", tmp_path / f"{case}.safetensors")
        assert said in err, (case, err)


def test_a_lora_module_names_its_base_with_a_trainers_prefix_taken_off(tmp_path):
    state = {"blocks.0.q.weight": None}
    assert base_name("diffusion_model.blocks.0.q", state) == "blocks.0.q.weight"
    assert base_name("base_model.model.blocks.0.q", state) == "blocks.0.q.weight"
    assert base_name("blocks.0.q", state) == "blocks.0.q.weight"
    assert base_name("unet.blocks.0.q", state) is None
    save_file({"x": torch.zeros(1)}, str(tmp_path / "none.safetensors"))
    with pytest.raises(CheckpointError, match="no LoRA tensors"):
        read_lora(tmp_path / "none.safetensors")
