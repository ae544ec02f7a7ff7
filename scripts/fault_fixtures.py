"""The fault matrix's fixtures (scripts/fault_matrix.py): the files a run makes (engines,
speech in several formats, images, a user's pretend files, damaged checkpoints and engines),
the running command a case acts on (`Running`), and what a case does before, during and
after it (signals at a printed line, HTTP requests and WebRTC peers against a server,
checks of what the command left)."""


from __future__ import annotations

import http.client
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import wave
from fractions import Fraction
from pathlib import Path
from typing import Callable

import av
import numpy as np
import psutil
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from offers import answer_of, slow_upload  # noqa: E402 - and their requests


SAMPLE_S = 0.05  # memory sampling period
GRACE_S = 3.0  # how long a case's processes may outlive its main process
REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "assets"
CHECKPOINT = REPO / "charengine" / "checkpoints" / "tiny.safetensors"
SIDE_PREFIXES = ("audio_encoder.", "decoder.", "image_encoder.", "text_encoder.")
NETNS = f"charfm{__import__('os').getpid()}"  # the run's network namespace, for WebRTC peers
NETNS_SUBNET = "10.233.9"
def run_quiet(argv: list[str], cwd: Path) -> None:
    r = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()[-400:]}")


def build_engines(root: Path, tools: dict[str, str]) -> None:
    run_quiet([tools["charbuild"], "--target", "cpu-tiny", "--out", "cpu-tiny"], root)
    run_quiet([tools["charbuild"], "--target", "cpu-tiny-tp2", "--random-weights",
               "--out", "cpu-tiny-tp2"], root)


def speech_samples() -> tuple[np.ndarray, int]:
    with wave.open(str(ASSETS / "speech.wav")) as w:
        rate, width, channels = w.getframerate(), w.getsampwidth(), w.getnchannels()
        data = w.readframes(w.getnframes())
    assert width == 2, "assets/speech.wav: expected 16-bit PCM"
    x = np.frombuffer(data, dtype="<i2").reshape(-1, channels)[:, 0]
    return x, rate


def write_wav_s16(path: Path, x: np.ndarray, rate: int) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(x.astype("<i2").tobytes())


def write_audio(path: Path, x: np.ndarray, rate: int, codec: str, fmt: str) -> None:
    """float32 mono samples -> an audio file through PyAV (codec e.g. pcm_f32le, aac)."""
    with av.open(str(path), "w", format=fmt) as c:
        s = c.add_stream(codec, rate=rate)
        s.layout = "mono"
        size = s.codec_context.frame_size or 1024
        sample_fmt = s.codec_context.format.name
        pcm16 = sample_fmt.startswith("s16")  # the codec takes 16-bit integers
        for i in range(0, len(x), size):
            chunk = x[i:i + size] * 32767 if pcm16 else x[i:i + size]
            chunk = np.ascontiguousarray(chunk, dtype=np.int16 if pcm16 else np.float32)[None]
            frame = av.AudioFrame.from_ndarray(chunk, format=sample_fmt, layout="mono")
            frame.sample_rate, frame.pts = rate, i
            frame.time_base = Fraction(1, rate)
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def make_audio(root: Path) -> None:
    shutil.copy(ASSETS / "speech.wav", root / "speech.wav")
    x, rate = speech_samples()
    write_wav_s16(root / "long.wav", np.tile(x, -(-60 * rate // len(x)))[:60 * rate], rate)
    f = x.astype(np.float32) / 32768
    nan = f[:rate].copy()
    nan[rate // 2] = np.nan
    write_audio(root / "nan.wav", nan, rate, "pcm_f32le", "wav")
    write_wav_s16(root / "truncated.wav", x[:2 * rate], rate)
    data = (root / "truncated.wav").read_bytes()
    (root / "truncated.wav").write_bytes(data[:len(data) // 2])
    write_audio(root / "speech3s.m4a", np.resize(f, 3 * rate), rate, "aac", "ipod")
    write_audio(root / "adpcm.wav", f[:rate], rate, "adpcm_ms", "wav")  # a codec not read
    write_audio(root / "speech.au", f[:rate], rate, "pcm_s16be", "au")  # a container not read
    write_wav_s16(root / "1hz.wav", np.zeros(50_000, np.int16), 1)  # 128 kB: 50,000 s at 1 Hz


def make_images(root: Path) -> None:
    shutil.copy(ASSETS / "face.png", root / "face.png")
    face = Image.open(ASSETS / "face.png").convert("RGB")
    (root / "not-an-image.png").write_text("this is a text file, not a picture\n")
    Image.new("RGB", (16000, 16000)).save(root / "huge-16000.png", compress_level=1)
    face.resize((6000, 6000), Image.Resampling.BILINEAR).save(root / "big-6000.png")
    Image.new("RGB", (8, 8), (200, 120, 90)).save(root / "tiny-8.png")
    rgba = face.convert("RGBA")
    alpha = np.full(rgba.size[::-1], 255, np.uint8)
    alpha[:, : rgba.size[0] // 3] = 0
    rgba.putalpha(Image.fromarray(alpha))
    rgba.save(root / "transparent.png")


def make_shared(root: Path, tools: dict[str, str]) -> None:
    (root / "out").mkdir()
    make_audio(root)
    make_images(root)
    build_engines(root, tools)


def write_files(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def make_user_dir(root: Path, ctx: dict) -> None:
    write_files(root, {"userdir/notes.txt": "my notes\n", "userdir/photos/cat.jpg": "meow\n"})


def make_project(root: Path, ctx: dict) -> None:
    write_files(root, {"proj/README.md": "# my project\n", "proj/sub/data.csv": "a,b\n1,2\n",
                       "proj/sub/deep/model.bin": "weights\n"})


def make_here(root: Path, ctx: dict) -> None:
    write_files(root, {"here/thesis.tex": "\\documentclass{article}\n"})


def make_user_file(root: Path, ctx: dict) -> None:
    write_files(root, {"files/engine.bin": "a user's file named like an engine\n",
                       "files/other.txt": "other\n"})


def make_old_engine(root: Path, ctx: dict) -> None:
    (root / "rep").mkdir()
    shutil.copytree(root / "cpu-tiny", root / "rep" / "engine")
    write_files(root, {"rep/keep.txt": "beside the engine\n"})
    ctx["old_inode"] = (root / "rep" / "engine").stat().st_ino


def make_out_dir(root: Path, ctx: dict) -> None:
    write_files(root, {"outdir/keep.txt": "a user's file\n"})


def make_existing_video(root: Path, ctx: dict) -> None:
    make_existing_video_at("existing.mp4")(root, ctx)


def make_existing_video_at(name: str) -> Callable[[Path, dict], None]:
    return lambda root, ctx: write_grey_video(root / "out" / name)


def write_grey_video(path: Path) -> None:
    """A user's earlier video (12 grey frames) at the --out path."""
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=24)
        s.width, s.height, s.pix_fmt = 64, 64, "yuv420p"
        for i in range(12):
            img = np.full((64, 64, 3), 10 * i, np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def load_checkpoint() -> dict:
    from safetensors.torch import load_file

    return load_file(str(CHECKPOINT))


def save_checkpoint(root: Path, name: str, state: dict) -> None:
    from safetensors.torch import save_file

    (root / "ckpt" / name).parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(root / "ckpt" / name))


def make_nan_ckpt(root: Path, ctx: dict) -> None:
    state = load_checkpoint()
    state["blocks.0.w_in"] = state["blocks.0.w_in"].clone()
    state["blocks.0.w_in"][3, 5] = float("nan")
    save_checkpoint(root, "nan.safetensors", state)


def make_shape_ckpt(root: Path, ctx: dict) -> None:
    import torch

    state = load_checkpoint()
    state["decoder.conv_out.conv.bias"] = torch.zeros(4)
    save_checkpoint(root, "shape.safetensors", state)


def make_noside_ckpt(root: Path, ctx: dict) -> None:
    state = {k: v for k, v in load_checkpoint().items() if not k.startswith(SIDE_PREFIXES)}
    save_checkpoint(root, "noside.safetensors", state)


def make_missing_shard(root: Path, ctx: dict) -> None:
    """The tiny checkpoint as two shards and their index, the second shard gone."""
    import json

    state = load_checkpoint()
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_checkpoint(root, f"shards/{file}", {k: state[k] for k in part})
    (root / "ckpt" / "shards" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, part in halves.items() for k in part}}))
    (root / "ckpt" / "shards" / "model-00002-of-00002.safetensors").unlink()


def make_foreign_lora(root: Path, ctx: dict) -> None:
    """The tiny checkpoint, and a LoRA for a module it does not have."""
    import torch

    save_checkpoint(root, "base.safetensors", load_checkpoint())
    save_checkpoint(root, "foreign-lora.safetensors", {
        "blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 64),
        "blocks.0.attn.to_q.lora_B.weight": torch.zeros(64, 4)})


def make_text_ckpt(root: Path, ctx: dict) -> None:
    write_files(root, {"ckpt/notes.safetensors": "not a checkpoint, just some notes\n" * 20})


def engine_copy(name: str, damage: Callable[[Path], None]) -> Callable[[Path, dict], None]:
    def setup(root: Path, ctx: dict) -> None:
        shutil.copytree(root / "cpu-tiny", root / name)
        damage(root / name)
    return setup


def manifest_list(engine: Path) -> None:
    (engine / "manifest.json").write_text("[1, 2, 3]\n")


def manifest_dim_string(engine: Path) -> None:
    m = json.loads((engine / "manifest.json").read_text())
    m["config"]["model"]["dim"] = str(m["config"]["model"]["dim"])
    (engine / "manifest.json").write_text(json.dumps(m, indent=2))


def flip_rank_byte(engine: Path) -> None:
    p = engine / "rank0.safetensors"
    data = bytearray(p.read_bytes())
    data[-10] ^= 0xFF
    p.write_bytes(bytes(data))


def version_string(engine: Path) -> None:
    m = json.loads((engine / "manifest.json").read_text())
    m["format_version"] = str(m["format_version"])
    (engine / "manifest.json").write_text(json.dumps(m, indent=2))


# root without the capabilities that override file permissions: reads as any other user
NO_READ_OVERRIDE = ("setpriv", "--bounding-set", "-dac_override,-dac_read_search")


def can_drop_read_override() -> bool:
    import os

    return os.geteuid() == 0 and shutil.which("setpriv") is not None


def private_rank_file(root: Path, ctx: dict) -> None:
    """An engine whose rank file is another user's (uid 10001), readable by it alone."""
    import os

    shutil.copytree(root / "cpu-tiny", root / "eng-private")
    f = root / "eng-private" / "rank0.safetensors"
    os.chown(f, 10001, 10001)
    os.chmod(f, 0o600)
    ctx["notes"].append("rank0.safetensors: uid 10001, 0600; charrun without the right to "
                        "read others' files")


class Shell:
    """Unpickled, runs a command (creates the file `path`)."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.path}",))


def make_evil_vae(root: Path, ctx: dict) -> None:
    """A VAE .pth, saved by torch, that runs a command when unpickled (it creates ran.txt)."""
    import torch

    (root / "ckpt").mkdir(exist_ok=True)
    torch.save({"conv1.weight": Shell(root / "ran.txt")}, root / "ckpt" / "evil.pth")


def check_not_ran(root: Path, ctx: dict) -> None:
    ctx["facts"]["ran"] = (root / "ran.txt").exists()
    advice = "weights_only=False" in ctx["stderr"] or "Re-running" in ctx["stderr"]
    ctx["facts"]["ran"] = ctx["facts"]["ran"] or advice
    ctx["notes"].append("the pickled command did not run; no advice to unpickle printed"
                        if not ctx["facts"]["ran"] else "RAN or advised weights_only=False")


def second_build_meanwhile(running: Running, ctx: dict) -> None:
    """Once the build writes its staging, stop it (SIGSTOP), run a second build to the same
    --out, let the first go on."""
    if not running.wait_for("rank 0:"):
        ctx["notes"].append("never printed 'rank 0:'")
        return
    running.signal(signal.SIGSTOP)
    try:
        r = subprocess.run([ctx["tools"]["charbuild"], "--target", "cpu-tiny", "--out",
                            "twice/engine"], cwd=ctx["root"], capture_output=True, text=True,
                           timeout=120)
    finally:
        running.signal(signal.SIGCONT)
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("Error:")]
    ctx["facts"]["second_refused"] = r.returncode == 1 and "another charbuild" in r.stderr
    ctx["notes"].append(f"a second build meanwhile: exit {r.returncode}, "
                        f"{line[-1] if line else r.stderr.strip()[-120:]}")


def killed_build(out: str) -> Callable[[Path, dict], None]:
    """A build to `out` killed (SIGKILL) while writing its staging, before the case's own."""
    def setup(root: Path, ctx: dict) -> None:
        p = Running([ctx["tools"]["charbuild"], "--target", "cpu-tiny", "--out", out], root)
        p.wait_for("rank 0:")
        p.signal(signal.SIGKILL)
        p.proc.wait(30)
        p.close_streams()
        left = sorted(x.name for x in (root / out).parent.glob(".*"))
        ctx["notes"].append(f"a build killed mid-way first left {', '.join(left) or 'nothing'}")
    return setup


def check_readable(rel: str) -> Callable[[Path, dict], None]:
    def post(root: Path, ctx: dict) -> None:
        import os

        check_engine(rel)(root, ctx)
        paths = [root / rel, *(root / rel).rglob("*")]
        ok = all(os.stat(p).st_mode & (0o055 if p.is_dir() else 0o044) ==
                 (0o055 if p.is_dir() else 0o044) for p in paths)
        ctx["facts"]["readable"] = ok
        ctx["notes"].append("readable by every user" if ok else "NOT readable by every user")
    return post


def killed_render(out: str) -> Callable[[Path, dict], None]:
    """A render to `out` killed (SIGKILL) once it has written frames, before the case's."""
    def setup(root: Path, ctx: dict) -> None:
        p = Running([ctx["tools"]["charrun"], *render_argv(out, audio="long.wav")[1:]], root)
        p.wait_for("first frames written")
        p.signal(signal.SIGKILL)
        p.proc.wait(30)
        p.close_streams()
        left = sorted(x.name for x in (root / out).parent.glob(f".{Path(out).stem}.*"))
        ctx["notes"].append(f"a render killed mid-way first left {', '.join(left) or 'nothing'}")
    return setup


def limit_fsize(nbytes: int):
    def limit():
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return limit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_port(root: Path, ctx: dict) -> None:
    ctx["port"] = free_port()


def pick_ports(root: Path, ctx: dict) -> None:
    ctx["port"], ctx["health"] = free_port(), free_port()


def hold_port(root: Path, ctx: dict) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    ctx["port"] = s.getsockname()[1]
    ctx["close"].append(s)
    ctx["notes"].append("P held by another listening socket")


def pick_big_offer(root: Path, ctx: dict) -> None:
    import base64

    pick_port(root, ctx)
    png = base64.b64encode((root / "big-6000.png").read_bytes()).decode()
    ctx["offer"] = json.dumps({"type": "offer", "sdp": "v=0\r\n",
                               "image": f"data:image/png;base64,{png}"}).encode()


# ---------------------------------------------------------------------------------------
# running a command


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill_all(procs) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def signal_on(text: str, sig: int, twice: bool = False,
              again_on: str | None = None) -> Callable[[Running, dict], None]:
    """`sig` once `text` is printed; with `twice` again 50 ms later, with `again_on` again
    once that is printed."""
    def during(running: Running, ctx: dict) -> None:
        if not running.wait_for(text):
            ctx["notes"].append(f"never printed {text!r}")
            return
        running.signal(sig)
        if twice:
            time.sleep(0.05)
            running.signal(sig)
        if again_on and running.wait_for(again_on):
            running.signal(sig)
            ctx["notes"].append(f"second {signal.Signals(sig).name} after {again_on!r}")
    return during


def signal_after_s(delay: float, sig: int) -> Callable[[Running, dict], None]:
    def during(running: Running, ctx: dict) -> None:
        time.sleep(delay)
        running.signal(sig)
    return during


def sigterm_when_staging(running: Running, ctx: dict) -> None:
    """SIGTERM once the build's staging directory exists (so it lands mid-build)."""
    root = ctx["root"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and running.proc.poll() is None:
        if list(root.glob("staged/.engine.building-*")):
            ctx["notes"].append(f"SIGTERM {time.monotonic() - running.t0:.1f} s in, "
                                "with the staging directory there")
            running.signal(signal.SIGTERM)
            return
        time.sleep(0.005)
    ctx["notes"].append("no staging directory appeared")


def rank_processes(running: Running) -> list[psutil.Process]:
    out = []
    for p in running.descendants():
        try:
            if "spawn_main" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            pass
    return out


def kill_rank_on(text: str) -> Callable[[Running, dict], None]:
    def during(running: Running, ctx: dict) -> None:
        if not running.wait_for(text):
            ctx["notes"].append(f"never printed {text!r}")
            return
        ranks = rank_processes(running)
        if not ranks:
            ctx["notes"].append("no rank process found")
            return
        ranks[0].kill()
        ctx["notes"].append(f"SIGKILL to one of the {len(ranks)} rank processes")
    return during


def http_request(port: int, method: str, path: str, body: bytes | None = None,
                 timeout: float = 30.0, headers: dict | None = None
                 ) -> tuple[int | None, str, float]:
    """(status, body text, seconds); status None where no answer could be read."""
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        headers = {**({"Content-Type": "application/json"} if body is not None else {}),
                   **(headers or {})}
        try:
            conn.request(method, path, body=body, headers=headers)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may answer before it has read a body it refuses
        r = conn.getresponse()
        return r.status, r.read().decode("utf-8", "replace"), time.monotonic() - t0
    except (OSError, http.client.HTTPException) as e:
        return None, f"{type(e).__name__}: {e}", time.monotonic() - t0
    finally:
        conn.close()


def json_error(text: str) -> str | None:
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return None
    return body.get("error") if isinstance(body, dict) else None


def stop_server(running: Running) -> None:
    running.signal(signal.SIGTERM)


def offer_then_stop(body: Callable[[], bytes], what: str) -> Callable[[Running, dict], None]:
    return request_then_stop("POST", "/offer", body, what)


def request_then_stop(method: str, path: str, body: Callable[[], bytes] | None, what: str,
                      headers: dict | None = None, port: str = "port"
                      ) -> Callable[[Running, dict], None]:
    """Once the server serves: one request (to ctx[port]), its answer noted; then SIGTERM."""
    def during(running: Running, ctx: dict) -> None:
        if not running.wait_for("serving on", "stdout"):
            ctx["notes"].append("never printed 'serving on'")
            return
        status, text, secs = http_request(ctx[port], method, path,
                                          body() if body is not None else None,
                                          headers=headers)
        err = json_error(text)
        ctx["facts"].update(status=status, json_error=err is not None)
        shown = f'{{"error": "{err}"}}' if err else text
        ctx["notes"].append(f"{method} {path} ({what}) -> {status} in {secs:.2f} s: {shown}")
        stop_server(running)
    return during


def offer_with(**fields) -> Callable[[], bytes]:
    return lambda: json.dumps({"type": "offer", "sdp": "v=0\r\n", **fields}).encode()


def uploads_in_flight(running: Running, ctx: dict) -> None:
    """Four offers whose bodies are still arriving (1 MB declared each); a fifth gets 503
    with Retry-After before its body is read."""
    if not running.wait_for("serving on", "stdout"):
        ctx["notes"].append("never printed 'serving on'")
        return
    port, held = ctx["port"], []

    def inflight() -> int:
        return json.loads(http_request(port, "GET", "/status")[1])["uploads_in_flight"]

    try:
        for k in range(4):
            held.append(slow_upload(port, 1 << 20))
            deadline = time.monotonic() + 30
            while inflight() != k + 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        with slow_upload(port, 1 << 20) as fifth:
            head, _ = answer_of(fifth)
        status = head.split()[1]
        retry = re.search(r"Retry-After: (\S+)", head)
        ctx["facts"]["fifth"] = f"{status} Retry-After {retry.group(1) if retry else None}"
        ctx["notes"].append(f"4 uploads of 1 MB in flight; a fifth -> {status}, Retry-After "
                            f"{retry.group(1) if retry else 'none'}")
    finally:
        for s in held:
            s.close()
    stop_server(running)


def rank_dies_idle(running: Running, ctx: dict) -> None:
    """A TP rank killed while the server is idle: /readyz and an offer from the moment its
    process has exited (the offer waits for the ranks started afresh: its SDP, read after
    them, is refused), the log, and the ranks back."""
    if not running.wait_for("serving on", "stdout", timeout=80):
        ctx["notes"].append("never printed 'serving on'")
        return
    ranks = rank_processes(running)
    ranks[-1].kill()
    ranks[-1].wait(10)
    t0 = time.monotonic()
    ready, body, _ = http_request(ctx["health"], "GET", "/readyz")
    offer, said, _ = http_request(ctx["port"], "POST", "/offer", offer_with()(), timeout=60)
    fresh = not {p.pid for p in rank_processes(running)} & {p.pid for p in ranks}
    ctx["facts"].update(not_ready_at_once=ready == 503,
                        offer_on_fresh_ranks=offer == 400 and fresh)
    logged = running.wait_for("died (exit -9)", timeout=10)
    while time.monotonic() - t0 < 60:
        if http_request(ctx["health"], "GET", "/readyz")[0] == 200:
            break
        time.sleep(0.1)
    back = time.monotonic() - t0
    ctx["facts"].update(logged=logged, ready_again=back < 60)
    ctx["notes"].append(f"rank killed: /readyz {ready} ({json.loads(body).get('detail')}); "
                        f"an offer waited for fresh ranks ({fresh}), then {offer} "
                        f"({json_error(said)}); logged: {logged}; ready again {back:.1f} s "
                        "later")
    stop_server(running)


def probe_idle_connections(count: int) -> Callable[[Running, dict], None]:
    """Once the server serves: `count` connections to the probe port that say nothing; the
    server's threads with them open, whether each is closed by the server, then /healthz."""
    def during(running: Running, ctx: dict) -> None:
        if not running.wait_for("serving on", "stdout"):
            ctx["notes"].append("never printed 'serving on'")
            return
        before = running.ps.num_threads()
        idle = [socket.create_connection(("127.0.0.1", ctx["health"]), timeout=30)
                for _ in range(count)]
        time.sleep(1.0)  # the server has accepted them
        added = running.ps.num_threads() - before

        def closed(c: socket.socket) -> bool:
            try:
                return c.recv(1) == b""
            except OSError:
                return False
        try:
            shut = sum(closed(c) for c in idle)
        finally:
            for c in idle:
                c.close()
        status, _, secs = http_request(ctx["health"], "GET", "/healthz")
        ctx["facts"].update(threads_added=added, closed=shut, healthz=status)
        ctx["notes"].append(f"{count} idle connections to the probe port: {added} threads "
                            f"added, {shut} closed by the server; then GET /healthz -> "
                            f"{status} in {secs:.2f} s")
        stop_server(running)
    return during


def metrics_during_offer(running: Running, ctx: dict) -> None:
    if not running.wait_for("serving on", "stdout"):
        ctx["notes"].append("never printed 'serving on'")
        return
    port, answer = ctx["port"], {}

    def offer():
        answer["result"] = http_request(port, "POST", "/offer", ctx["offer"], timeout=60)

    t = threading.Thread(target=offer, daemon=True)
    t.start()
    times = []
    while t.is_alive():
        status, _, secs = http_request(port, "GET", "/metrics", timeout=10)
        if t.is_alive() and status == 200:
            times.append(secs)
        time.sleep(0.05)
    t.join()
    status, text, secs = answer["result"]
    err = json_error(text)
    ctx["facts"].update(metrics_during=len(times), metrics_max_s=round(max(times), 3)
                        if times else None)
    ctx["notes"].append(f"POST /offer (6000 x 6000 PNG, SDP 'v=0') -> {status} in {secs:.2f} s "
                        f"({err or text[:80]}); "
                        f"GET /metrics answered {len(times)} times meanwhile, slowest "
                        f"{max(times) if times else float('nan'):.3f} s")
    stop_server(running)


def in_netns(*cmd: str) -> list[str]:
    return ["ip", "netns", "exec", NETNS, *cmd]


# polls a server's /status inside the namespace; prints the monotonic time it reads "ready"
READY_POLL = ("import json, sys, time, urllib.request\n"
              "while True:\n"
              "    s = json.load(urllib.request.urlopen(sys.argv[1] + 'status'))\n"
              "    if s['state'] == 'ready': print(time.monotonic(), flush=True); break\n"
              "    time.sleep(0.05)\n")


def client_vanishes(running: Running, ctx: dict) -> None:
    """A WebRTC client streaming is killed (SIGKILL: it says nothing); how long until the
    server has freed the session's slot (/status reads ready)."""
    if not running.wait_for("serving on", "stdout"):
        ctx["notes"].append("never printed 'serving on'")
        return
    url = f"http://127.0.0.1:{ctx['port']}/"
    client = subprocess.Popen(in_netns(sys.executable, str(REPO / "tests" / "webrtc_client.py"),
                                       "--url", url, "--seconds", "60"),
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        streaming = any(json.loads(ln)["kind"] == "streaming"
                        for ln in iter(client.stdout.readline, "")
                        if json.loads(ln)["kind"] in ("streaming", "refused", "timeout"))
    finally:
        client.kill()
    killed = time.monotonic()
    client.wait(10)
    poll = subprocess.run(in_netns(sys.executable, "-c", READY_POLL, url), capture_output=True,
                          text=True, timeout=60)
    freed = float(poll.stdout.split()[0]) - killed if poll.returncode == 0 else None
    ctx["facts"]["freed_s"] = round(freed, 2) if freed is not None else None
    cause = re.search(r"session \d+: (the client [^;]+)", running.text("stderr"))
    ctx["notes"].append(f"streaming: {streaming}; the client killed (SIGKILL): the slot free "
                        f"{freed:.1f} s later ({cause.group(1) if cause else 'cause not logged'})"
                        if freed is not None else "the slot was not freed within 60 s")
    stop_server(running)


def client_floods(flood: str) -> Callable[[Running, dict], None]:
    """A WebRTC client that sends more than a page does (tests/flooding_client.py: `flood`);
    what the server told it (the session's end and why), and whether the slot is free
    again."""
    def during(running: Running, ctx: dict) -> None:
        if not running.wait_for("serving on", "stdout"):
            ctx["notes"].append("never printed 'serving on'")
            return
        url = f"http://127.0.0.1:{ctx['port']}/"
        r = subprocess.run(in_netns(sys.executable, str(REPO / "tests" / "flooding_client.py"),
                                    "--url", url, "--flood", flood, "--seconds", "30"),
                           capture_output=True, text=True, timeout=90)
        got = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {}
        poll = subprocess.run(in_netns(sys.executable, "-c", READY_POLL, url),
                              capture_output=True, text=True, timeout=60)
        ctx["facts"].update(why=got.get("why"), ready_again=poll.returncode == 0)
        sent = (f"{got.get('checks', 0):,} ICE checks" if flood == "stun" else
                f"{got.get('messages', 0):,} messages of {got.get('bytes', 0):,} bytes on its "
                "data channel")
        ctx["notes"].append(f"{flood}: {sent}; ended: {got.get('why') or 'no'}; slot free "
                            f"again: {poll.returncode == 0}"
                            if got else f"the client failed: {r.stderr.strip()[-200:]}")
        stop_server(running)
    return during


def describe(p: psutil.Process) -> str:
    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return "process"
    return ("rank" if "spawn_main" in cmd else "resource tracker" if "resource_tracker" in cmd
            else "charrun" if "charrun" in cmd else Path(cmd.split(" ", 1)[0]).name)


def sigterm_served_tree(settle_s: float) -> Callable[[Running, dict], None]:
    """SIGTERM settle_s after 'serving on'; how long until every process of the tree is
    gone."""
    def during(running: Running, ctx: dict) -> None:
        if not running.wait_for("serving on", "stdout", timeout=80):
            ctx["notes"].append("never printed 'serving on'")
            return
        time.sleep(settle_s)
        ctx["notes"].append(f"SIGTERM {settle_s:g} s after 'serving on'")
        measure_tree_exit(running, ctx)
    return during


def measure_tree_exit(running: Running, ctx: dict) -> None:
    tree = [running.ps, *running.descendants()]
    names = {p.pid: describe(p) for p in tree}
    gone: dict[int, float] = {}
    t0 = time.monotonic()
    running.signal(signal.SIGTERM)
    while time.monotonic() - t0 < 10 and len(gone) < len(tree):
        for p in tree:
            done = running.proc.poll() is not None if p is running.ps else not alive(p)
            if done and p.pid not in gone:
                gone[p.pid] = time.monotonic() - t0
        time.sleep(0.01)
    last = max(gone.values()) if len(gone) == len(tree) else None
    ctx["facts"].update(tree_gone_s=round(last, 2) if last is not None else None,
                        tree_size=len(tree))
    order = sorted(gone.items(), key=lambda x: x[1])
    each = ", ".join(f"{names[pid]} {secs:.2f} s" for pid, secs in order)
    ctx["notes"].append(f"SIGTERM: all {len(tree)} processes gone in {last:.2f} s ({each})"
                        if last is not None else f"SIGTERM: processes still running after 10 s "
                        f"({each})")


# ---------------------------------------------------------------------------------------
# after a run: output file, user's files, claims


def decode(path: Path) -> dict:
    """Decode a video with PyAV: frames, frame rate and audio seconds, or why it failed."""
    if not path.is_file():
        return {"state": "no file"}
    try:
        with av.open(str(path)) as c:
            if not c.streams.video:
                return {"state": "unplayable", "why": "no video stream"}
            v = c.streams.video[0]
            rate = float(v.average_rate) if v.average_rate else None
            streams = [v, *c.streams.audio[:1]]
            frames, samples, arate = 0, 0, None
            for packet in c.demux(*streams):
                for frame in packet.decode():
                    if isinstance(frame, av.VideoFrame):
                        frames += 1
                    else:
                        samples += frame.samples
                        arate = frame.sample_rate
    except (av.FFmpegError, OSError, ValueError) as e:
        return {"state": "unplayable", "why": str(e)[:80]}
    if frames == 0:
        return {"state": "unplayable", "why": "no frame decodes"}
    return {"state": "plays", "frames": frames, "fps": rate,
            "audio_s": round(samples / arate, 3) if arate else None}


def check_steps(root: Path, ctx: dict) -> None:
    m = re.search(r"(\d+) steps, (\d+) frames", ctx["stderr"])
    d = ctx.get("decoded", {})
    if not m or d.get("state") != "plays":
        return
    steps = int(m.group(1))
    ok = d["frames"] == 4 * steps and d.get("fps") == 24
    ctx["facts"]["four_per_step"] = ok
    ctx["notes"].append(f"{steps} steps x 4 = {4 * steps} frames, decoded {d['frames']} at "
                        f"{d.get('fps'):g} fps")


def check_audio_duration(out: str) -> Callable[[Path, dict], None]:
    def post(root: Path, ctx: dict) -> None:
        d = ctx.get("decoded", {})
        ctx["facts"]["audio_s"] = d.get("audio_s")
        ctx["notes"].append(f"audio {d.get('audio_s')} s (input 3.0 s)")
    return post


def check_engine(rel: str) -> Callable[[Path, dict], None]:
    def post(root: Path, ctx: dict) -> None:
        ok = (root / rel / "manifest.json").is_file()
        ctx["facts"]["engine"] = ok
        ctx["notes"].append(f"engine {rel} {'written' if ok else 'missing'}")
    return post


def check_replaced(root: Path, ctx: dict) -> None:
    d = root / "rep" / "engine"
    ok = (d / "manifest.json").is_file() and d.stat().st_ino != ctx["old_inode"]
    ctx["facts"]["replaced"] = ok
    ctx["notes"].append("engine replaced" if ok else "engine not replaced")


def check_not_served(root: Path, ctx: dict) -> None:
    ctx["facts"]["served"] = "serving on" in ctx["stdout"]


def render_argv(out: str, image: str = "face.png", audio: str = "speech.wav",
                engine: str = "cpu-tiny", extra: tuple[str, ...] = ()) -> list[str]:
    return ["charrun", "--engine", engine, "--image", image, "--audio", audio, "--out", out,
            *extra]


class Running:
    """A command started in its own session, its stdout and stderr read line by line."""

    def __init__(self, argv: list[str], cwd: Path, fsize: int | None = None):
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True,
                                     preexec_fn=None if fsize is None else limit_fsize(fsize))
        self.ps = psutil.Process(self.proc.pid)
        self.lines: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self.closed: set[str] = set()
        self.cond = threading.Condition()
        self.readers = [threading.Thread(target=self._read, args=(name, getattr(self.proc, name)),
                                         daemon=True) for name in self.lines]
        for t in self.readers:
            t.start()

    def _read(self, name: str, stream) -> None:
        for raw in iter(stream.readline, b""):
            with self.cond:
                self.lines[name].append(raw.decode("utf-8", "replace").rstrip("\r\n"))
                self.cond.notify_all()
        with self.cond:
            self.closed.add(name)
            self.cond.notify_all()

    def wait_for(self, text: str, stream: str = "stderr", timeout: float = 60.0) -> bool:
        """Wait until a line holding `text` is printed; False if it never is."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                if any(text in line for line in self.lines[stream]):
                    return True
                left = deadline - time.monotonic()
                if left <= 0 or (stream in self.closed and self.proc.poll() is not None):
                    return False
                self.cond.wait(min(left, 0.1))

    def text(self, stream: str) -> str:
        with self.cond:
            return "\n".join(self.lines[stream])

    def descendants(self) -> list[psutil.Process]:
        try:
            return self.ps.children(recursive=True)
        except psutil.Error:
            return []

    def rss_mb(self, seen: dict[int, psutil.Process]) -> float:
        total = 0
        for p in [self.ps, *self.descendants()]:
            try:
                total += p.memory_info().rss
                seen.setdefault(p.pid, p)
            except psutil.Error:
                pass
        return total / 2**20

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def close_streams(self) -> None:
        for t in self.readers:
            t.join(2.0)


def supervise(running: Running, timeout: float) -> dict:
    """Wait for the command, sampling its tree's memory; kill the tree past `timeout`."""
    seen: dict[int, psutil.Process] = {}
    peak, timed_out = 0.0, False
    while True:
        try:
            rc = running.proc.wait(SAMPLE_S)
            break
        except subprocess.TimeoutExpired:
            pass
        peak = max(peak, running.rss_mb(seen))
        if time.monotonic() - running.t0 > timeout:
            timed_out = True
            kill_all([*running.descendants(), running.ps])
            rc = running.proc.wait()
            break
    wall = time.monotonic() - running.t0
    return {"rc": rc, "wall_s": wall, "peak_mb": peak, "timed_out": timed_out,
            "seen": [p for pid, p in seen.items() if pid != running.proc.pid]}


