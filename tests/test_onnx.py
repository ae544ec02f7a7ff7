"""charbuild --export-onnx: the decoder and the audio encoder of both families written as ONNX
into the engine, run through onnxruntime on the CPU against what the engine's own side
networks compute over a session (the decoder's causal caches carried, the audio encoder on
the demo speech), within builder/onnx_export.TOLERANCE; a bad export fails the build with one
line and leaves the engine that was there."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx", reason="needs onnx (pip install '.[onnx]')")
onnxruntime = pytest.importorskip("onnxruntime", reason="needs onnxruntime (pip install '.[onnx]')")
pytest.importorskip("onnxscript", reason="needs onnxscript (pip install '.[onnx]')")

from charengine.builder.onnx_export import OPSET, TOLERANCE  # noqa: E402
from charengine.engine_format import MANIFEST, ONNX  # noqa: E402
from charengine.family import PAST, PRESENT, family_of  # noqa: E402
from charengine.runtime.engine import Engine  # noqa: E402
from charengine.runtime.images import read_image  # noqa: E402
from charengine.runtime.media import read_audio  # noqa: E402

from engines import ROOT, build_target  # noqa: E402

TARGETS = ("cpu-tiny", "cpu-tiny-livetalk")
GRAPHS = {"cpu-tiny": {"decoder", "audio_encoder"},
          "cpu-tiny-livetalk": {"decoder_first", "decoder", "audio_encoder"}}
CHARBUILD = [sys.executable, "-m", "charengine.builder.cli"]
STEPS = 3  # decoder calls of the session compared
LATENT_NOISE = 0.3  # latents: the reference image's, moved by this much noise per step
NOT_FOR_TENSORRT = {"STFT", "DFT"}  # ops TensorRT's ONNX parser does not take


def charbuild(*args, cwd=None):
    return subprocess.run(CHARBUILD + list(args), capture_output=True, text=True, cwd=cwd)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("onnx")
    out = {}
    for target in TARGETS:
        r = charbuild("--target", target, "--out", str(root / target), "--export-onnx")
        assert r.returncode == 0, r.stderr
        out[target] = root / target
    return out


def relative_error(got: np.ndarray, want: torch.Tensor) -> float:
    want = want.detach().float().numpy()
    assert got.shape == want.shape
    return float(np.abs(got - want).max()) / max(1.0, float(np.abs(want).max()))


def session_of(path: Path) -> onnxruntime.InferenceSession:
    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def side_of(engine_dir: Path):
    """The engine's side networks as charrun loads them."""
    engine = Engine.load(engine_dir)
    fam, spec = family_of(engine.config), engine.config.model
    return fam, spec, fam.load_side(engine.config, engine.side_state(), "cpu")


def session_latents(fam, spec, side) -> list[torch.Tensor]:
    """A session's latents: the face's latent (every latent frame of a step) moved by noise."""
    image = read_image(ROOT / "assets" / "face.png", spec.out_h, spec.out_w)
    with torch.no_grad():
        ref = side.image_encoder(image)
    shape = fam.step_shapes(spec).latent
    g = torch.Generator().manual_seed(0)
    base = ref if len(shape) == ref.dim() else ref[:, None].expand(shape)
    return [base + LATENT_NOISE * torch.randn(shape, generator=g) for _ in range(STEPS)]


def onnx_decode(engine_dir: Path, latents, carry_caches: bool = True) -> list[np.ndarray]:
    """The session's frames through the ONNX decoder graphs, each call's present.* fed back as
    the next call's past.* (or, for the control, zeros again)."""
    first_path = engine_dir / ONNX / "decoder_first.onnx"
    steady = session_of(engine_dir / ONNX / "decoder.onnx")
    pasts = [i for i in steady.get_inputs() if i.name.startswith(PAST)]
    zeros = {i.name: np.zeros(i.shape, np.float32) for i in pasts}
    frames, caches = [], dict(zeros)
    for k, z in enumerate(latents):
        if k == 0 and first_path.is_file():
            first = session_of(first_path)
            outs = first.run(None, {"latents": z.numpy()})
            names = [o.name for o in first.get_outputs()]
        else:
            feed = {steady.get_inputs()[0].name: z.numpy(), **caches}
            outs = steady.run(None, feed)
            names = [o.name for o in steady.get_outputs()]
        got = dict(zip(names, outs))
        frames.append(got["frames"])
        caches = {PAST + n[len(PRESENT):]: v for n, v in got.items() if n.startswith(PRESENT)}
        if not carry_caches:
            caches = dict(zeros)
    return frames


@pytest.mark.parametrize("target", TARGETS)
def test_the_engine_holds_its_graphs_at_the_stated_opset_with_fixed_shapes(engines, target):
    engine_dir = engines[target]
    manifest = json.loads((engine_dir / MANIFEST).read_text())
    entry = manifest["onnx"]
    assert entry["opset"] == OPSET and entry["dtype"] == "float32"
    assert set(entry["graphs"]) == GRAPHS[target]
    for name, g in entry["graphs"].items():
        path = engine_dir / g["file"]
        assert g["file"] in manifest["files"]  # checksummed, and part of the engine directory
        assert g["max_error"] <= TOLERANCE
        model = onnx.load(str(path))
        onnx.checker.check_model(model, full_check=True)
        assert {(o.domain or "ai.onnx"): o.version for o in model.opset_import}["ai.onnx"] == OPSET
        assert {p.key: p.value for p in model.metadata_props}["charengine.graph"] == name
        declared = {t["name"]: t["shape"] for t in g["inputs"] + g["outputs"]}
        for v in [*model.graph.input, *model.graph.output]:
            dims = v.type.tensor_type.shape.dim
            assert all(d.HasField("dim_value") for d in dims), f"{name}: {v.name} is dynamic"
            assert [d.dim_value for d in dims] == declared[v.name]
        ops = {n.op_type for n in model.graph.node}
        assert not ops & NOT_FOR_TENSORRT, f"{name}: {ops & NOT_FOR_TENSORRT}"
        double = onnx.TensorProto.DOUBLE
        assert all(t.data_type != double for t in model.graph.initializer)
        assert all(a.i != double for n in model.graph.node if n.op_type == "Cast"
                   for a in n.attribute if a.name == "to"), f"{name}: computes in float64"
        for past, present in g["carry"].items():  # every carried cache goes out and back in
            assert declared[past] == declared[present]


@pytest.mark.parametrize("target", TARGETS)
def test_the_onnx_decoder_decodes_a_session_as_the_engine_does(engines, target):
    fam, spec, side = side_of(engines[target])
    latents = session_latents(fam, spec, side)
    side.decoder.reset()
    with torch.no_grad():
        want = [side.decoder(z) for z in latents]
    got = onnx_decode(engines[target], latents)
    assert [f.shape[0] for f in got] == [fam.step_frames(spec, k) for k in range(STEPS)]
    errors = [relative_error(g, w) for g, w in zip(got, want)]
    assert max(errors) <= TOLERANCE, errors
    # control: the same calls without the caches carried differ from the session's frames
    uncached = onnx_decode(engines[target], latents, carry_caches=False)
    assert relative_error(uncached[-1], want[-1]) > 100 * TOLERANCE


@pytest.mark.parametrize("target", TARGETS)
def test_the_onnx_audio_encoder_encodes_speech_as_the_engine_does(engines, target):
    fam, spec, side = side_of(engines[target])
    speech = read_audio(ROOT / "assets" / "speech.wav", spec.side.sample_rate)
    session = session_of(engines[target] / ONNX / "audio_encoder.onnx")
    names = [i.name for i in session.get_inputs()]
    errors, outputs = [], []
    for k in range(fam.steps_for(spec, speech.numel())):
        window = fam.audio_window(spec, speech, k)
        with torch.no_grad():
            want = fam.encode_audio(side, spec, window, k)
        feed = {"window": window.numpy(), "chunk": np.array(k, np.int64)}
        got = session.run(None, {n: feed[n] for n in names})[0]
        errors.append(relative_error(got, want))
        outputs.append(got)
    assert len(errors) > 3 and max(errors) <= TOLERANCE, errors
    assert np.abs(outputs[0] - outputs[-1]).max() > 100 * TOLERANCE  # the speech is heard


def test_charrun_starts_an_engine_with_graphs_and_a_rebuild_replaces_them(engines, tmp_path):
    """charrun neither reads nor checks onnx/ (a damaged graph does not stop it); charbuild
    replaces such an engine, its graphs included."""
    engine_dir = tmp_path / "tiny"
    subprocess.run(["cp", "-r", str(engines["cpu-tiny"]), str(engine_dir)], check=True)
    (engine_dir / ONNX / "decoder.onnx").write_bytes(b"damaged")
    r = subprocess.run([sys.executable, "-m", "charengine.runtime.cli", "--engine",
                        str(engine_dir), "--check"], capture_output=True, text=True)
    assert r.returncode == 0 and "ready in" in r.stdout + r.stderr, r.stderr
    r = charbuild("--target", "cpu-tiny", "--out", str(engine_dir))
    assert r.returncode == 0, r.stderr
    assert not (engine_dir / ONNX).exists()
    assert "onnx" not in json.loads((engine_dir / MANIFEST).read_text())


# Faults put into the characters family's graphs in a charbuild process of their own.
FAULTS = {
    "an op with no ONNX translation": '''
@torch.library.custom_op("charengine_test::opaque", mutates_args=())
def opaque(x: torch.Tensor) -> torch.Tensor:
    return x.clone()
opaque.register_fake(lambda x: torch.empty_like(x))
def fault(module):
    class Opaque(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = module
        def forward(self, *args):
            out = self.inner(*args)
            return (opaque(out[0]), *out[1:])
    return Opaque()
''',
    "an export that differs from torch": '''
def fault(module):
    class Drift(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = module
        def forward(self, *args):
            out = self.inner(*args)
            return (out[0] + float(torch.compiler.is_exporting()), *out[1:])
    return Drift()
''',
}
RUN_FAULTY = '''
import sys
import torch
from charengine.family import family
from charengine.builder.cli import main
{fault}
fam = type(family("characters"))
real = fam.onnx_graphs
def graphs(self, spec, side):
    out = real(self, spec, side)
    out[0].module = fault(out[0].module)
    return out
fam.onnx_graphs = graphs
sys.exit(main())
'''


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_bad_export_fails_the_build_in_one_line_and_keeps_the_engine(tmp_path, fault):
    engine_dir = build_target(tmp_path)
    before = {p.name: p.read_bytes() for p in engine_dir.iterdir()}
    r = subprocess.run([sys.executable, "-c", RUN_FAULTY.format(fault=FAULTS[fault]),
                        "--target", "cpu-tiny", "--out", str(engine_dir), "--export-onnx"],
                       capture_output=True, text=True)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("Error: --export-onnx: the decoder graph"), r.stderr
    assert ("cannot be exported" if "translation" in fault else "differs") in lines[-1]
    assert not any(ln.startswith("Traceback") for ln in lines)
    assert {p.name: p.read_bytes() for p in engine_dir.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [engine_dir.name]  # no staging left


def test_export_onnx_without_onnxruntime_is_refused_before_any_work(tmp_path):
    out = tmp_path / "engine"
    r = subprocess.run([sys.executable, "-c", "import sys; sys.modules['onnxruntime'] = None\n"
                        "from charengine.builder.cli import main; sys.exit(main())",
                        "--target", "cpu-tiny", "--out", str(out), "--export-onnx"],
                       capture_output=True, text=True)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == ("Error: --export-onnx needs onnxruntime, which "
                                                 "does not import here: pip install "
                                                 "'charengine[onnx]'")
    assert not out.exists() and list(tmp_path.iterdir()) == []
