"""charrun end to end on the tiny engine: a real MP4 decoded back, real processes."""

import signal
import subprocess
import sys
import threading
import time
import wave

import av
import numpy as np
import pytest
import torch

from charengine.characters import audio as audio_mod
from charengine.characters.spec import PRESETS
from charengine.runtime.engine import Engine
from charengine.runtime.worker import Worker
from engines import ROOT, build_target

FACE, SPEECH = ROOT / "assets/face.png", ROOT / "assets/speech.wav"
CHARRUN = [sys.executable, "-m", "charengine.runtime.cli"]


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    return build_target(tmp_path_factory.mktemp("eng"))


def probe(path):
    with av.open(str(path)) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        frames = sum(1 for _ in c.decode(v))
        audio_s = float(a.duration * a.time_base)
        return frames, v.average_rate, audio_s, (v.codec_context.name, a.codec_context.name)


def write_wav(path, seconds, rate, channels):
    t = np.arange(int(seconds * rate)) / rate
    x = (0.3 * np.sin(2 * np.pi * 200 * t))[:, None].repeat(channels, 1)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((x * 32767).astype("<i2").tobytes())


def run_charrun(engine_dir, audio, out, **kw):
    return subprocess.run(CHARRUN + ["--engine", str(engine_dir), "--image", str(FACE),
                                     "--audio", str(audio), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, **kw)


def test_mp4_has_four_frames_per_step_at_24fps_with_audio_in_sync(engine_dir, tmp_path):
    r = run_charrun(engine_dir, SPEECH, tmp_path / "o.mp4")
    assert r.returncode == 0, r.stderr
    spec = PRESETS["tiny"]
    with wave.open(str(SPEECH)) as w:
        steps = audio_mod.steps_for(spec, w.getnframes() * 16000 // w.getframerate())
    frames, rate, audio_s, codecs = probe(tmp_path / "o.mp4")
    assert codecs == ("h264", "aac")
    assert frames == 4 * steps and rate == 24
    assert abs(audio_s - frames / 24) <= 1 / 24
    assert "diffusion" in r.stderr and "p50" in r.stderr  # the summary table


def test_stereo_44k_speech_is_converted(engine_dir, tmp_path):
    write_wav(tmp_path / "s.wav", 1.0, 44100, 2)
    r = run_charrun(engine_dir, tmp_path / "s.wav", tmp_path / "o.mp4")
    assert r.returncode == 0, r.stderr
    frames, _, audio_s, _ = probe(tmp_path / "o.mp4")
    assert frames == 4 * 6 and abs(audio_s - 1.0) <= 1 / 24


def test_a_video_gets_a_new_files_mode_or_the_one_it_replaces(engine_dir, tmp_path):
    """Not the 0o600 of the temporary file it is written in (others could not read it)."""
    import os

    mask = os.umask(0o022)
    try:
        assert run_charrun(engine_dir, SPEECH, tmp_path / "new.mp4").returncode == 0
        assert (tmp_path / "new.mp4").stat().st_mode & 0o777 == 0o644
        (tmp_path / "new.mp4").chmod(0o640)
        assert run_charrun(engine_dir, SPEECH, tmp_path / "new.mp4").returncode == 0
        assert (tmp_path / "new.mp4").stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(mask)


def test_a_video_named_as_its_own_speech_is_refused_and_the_speech_kept(engine_dir, tmp_path):
    """Speech in an MP4 given again as --out (or a hard link to it): one line, nothing
    replaced."""
    import os

    assert run_charrun(engine_dir, SPEECH, tmp_path / "talk.mp4").returncode == 0
    os.link(tmp_path / "talk.mp4", tmp_path / "link.mp4")
    kept = (tmp_path / "talk.mp4").read_bytes()
    for out in ("talk.mp4", "link.mp4"):
        r = run_charrun(engine_dir, tmp_path / "talk.mp4", tmp_path / out)
        assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == (
            f"Error: --out {tmp_path / out}: is the --audio file, which the video would "
            "replace; give the video another name"), r.stderr
    assert (tmp_path / "talk.mp4").read_bytes() == kept


def test_a_file_that_is_not_audio_is_refused(engine_dir, tmp_path):
    r = run_charrun(engine_dir, FACE, tmp_path / "o.mp4")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "not an audio file" in r.stderr


def stop_a_long_render(engine_dir, tmp_path, sig, after_s=1.0, again_after_s=None,
                       out="o.mp4"):
    """A two-minute render stopped by `sig` `after_s` after its first frames (and again
    `again_after_s` later): (exit, stderr)."""
    if not (tmp_path / "long.wav").exists():
        write_wav(tmp_path / "long.wav", 120.0, 16000, 1)
    p = subprocess.Popen(CHARRUN + ["--engine", str(engine_dir), "--image", str(FACE),
                                    "--audio", str(tmp_path / "long.wav"), "--out",
                                    str(tmp_path / out)],
                         stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    for line in p.stderr:
        if "first frames written" in line or time.time() > deadline:
            break
    time.sleep(after_s)
    p.send_signal(sig)
    if again_after_s is not None:
        time.sleep(again_after_s)
        p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    return p.returncode, err


def test_ctrl_c_leaves_a_playable_mp4_of_what_was_generated(engine_dir, tmp_path):
    code, err = stop_a_long_render(engine_dir, tmp_path, signal.SIGINT)
    assert code == 130, err
    frames, rate, audio_s, _ = probe(tmp_path / "o.mp4")
    assert 4 <= frames < 4 * 720 and frames % 4 == 0 and rate == 24
    assert abs(audio_s - frames / 24) <= 1 / 24
    assert f"holds {frames} frames" in err


def test_a_second_ctrl_c_while_the_render_stops_keeps_its_mp4(engine_dir, tmp_path):
    """Ctrl-C twice, 30 to 110 ms apart: the second lands while the first's stop is on its way out
    (the pipeline's stages joining, the MP4 closing). Each time charrun exits 130 with the
    file it names, whole; before, about half the tries aborted at exit ("terminate called
    without an active exception", a stage still inside a torch op) or lost the file."""
    for k, again_after_s in enumerate((0.03, 0.05, 0.07, 0.09, 0.11) * 2):
        out = f"o{k}.mp4"
        code, err = stop_a_long_render(engine_dir, tmp_path, signal.SIGINT, after_s=0.0,
                                       again_after_s=again_after_s, out=out)
        assert code == 130 and "terminate called" not in err, err
        frames, _, audio_s, _ = probe(tmp_path / out)
        assert frames >= 4 and f"holds {frames} frames" in err, err


def test_stage_threads_are_joined_through_a_ctrl_c():
    """A SIGINT while a pipeline joins its stages does not cut the join short: the stage ends
    first, and the join says an interrupt came (its caller raises it then)."""
    from charengine.runtime.live import wait_until
    from charengine.runtime.pipeline import join_through_interrupts

    delivered = threading.Event()

    def ctrl_c(signum, frame):  # as Python's own handler, and says when it ran
        delivered.set()
        raise KeyboardInterrupt

    main = threading.main_thread().ident

    def joining() -> bool:  # the main thread is inside join_through_interrupts
        f = sys._current_frames().get(main)
        while f is not None and f.f_code is not join_through_interrupts.__code__:
            f = f.f_back
        return f is not None

    def stage():  # a stage that ends only once the Ctrl-C has reached the joining thread
        assert wait_until(joining, 60)
        signal.pthread_kill(main, signal.SIGINT)
        assert delivered.wait(60)

    before = signal.signal(signal.SIGINT, ctrl_c)
    try:
        t = threading.Thread(target=stage)
        t.start()
        assert join_through_interrupts([t], interrupted=False) is True
    finally:
        signal.signal(signal.SIGINT, before)
    assert delivered.is_set() and not t.is_alive()
    assert join_through_interrupts([t], interrupted=False) is False


def test_pipeline_overlaps_decoding_with_the_next_diffusion_and_applies_backpressure(engine_dir):
    worker = Worker(Engine.load(engine_dir))
    spec = worker.spec
    worker.start(torch.rand(3, spec.out_h, spec.out_w), "hello")
    speech = torch.randn(16000 * 3) * 0.1
    steps = audio_mod.steps_for(spec, speech.numel())

    def slow_sink(i, frames):
        assert frames.shape == (4, 3, spec.out_h, spec.out_w)
        time.sleep(0.03)

    # the decode of step i waits until step i + 1's diffusion has begun: a pipeline that
    # ran them one after the other would never let it begin (the wait would run out)
    began = [threading.Event() for _ in range(steps)]
    diffused, decoded, overlapped = iter(range(steps)), iter(range(steps)), []
    lane = worker.lanes[0]
    step, decode = lane.session.step, lane.decode

    def step_(*a):
        began[next(diffused)].set()
        return step(*a)

    def decode_(*a, **kw):
        i = next(decoded)
        if i + 1 < steps:
            overlapped.append(began[i + 1].wait(60))
        return decode(*a, **kw)

    lane.session.step, lane.decode = step_, decode_
    t = worker.run(speech, steps, slow_sink)
    assert len(t.diffusion) == len(t.decode) == len(t.sink) == steps
    assert overlapped == [True] * (steps - 1)
    # depth-one queues: diffusion never runs more than 4 steps ahead of playback
    for i in range(steps):
        ahead = sum(1 for _, end in t.diffusion if end < t.sink[i][0])
        assert ahead <= i + 5


def test_the_pipeline_counts_the_time_a_step_is_held_behind_the_one_before_it():
    """A step whose audio features are ready while the diffusion stage is still busy with the
    step before it waits in the queue; the pipeline counts that wait as the step's held time
    (which a live session takes out of its processing time)."""
    from charengine.runtime.pipeline import Pipeline

    held_s = 0.2
    encoded = [threading.Event() for _ in range(3)]

    def encode(i):
        encoded[i].set()
        return torch.zeros(1)

    def diffuse(i, feats):
        if i == 0:  # busy until step 1's features wait, and then a while
            assert encoded[1].wait(30)
            time.sleep(held_s)
        return feats

    frames = []
    t = Pipeline(encode, diffuse, lambda latent: latent).run(3, lambda i, f: frames.append(i))
    assert frames == [0, 1, 2]
    assert sorted(t.held) == [0, 1, 2]
    assert t.held[1] >= held_s / 2  # (less the moment between its event and its return)


def test_a_failure_mid_session_leaves_a_playable_mp4(engine_dir, tmp_path):
    from charengine.runtime.render import Rendered, render

    worker = Worker(Engine.load(engine_dir))
    spec = worker.spec
    speech = torch.randn(16000 * 4) * 0.1

    def fail_at_five(done):
        if done == 5:
            raise OSError("No space left on device")

    result = Rendered()
    with pytest.raises(OSError, match="No space left"):
        render(worker, torch.rand(3, spec.out_h, spec.out_w), "", speech, tmp_path / "o.mp4",
               on_step=fail_at_five, result=result)
    assert result.steps == 5
    frames, rate, audio_s, _ = probe(tmp_path / "o.mp4")
    assert frames == 20 and rate == 24 and abs(audio_s - frames / 24) <= 1 / 24


def test_charrun_runs_a_tp2_engine_as_processes(tmp_path):
    engine = build_target(tmp_path, "cpu-tiny-tp2")
    r = run_charrun(engine, SPEECH, tmp_path / "o.mp4")
    assert r.returncode == 0, r.stderr
    frames, rate, audio_s, _ = probe(tmp_path / "o.mp4")
    assert frames == 96 and rate == 24 and abs(audio_s - frames / 24) <= 1 / 24


def test_streaming_decoder_equals_decoding_the_sequence():
    from charengine.characters.decoder import Decoder

    spec = PRESETS["tiny"]
    torch.manual_seed(0)
    dec = Decoder(spec).eval()
    lat = torch.randn(1, spec.latent_channels, 5, spec.latent_h, spec.latent_w)
    with torch.no_grad():
        whole = dec.forward_sequence(lat)[0]
        dec.reset()
        parts = torch.cat([dec(lat[0, :, i]).transpose(0, 1) for i in range(5)], dim=1)
    assert whole.shape == (3, 20, 64, 64)
    assert torch.allclose(whole, parts, atol=1e-5)


def test_sigterm_leaves_a_playable_mp4_whose_frames_the_message_counts(engine_dir, tmp_path):
    code, err = stop_a_long_render(engine_dir, tmp_path, signal.SIGTERM)  # docker stop, timeout
    assert code == 143, err
    frames, rate, audio_s, _ = probe(tmp_path / "o.mp4")
    assert frames >= 4 and frames % 4 == 0 and rate == 24
    assert abs(audio_s - frames / 24) <= 1 / 24
    assert f"stopped by SIGTERM after {frames // 4} steps; {tmp_path / 'o.mp4'} holds " \
           f"{frames} frames" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["long.wav", "o.mp4"]


def test_audio_with_nan_samples_is_refused_before_any_work(engine_dir, tmp_path):
    x = np.sin(np.arange(16000) / 5).astype(np.float32)
    x[100] = np.nan
    with av.open(str(tmp_path / "nan.wav"), "w") as c:
        s = c.add_stream("pcm_f32le", rate=16000)
        s.layout = "mono"
        f = av.AudioFrame.from_ndarray(x[None], format="flt", layout="mono")
        f.sample_rate = 16000
        for pkt in [*s.encode(f), *s.encode()]:
            c.mux(pkt)
    (tmp_path / "o.mp4").write_bytes(b"the user's earlier render")
    r = run_charrun(engine_dir, tmp_path / "nan.wav", tmp_path / "o.mp4")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "NaN or infinite samples" in r.stderr and "session failed" not in r.stderr
    assert (tmp_path / "o.mp4").read_bytes() == b"the user's earlier render"


@pytest.mark.parametrize("out,says", [("DIR", "is a directory"), ("o.txt", "ending in .mp4"),
                                      ("/proc/charengine/o.mp4", "cannot be created")])
def test_a_bad_out_is_refused_before_the_engine_loads(engine_dir, tmp_path, out, says):
    out = tmp_path if out == "DIR" else tmp_path / out if not out.startswith("/") else out
    r = run_charrun(engine_dir, SPEECH, out)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 or r.returncode == 1
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("flags,says", [(["--slack", "0"], "--slack"),
                                        (["--port", "70000"], "--port")])
def test_bad_serving_flags_are_refused_at_the_command_line(engine_dir, flags, says):
    r = subprocess.run(CHARRUN + ["--engine", str(engine_dir), "--serve", *flags],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and says in r.stderr and "serving on" not in r.stdout


def test_a_port_in_use_is_refused_before_serving(engine_dir):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
        r = subprocess.run(CHARRUN + ["--engine", str(engine_dir), "--serve", "--port",
                                      str(port)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}" in r.stderr
    assert "serving on" not in r.stdout


# ---- what a user's machine does to a render -------------------------------------------------

def _limit_file_size(nbytes: int):
    """preexec_fn: files this process writes stop at `nbytes` (EFBIG past it), as on a full
    disk: the MP4's writes fail where the engine's reads do not."""
    import resource

    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))


def _one_error(r) -> str:
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1, r.stderr
    return errors[0]


def test_a_render_that_finds_no_room_says_so_and_leaves_the_old_file(engine_dir, tmp_path):
    """A file-size limit (a full disk's EFBIG) mid-render: one line saying the output could
    not be written, the file that was there before untouched, no hidden file left."""
    out = tmp_path / "o.mp4"
    out.write_bytes(b"the user's old video")
    long = tmp_path / "long.wav"
    write_wav(long, 30, 16000, 1)
    r = run_charrun(engine_dir, long, out, preexec_fn=_limit_file_size(40_000))
    line = _one_error(r)
    assert "could not be written (File too large)" in line and "as it was" in line, line
    assert "holds" not in line
    assert out.read_bytes() == b"the user's old video"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["long.wav", "o.mp4"]


def test_a_killed_renders_hidden_file_is_removed_by_the_next_render(engine_dir, tmp_path):
    long = tmp_path / "long.wav"
    write_wav(long, 60, 16000, 1)
    out = tmp_path / "o.mp4"
    p = subprocess.Popen(CHARRUN + ["--engine", str(engine_dir), "--image", str(FACE), "--audio",
                                    str(long), "--out", str(out)], stderr=subprocess.PIPE,
                         text=True)
    assert "first frames written" in p.stderr.readline() or \
        any("first frames written" in ln for ln in iter(p.stderr.readline, ""))
    p.kill()
    p.wait(30)
    left = [q.name for q in tmp_path.iterdir() if q.name.startswith(".o.writing-")]
    assert left and not out.exists()  # what SIGKILL leaves
    r = run_charrun(engine_dir, SPEECH, out)
    assert r.returncode == 0, r.stderr
    assert sorted(q.name for q in tmp_path.iterdir()) == ["long.wav", "o.mp4"]


def test_sighup_keeps_what_was_made_as_sigterm_does(engine_dir, tmp_path):
    long = tmp_path / "long.wav"
    write_wav(long, 60, 16000, 1)
    out = tmp_path / "o.mp4"
    p = subprocess.Popen(CHARRUN + ["--engine", str(engine_dir), "--image", str(FACE), "--audio",
                                    str(long), "--out", str(out)], stderr=subprocess.PIPE,
                         text=True)
    for line in iter(p.stderr.readline, ""):
        if "first frames written" in line:
            break
    p.send_signal(signal.SIGHUP)
    err = p.stderr.read()
    assert p.wait(60) == 128 + signal.SIGHUP, err
    assert "stopped by SIGHUP after" in err and "Traceback" not in err, err
    frames, _, _, _ = probe(out)
    assert frames > 0 and f"holds {frames} frames" in err, err


def test_speech_declaring_1_hz_and_a_seed_past_the_generators_are_one_line(engine_dir, tmp_path):
    bad = tmp_path / "one-hertz.wav"
    with wave.open(str(bad), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(1)
        w.writeframes(np.zeros(50_000, np.int16).tobytes())
    line = _one_error(run_charrun(engine_dir, bad, tmp_path / "o.mp4"))
    assert "declares a sample rate of 1 Hz" in line and "8,000 to 192,000 Hz" in line, line
    r = subprocess.run(CHARRUN + ["--engine", str(engine_dir), "--image", str(FACE), "--audio",
                                  str(SPEECH), "--out", str(tmp_path / "o.mp4"), "--seed",
                                  str(2 ** 70)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Invalid value for '--seed'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "o.mp4").exists()


def test_an_engine_the_user_cannot_read_is_one_line_naming_the_file(engine_dir, tmp_path):
    """An engine file private to another user (0600, owned by the container's uid 10001):
    charrun, without the right to read others' files, says in one line which and what to
    do. charbuild's own engines are readable by all."""
    import os
    import shutil

    for d, _, files in os.walk(engine_dir):
        assert os.stat(d).st_mode & 0o005 == 0o005, d
        for f in files:
            assert os.stat(os.path.join(d, f)).st_mode & 0o004, f
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to hand a file to another user and read as one "
                    "who may not")
    private = tmp_path / "engine"
    shutil.copytree(engine_dir, private)
    os.chown(private / "rank0.safetensors", 10001, 10001)
    os.chmod(private / "rank0.safetensors", 0o600)
    # root without the capabilities that override file permissions, as any other user
    r = subprocess.run(["setpriv", "--bounding-set", "-dac_override,-dac_read_search",
                        *CHARRUN, "--engine", str(private), "--image", str(FACE), "--audio",
                        str(SPEECH), "--out", str(tmp_path / "o.mp4")],
                       capture_output=True, text=True, timeout=300)
    line = _one_error(r)
    assert "cannot read engine file rank0.safetensors (permission denied for uid" in line and \
        "chmod -R a+rX" in line, line
