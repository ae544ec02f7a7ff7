"""charbuild's engine directory and charrun's checks: each damage or mismatch is refused
with one clear line, never a traceback."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from charengine.engine_format import MANIFEST, this_machine
from charengine.runtime.engine import Engine, EngineError, check_machine
from charengine.target import Target
from engines import ROOT, TARGETS, build_target


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    return build_target(tmp_path_factory.mktemp("eng"))


@pytest.fixture
def copy(engine_dir, tmp_path):
    dst = tmp_path / "engine"
    shutil.copytree(engine_dir, dst)
    return dst


def test_engine_holds_manifest_rank_weights_and_tables(engine_dir):
    m = json.loads((engine_dir / "manifest.json").read_text())
    assert m["format_version"] == 2 and m["tp"] == 1 and m["target"]["name"] == "cpu-tiny"
    assert set(m["files"]) == {"rank0.safetensors", "adaln.safetensors", "side.safetensors"}
    assert m["ranks"] == [0] and m["kernels"]["compiled"] is False  # a CPU target has none
    assert m["files"]["rank0.safetensors"]["bytes"] == (engine_dir / "rank0.safetensors").stat().st_size
    assert m["built_with"]["torch"] == torch.__version__
    assert m["rank_devices"] == {"decoder": "cpu", "tp": ["cpu"]}
    rank = load_file(str(engine_dir / "rank0.safetensors"))
    assert rank["blocks.0.w_in.q"].dtype == torch.float8_e4m3fn
    assert rank["blocks.0.w_in.scale"].shape == (rank["blocks.0.w_in.q"].shape[0],)
    tables = load_file(str(engine_dir / "adaln.safetensors"))
    assert tables["adaln_table"].shape == (4, 2, 3, 64)
    Engine.load(engine_dir)


def test_every_target_file_is_valid():
    names = {p.stem for p in TARGETS.glob("*.toml")}
    assert {"cpu-tiny", "h200-tp1", "h100-tp3", "h100-tp7", "b200-tp2"} <= names
    for p in TARGETS.glob("*.toml"):
        t = Target.from_toml(p)
        t.config()
        assert t.name == p.stem


def test_format_version_mismatch(copy):
    m = json.loads((copy / "manifest.json").read_text())
    m["format_version"] = 99
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineError, match="engine format 99, this charrun reads format 2"):
        Engine.load(copy)


def test_a_format_version_that_is_not_a_number_is_named_as_such(copy):
    m = json.loads((copy / "manifest.json").read_text())
    m["format_version"] = str(m["format_version"])
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineError, match="field 'format_version' is str, expected int"):
        Engine.load(copy)


def test_checksum_mismatch(copy):
    data = bytearray((copy / "rank0.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (copy / "rank0.safetensors").write_bytes(bytes(data))
    with pytest.raises(EngineError, match="checksum mismatch in rank0.safetensors"):
        Engine.load(copy)


def test_missing_file(copy):
    (copy / "side.safetensors").unlink()
    with pytest.raises(EngineError, match="engine file side.safetensors is missing"):
        Engine.load(copy)


def test_not_an_engine(tmp_path):
    with pytest.raises(EngineError, match="not an engine directory"):
        Engine.load(tmp_path)


def test_engine_for_a_gpu_is_refused_without_one(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    d = build_target(tmp_path, "h200-tp1", preset="tiny")
    with pytest.raises(EngineError, match="needs 1 CUDA GPU .*this machine has no CUDA GPU"):
        Engine.load(d)


def test_tp_degree_larger_than_the_machine_is_refused(tmp_path):
    d = build_target(tmp_path, "h100-tp3", preset="tiny")
    m = json.loads((d / "manifest.json").read_text())
    two_gpus = {**this_machine(), "gpu_count": 2, "gpu_arch": "sm_90", "gpu_name": "NVIDIA H200",
                "cuda": m["built_with"]["cuda"]}
    with pytest.raises(EngineError, match="needs 4 CUDA GPUs .* for TP-3; this machine has 2"):
        Engine.load(d, machine=two_gpus)


def test_other_gpu_arch_is_refused():
    t = Target.from_toml(TARGETS / "b200-tp2.toml")
    h200 = {"gpu_count": 8, "gpu_arch": "sm_90", "gpu_name": "NVIDIA H200", "torch": "2.11.0",
            "cuda": "13.0"}
    with pytest.raises(EngineError, match="built for sm_100; this machine's GPU is NVIDIA H200"):
        check_machine(t, {"torch": "2.11.0", "cuda": "13.0"}, h200)


def test_other_torch_is_refused(copy):
    m = json.loads((copy / "manifest.json").read_text())
    m["built_with"]["torch"] = "2.0.0+other"  # no machine that runs the suite has it
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineError, match=r"built with torch 2.0.0\+other; this machine has torch"):
        Engine.load(copy)


def test_charrun_reports_a_damaged_engine_in_one_line(copy, tmp_path):
    pytest.importorskip("av")  # charrun writes MP4 through PyAV (an install may lack it)
    (copy / "adaln.safetensors").write_bytes(b"junk")
    r = subprocess.run([sys.executable, "-m", "charengine.runtime.cli", "--engine", str(copy),
                        "--image", str(ROOT / "assets/face.png"), "--audio",
                        str(ROOT / "assets/speech.wav"), "--out", str(tmp_path / "o.mp4")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [f"Error: {copy}: checksum mismatch in adaln.safetensors: the file is "
                     "damaged or was changed after the build; rebuild the engine"]
    assert not (tmp_path / "o.mp4").exists()


def test_charbuild_cli_builds_and_explains_bad_input(tmp_path):
    charbuild = [sys.executable, "-m", "charengine.builder.cli"]
    r = subprocess.run(charbuild + ["--target", "cpu-tiny", "--random-weights", "--seed", "3",
                                    "--out", str(tmp_path / "e")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "e/manifest.json").read_text())["weights"] == {"random_seed": 3}
    r = subprocess.run(charbuild + ["--target", "nope", "--random-weights", "--out",
                                    str(tmp_path / "f")], capture_output=True, text=True)
    assert r.returncode != 0 and "known targets: b200-tp2, cpu-tiny" in r.stderr
    r = subprocess.run(charbuild + ["--target", "cpu-tiny", "--weights",
                                    str(ROOT / "assets/face.png"), "--out", str(tmp_path / "g")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "not a readable safetensors file" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "g").exists()
    # the embedded default builds from the shipped checkpoint with no weights named; a 57B
    # target never does
    r = subprocess.run(charbuild + ["--target", "cpu-tiny", "--out", str(tmp_path / "h")],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "the trained tiny checkpoint" in r.stderr
    m = json.loads((tmp_path / "h/manifest.json").read_text())
    assert m["weights"]["checkpoint"].endswith("charengine/checkpoints/tiny.safetensors")
    assert m["side_networks"] == "checkpoint"
    r = subprocess.run(charbuild + ["--target", "h100-tp3", "--out", str(tmp_path / "i")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "h100-tp3 needs --weights" in r.stderr


def test_a_gpu_engine_is_not_built_without_its_gpu_unless_kernels_are_left_out(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    charbuild = [sys.executable, "-m", "charengine.builder.cli", "--target", "h200-tp1",
                 "--preset", "tiny", "--random-weights"]
    r = subprocess.run(charbuild + ["--out", str(tmp_path / "a")], capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "target h200-tp1 runs on sm_90: its kernels are compiled on that GPU and this " \
           "machine has no CUDA GPU" in r.stderr
    assert not (tmp_path / "a").exists()
    r = subprocess.run(charbuild + ["--no-kernels", "--out", str(tmp_path / "b")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "b/manifest.json").read_text())["kernels"]["compiled"] is False


def test_a_rank_slice_engine_loads_its_rank_and_is_refused_for_a_session(tmp_path):
    d = build_target(tmp_path, "h100-tp3", preset="tiny", ranks=[1])
    assert sorted(p.name for p in d.glob("rank*")) == ["rank1.safetensors"]
    m = json.loads((d / "manifest.json").read_text())
    one_gpu = {**this_machine(), "gpu_count": 1, "gpu_arch": "sm_90", "gpu_name": "NVIDIA H200",
               "cuda": m["built_with"]["cuda"]}
    e = Engine.load(d, machine=one_gpu, ranks=[1])
    assert e.rank_state(1)["blocks.0.w_in.q"].dtype == torch.float8_e4m3fn
    with pytest.raises(EngineError, match=r"built for TP rank 1 only \(charbuild --ranks\); a "
                                          r"session needs rank 0, 2: build the whole engine"):
        Engine.load(d, machine={**one_gpu, "gpu_count": 4})
    with pytest.raises(EngineError, match="this run needs rank 0"):
        Engine.load(d, machine=one_gpu, ranks=[0])


def test_kernels_from_another_triton_are_refused(tmp_path):
    t = Target.from_toml(TARGETS / "h200-tp1.toml")
    h200 = {"gpu_count": 1, "gpu_arch": "sm_90", "gpu_name": "NVIDIA H200", "torch": "2.11.0",
            "cuda": "13.0", "triton": "3.6.0"}
    built = {"torch": "2.11.0", "cuda": "13.0", "triton": "3.5.1"}
    check_machine(t, built, h200)  # no compiled kernels: Triton's version does not matter
    with pytest.raises(EngineError, match="kernels were compiled with Triton 3.5.1; this machine "
                                          "has Triton 3.6.0: rebuild it here with charbuild"):
        check_machine(t, built, h200, kernels=True)


def test_a_damaged_chunk_anywhere_in_a_file_is_found(copy):
    f = copy / "side.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(EngineError, match="checksum mismatch in side.safetensors"):
        Engine.load(copy)


def test_checksums_verified_while_the_weights_load_stop_the_worker(copy):
    from charengine.runtime.worker import Worker

    f = copy / "rank0.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01  # inside a tensor: the weights still load
    f.write_bytes(bytes(data))
    engine = Engine.load(copy, verify_in_background=True)
    with pytest.raises(EngineError, match="checksum mismatch in rank0.safetensors"):
        Worker(engine)


def test_an_engines_gemm_plan_is_read_for_its_rank(copy):
    from charengine.plugins import gemm

    m = json.loads((copy / "manifest.json").read_text())
    assert Engine.load(copy).gemm_plan(0) == {}  # a CPU engine measures nothing
    m["kernels"]["gemm_plan"] = {"0": {"w_in": "scaled_mm", "w_out": "triton"}}
    (copy / "manifest.json").write_text(json.dumps(m))
    assert Engine.load(copy).gemm_plan(0) == {"w_in": "scaled_mm", "w_out": "triton"}
    assert gemm.select("triton") is not gemm.select("scaled_mm") is gemm.select(None)
    assert gemm.select("triton", "residual") is None  # the Triton GEMM has no C input
    with pytest.raises(ValueError, match="unknown GEMM choice 'cutlass'"):
        gemm.select("cutlass")


def test_an_engine_on_quack_is_refused_without_that_quack(copy):
    """An engine whose GEMMs run on QuACK needs the quack-kernels it was compiled with."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        here = version("quack-kernels")
    except PackageNotFoundError:
        here = None
    m = json.loads((copy / "manifest.json").read_text())
    m["kernels"]["quack"] = {"dir": "kernels/quack", "version": "0.0.1-other"}
    (copy / "manifest.json").write_text(json.dumps(m))
    has = f"quack-kernels {here}" if here else "no quack-kernels"
    with pytest.raises(EngineError, match=rf"runs its GEMMs on QuACK \(quack-kernels "
                                          rf"0.0.1-other\); this machine has {has}: install"):
        Engine.load(copy)


@pytest.mark.parametrize("edit,says", [
    (lambda m: [1, 2], "expected a JSON object, found list"),
    (lambda m: {**m, "ranks": "0"}, "field 'ranks' is str, expected list"),
    (lambda m: {**m, "files": {"../x": {"bytes": 1, "sha256": []}}}, "outside the engine"),
    (lambda m: {**m, "config": {**m["config"], "model": {**m["config"]["model"], "dim": "64"}}},
     "config.model.dim: expected int, got str"),
    (lambda m: {**m, "target": {**m["target"], "tp": [1]}}, "tp: expected int, got list"),
    (lambda m: {**m, "target": {**m["target"], "switches": {"fp8_attention_kernel": "yes"}}},
     "fp8_attention_kernel: expected bool"),
])
def test_a_manifest_of_the_wrong_shape_gets_one_line(copy, edit, says):
    m = json.loads((copy / MANIFEST).read_text())
    (copy / MANIFEST).write_text(json.dumps(edit(m)))
    with pytest.raises(EngineError, match=re.escape(says)) as e:
        Engine.load(copy)
    assert "\n" not in str(e.value) and "rebuild the engine" in str(e.value)


def test_a_damaged_side_file_stops_the_worker_as_the_checksum_mismatch_it_is(copy):
    """The side networks load on a thread of their own: a side file that no longer reads
    is reported as its checksum mismatch, not as the reader's error."""
    from charengine.runtime.worker import Worker

    f = copy / "side.safetensors"
    data = bytearray(f.read_bytes())
    data[8:16] = b"\x00" * 8  # the header: the file does not read
    f.write_bytes(bytes(data))
    engine = Engine.load(copy, verify_in_background=True)
    with pytest.raises(EngineError, match="checksum mismatch in side.safetensors"):
        Worker(engine)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise here")
def test_readahead_asks_for_every_engine_file(engine_dir, tmp_path):
    """charrun's background read of an engine (runtime/prefetch.py) covers every file under
    it, nested ones too (an engine's shipped kernels), and leaves them as they were."""
    from charengine.runtime.prefetch import readahead

    files = [p for p in engine_dir.rglob("*") if p.is_file()]
    before = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in files}
    assert readahead(engine_dir) == sum(size for size, _ in before.values()) > 0
    assert {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in files} == before
    (tmp_path / "kernels" / "k").mkdir(parents=True)
    (tmp_path / "a.bin").write_bytes(b"abc")
    (tmp_path / "kernels" / "k" / "b.cubin").write_bytes(b"12345")
    assert readahead(tmp_path) == 8
    assert readahead(tmp_path / "missing") == 0
