"""LiveTalk through charbuild and charrun on tiny-livetalk: engines built from the user's
own files, an MP4 decoded back (16 fps, 9 frames then 12 per chunk, audio in sync), the
ready check, a live session with barge-in, and the diffusion in its own process over gloo."""

import subprocess
import sys
import wave

import av
import pytest
import torch
from safetensors.torch import save_file

from charengine.builder.build import build
from charengine.builder.build_config import BuildConfig
from charengine.family import family
from charengine.livetalk.spec import TINY
from charengine.runtime.engine import Engine
from charengine.runtime.live import LiveSession, wait_until
from charengine.runtime.worker import Worker
from engines import ROOT, build_target

FACE, SPEECH = ROOT / "assets/face.png", ROOT / "assets/speech.wav"
CHARRUN = [sys.executable, "-m", "charengine.runtime.cli"]
CHARBUILD = [sys.executable, "-m", "charengine.builder.cli"]
FAM = family("livetalk")


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    return build_target(tmp_path_factory.mktemp("lt"), "cpu-tiny-livetalk")


def probe(path):
    with av.open(str(path)) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        frames = sum(1 for _ in c.decode(v))
        return frames, v.average_rate, float(a.duration * a.time_base), (v.width, v.height)


def speech_samples() -> int:
    with wave.open(str(SPEECH)) as w:
        return w.getnframes() * 16000 // w.getframerate()


def test_charrun_renders_16fps_with_nine_then_twelve_frames_per_chunk(engine_dir, tmp_path):
    out = tmp_path / "o.mp4"
    r = subprocess.run(CHARRUN + ["--engine", str(engine_dir), "--image", str(FACE), "--audio",
                                  str(SPEECH), "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    chunks = FAM.steps_for(TINY, speech_samples())
    frames, rate, audio_s, size = probe(out)
    assert rate == 16 and size == (TINY.out_w, TINY.out_h)
    assert frames == 9 + 12 * (chunks - 1)
    assert frames / 16 >= speech_samples() / 16000 - 1 / 16  # the speech is covered
    assert abs(audio_s - frames / 16) <= 1 / 16
    assert f"{frames} frames at 16 fps" in r.stdout


def test_charrun_check_gets_the_engine_ready(engine_dir):
    r = subprocess.run(CHARRUN + ["--engine", str(engine_dir), "--check"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "ready in" in r.stdout and "0 kernels compiled" in r.stdout


def test_an_engine_builds_from_the_users_own_files(tmp_path):
    """A released-layout DiT safetensors, a Wan VAE .pth, a wav2vec2 directory and prompt
    features: the engine holds exactly those tensors."""
    from charengine.livetalk.audio import AudioEncoder
    from charengine.livetalk.vae import WanVAE

    full = FAM.random_weights(TINY, 3)
    save_file(full, str(tmp_path / "model.safetensors"))
    torch.manual_seed(4)
    vae = WanVAE(TINY.vae)
    torch.save(vae.state_dict(), tmp_path / "vae.pth")
    enc = AudioEncoder(TINY.audio)
    enc.save_pretrained(tmp_path / "wav2vec2")
    prompt = torch.randn(TINY.prompt_tokens, TINY.text_dim)
    save_file({"context": prompt}, str(tmp_path / "prompt.safetensors"))
    out = tmp_path / "eng"
    r = subprocess.run(CHARBUILD + ["--target", "cpu-tiny-livetalk", "--out", str(out),
                                    "--weights", str(tmp_path / "model.safetensors"),
                                    "--vae", str(tmp_path / "vae.pth"),
                                    "--wav2vec", str(tmp_path / "wav2vec2"),
                                    "--prompt-features", str(tmp_path / "prompt.safetensors")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    engine = Engine.load(out)
    side = engine.side_state()
    assert torch.equal(side["prompt.features"], prompt)
    for k, v in vae.state_dict().items():
        assert torch.equal(side[f"vae.{k}"], v), k
    for k, v in enc.state_dict().items():
        assert torch.equal(side[f"audio_encoder.{k}"], v), k
    assert engine.manifest["weights"]["checkpoint"].endswith("model.safetensors")


def test_a_bad_vae_file_is_one_line_and_writes_nothing(tmp_path):
    (tmp_path / "vae.pth").write_bytes(b"not a torch file")
    out = tmp_path / "eng"
    r = subprocess.run(CHARBUILD + ["--target", "cpu-tiny-livetalk", "--out", str(out),
                                    "--random-weights", "--vae", str(tmp_path / "vae.pth")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert "vae.pth" in last and "Traceback" not in r.stderr
    assert not out.exists()


def test_a_live_session_speaks_listens_and_barges_in(engine_dir):
    worker = Worker(Engine.load(engine_dir))
    log = []
    s = LiveSession(worker, lambda f, a, t, v: log.append((t, v, f.shape)))
    s.start(torch.rand(3, TINY.out_h, TINY.out_w))
    assert wait_until(lambda: len(log) >= 9, 30)
    assert not any(v for _, v, _ in log)  # listening: silent audio
    speech = torch.randn(16000 * 4) * 0.1
    for frame in speech.split(320):  # as it arrives: 20 ms frames
        s.say(frame)
    assert wait_until(lambda: sum(v for _, v, _ in log) >= 24, 30)
    t_int = s.interrupt()
    # listening again: a chunk's worth of silent frames after the barge-in, and no speech
    assert wait_until(lambda: sum(not v for t, v, _ in log if t > t_int) >=
                      TINY.frames_per_latent, 60)
    s.stop()
    assert not [t for t, v, _ in log if v and t > t_int]
    assert log[0][2] == (3, TINY.out_h, TINY.out_w)
    assert s.pacer.fps == 16 and s.pacer.frames_per_step == TINY.frames_per_latent  # paced


def test_the_diffusion_in_its_own_process_gives_the_same_frames(engine_dir, tmp_path):
    """cpu-tiny-livetalk-x2 (h200x2-livetalk's layout over gloo) against the one-process
    engine of the same weights: the same MP4 frames."""
    split = tmp_path / "x2"
    build(BuildConfig("cpu-tiny-livetalk-x2", split, seed=0), log=lambda s: None)
    outs = {}
    for name, eng in (("one", engine_dir), ("x2", split)):
        outs[name] = tmp_path / f"{name}.mp4"
        r = subprocess.run(CHARRUN + ["--engine", str(eng), "--image", str(FACE), "--audio",
                                      str(SPEECH), "--out", str(outs[name])],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    frames = {}
    for name, path in outs.items():
        with av.open(str(path)) as c:
            frames[name] = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(frames["one"]) == len(frames["x2"]) > 9
    for a, b in zip(frames["one"], frames["x2"]):
        assert (a.astype(int) - b.astype(int)).__abs__().max() <= 2


def test_side_networks_load_over_the_states_own_tensors():
    """load_side makes the modules without initializing them and takes the state's tensors
    as they lie (no copy on their device): the networks give what modules initialized and
    then loaded give; a state missing a tensor is one line."""
    from charengine.livetalk import audio
    from charengine.livetalk.sidenets import SideNets, load_side, random_side_state

    state = random_side_state(TINY, 3)
    nets = load_side(TINY, state)
    held = {k: v.data_ptr() for k, v in nets.state_dict().items()}
    assert all(held[k] == v.data_ptr() for k, v in state.items())
    assert not any(t.is_meta for t in [*nets.parameters(), *nets.buffers()])
    ref = SideNets(TINY)
    ref.load_state_dict(state)
    ref = ref.eval().ready()
    g = torch.Generator().manual_seed(0)
    image = torch.rand(3, TINY.out_h, TINY.out_w, generator=g)
    window = torch.randn(audio.window_samples(TINY.audio), generator=g)
    z = torch.randn(TINY.latent_channels, TINY.chunk_frames, TINY.latent_h, TINY.latent_w,
                    generator=g)
    with torch.inference_mode():
        assert torch.equal(nets.image_encoder(image), ref.image_encoder(image))
        assert torch.equal(nets.text_encoder("hello"), ref.text_encoder("hello"))
        assert torch.equal(audio.chunk_features(TINY.audio, nets.audio_encoder, window, 1),
                           audio.chunk_features(TINY.audio, ref.audio_encoder, window, 1))
        assert torch.equal(nets.decoder(z), ref.decoder(z))
    del state[next(k for k in sorted(state) if k.startswith("vae."))]
    with pytest.raises(ValueError, match="side networks: missing tensor 'vae."):
        load_side(TINY, state)


def test_the_worker_loads_its_side_networks_beside_the_dit_and_times_each_part(engine_dir):
    worker = Worker(Engine.load(engine_dir, verify_in_background=True))
    parts = worker.startup["parts"]
    assert {"rank_weights_s", "tables_s", "assemble_s", "side_read_s", "side_build_s",
            "side_wait_s", "verify_wait_s"} <= set(parts)
    assert all(v >= 0 for v in parts.values())
    main = sum(parts[k] for k in ("kernel_cache_s", "rank_weights_s", "tables_s", "assemble_s",
                                  "side_wait_s", "verify_wait_s"))
    assert main <= worker.startup["load_s"]  # parts of the load, one after the other
    frames = []
    worker.start(torch.rand(3, TINY.out_h, TINY.out_w), "hello")
    worker.run(0.1 * torch.randn(16000), 1, lambda i, f: frames.append(f))
    assert frames and frames[0].shape[1:] == (3, TINY.out_h, TINY.out_w)
