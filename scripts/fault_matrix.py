"""Fault matrix: run charbuild and charrun against a table of faults and write what happened.

Each case runs the real command (charbuild, charrun render, charrun --serve) as a subprocess
against engines built fresh for the run, and records its exit code, the line it printed, any
Python traceback, whether its output file plays (decoded with PyAV) and holds the frames the
command claims, whether files a user had set up are intact, its wall time and the peak
memory of its process tree. The results replace the table between the markers
<!-- fault-matrix --> and <!-- /fault-matrix --> in docs/RELIABILITY.md (the file is created
if it is missing), and go to a JSON file with --json.

Everything the script makes (engines, media, outputs, a user's pretend files) lives in one
temporary directory, removed at the end; nothing else is touched.

    .venv/bin/python scripts/fault_matrix.py                     # all cases, about 4 minutes
    .venv/bin/python scripts/fault_matrix.py --json results.json
    .venv/bin/python scripts/fault_matrix.py --only 'render-sig' --no-doc   # a few cases
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import json
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import wave
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable

import av
import numpy as np
import psutil
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from netns import can_netns, namespace  # noqa: E402 - the tests' namespaces, shared
from offers import answer_of, slow_upload, wav_data_url  # noqa: E402 - and their requests

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "assets"
CHECKPOINT = REPO / "charengine" / "checkpoints" / "tiny.safetensors"
DOC = REPO / "docs" / "RELIABILITY.md"
BEGIN, END = "<!-- fault-matrix -->", "<!-- /fault-matrix -->"
REGENERATE = ".venv/bin/python scripts/fault_matrix.py"
SIDE_PREFIXES = ("audio_encoder.", "decoder.", "image_encoder.", "text_encoder.")
LEFTOVER_GLOBS = ("*.building-*", "*.partial", "*.replaced-*", "*.writing-*", ".*.lock")
BOX_CHARS = set("━─│┃┏┓┗┛┡┩└┘┌┐╇╈┳┻╋├┤┼╭╮╰╯")
LINE_WIDTH = 160
LOG_STAMP = re.compile(r"^\d{4}-\d\d-\d\d [\d:,.]+ ")  # logging's asctime
SAMPLE_S = 0.05  # memory sampling period
GRACE_S = 3.0  # how long a case's processes may outlive its main process
NETNS = f"charfm{__import__('os').getpid()}"  # the run's network namespace, for WebRTC peers
NETNS_SUBNET = "10.233.9"
HOSTILE_BEGIN, HOSTILE_END = "<!-- hostile-page -->", "<!-- /hostile-page -->"


# ---------------------------------------------------------------------------------------
# cases as data


@dataclass
class Expect:
    """What a case should do; anything else is listed among the run's problems."""
    rc: int | tuple | str | None = None  # exit code(s), "nonzero", or None for any
    plays: bool | None = None  # True: the output plays; False: no output file is written
    line: str | None = None  # a regex the printed line must match
    claim: bool = False  # a "holds N frames" claim must match the decoded frames
    max_s: float | None = None
    max_mb: float | None = None
    facts: Callable[[dict], list[str]] | None = None  # checks of what `during` recorded


@dataclass
class Case:
    """One fault. argv holds paths relative to the working directory and {name} fields
    filled from the case's context (e.g. {port}); setup(root, ctx) makes the case's files;
    during(running, ctx) acts while the command runs (signals, HTTP requests)."""
    name: str
    group: str
    argv: list[str]
    expect: Expect
    setup: Callable[[Path, dict], None] | None = None
    during: Callable[["Running", dict], None] | None = None
    post: Callable[[Path, dict], None] | None = None  # after the run: notes and facts
    cwd: str = "."
    out: str | None = None  # the output file, decoded afterwards
    guard: tuple[str, ...] = ()  # a user's files or directories that must be intact
    absent: tuple[str, ...] = ()  # paths that must not exist afterwards
    leftovers: tuple[str, ...] = ()  # directories that must hold no staging leftovers
    line: str | None = None  # regex picking the line reported (default: the last on stderr)
    timeout: float = 60.0
    fsize: int | None = None  # a file-size limit (bytes) on the command: a full disk's EFBIG
    wrap: tuple[str, ...] = ()  # a command the command runs under (setpriv)


def render_argv(out: str, image: str = "face.png", audio: str = "speech.wav",
                engine: str = "cpu-tiny", extra: tuple[str, ...] = ()) -> list[str]:
    return ["charrun", "--engine", engine, "--image", image, "--audio", audio, "--out", out,
            *extra]


def refused(line: str | None = None, rc: int | str = 1, **kw) -> Expect:
    return Expect(rc=rc, plays=False, line=line, **kw)


def plays(rc: int = 0, line: str | None = None, **kw) -> Expect:
    return Expect(rc=rc, plays=True, line=line, claim=True, **kw)


def charbuild_cases() -> list[Case]:
    build = ["charbuild", "--target", "cpu-tiny"]
    return [
        Case("build-out-user-dir", "charbuild", [*build, "--out", "userdir"],
             refused(r"holds files"), setup=make_user_dir, guard=("userdir",)),
        Case("build-out-dotdot", "charbuild", [*build, "--out", ".."],
             refused(r"current directory or one of its parents"), setup=make_project,
             cwd="proj/sub", guard=("proj",), leftovers=(".", "proj")),
        Case("build-out-dot", "charbuild", [*build, "--out", "."],
             refused(r"current directory"), setup=make_here, cwd="here", guard=("here",),
             leftovers=("here",)),
        Case("build-out-file", "charbuild", [*build, "--out", "files/engine.bin"],
             refused(r"not a directory"), setup=make_user_file, guard=("files",),
             leftovers=("files",)),
        Case("build-out-engine", "charbuild", [*build, "--out", "rep/engine"],
             Expect(rc=0, facts=fact_is(replaced=True)), setup=make_old_engine,
             post=check_replaced, guard=("rep/keep.txt",), leftovers=("rep",)),
        Case("build-unknown-target", "charbuild",
             ["charbuild", "--target", "no-such-gpu", "--out", "unk"],
             refused(r"unknown target"), absent=("unk",)),
        Case("build-nan-weight", "charbuild",
             [*build, "--weights", "ckpt/nan.safetensors", "--out", "e-nan"],
             refused(r"blocks\.0\.w_in"), setup=make_nan_ckpt, guard=("ckpt",),
             absent=("e-nan",), leftovers=(".",)),
        Case("build-side-shape", "charbuild",
             [*build, "--weights", "ckpt/shape.safetensors", "--out", "e-shape"],
             refused(r"decoder\.conv_out\.conv\.bias"), setup=make_shape_ckpt,
             guard=("ckpt",), absent=("e-shape",), leftovers=(".",)),
        Case("build-no-side", "charbuild",
             [*build, "--weights", "ckpt/noside.safetensors", "--out", "e-noside"],
             refused(r"random-side-networks"), setup=make_noside_ckpt, guard=("ckpt",),
             absent=("e-noside",), leftovers=(".",)),
        Case("build-no-side-random", "charbuild",
             [*build, "--weights", "ckpt/noside.safetensors", "--random-side-networks",
              "--out", "e-noside-random"],
             Expect(rc=0, line=r"random", facts=fact_is(engine=True)), setup=make_noside_ckpt,
             post=check_engine("e-noside-random"), guard=("ckpt",), leftovers=(".",),
             line=r"side networks"),
        Case("build-not-safetensors", "charbuild",
             [*build, "--weights", "ckpt/notes.safetensors", "--out", "e-bad"],
             refused(r"safetensors"), setup=make_text_ckpt, guard=("ckpt",),
             absent=("e-bad",), leftovers=(".",)),
        Case("build-sigterm-mid", "charbuild", [*build, "--out", "staged/engine"],
             refused(rc=143), during=sigterm_when_staging,
             absent=("staged",), leftovers=(".",)),
        Case("build-sigterm-0.5s", "charbuild", [*build, "--out", "early/engine"],
             refused(rc=(143, -15)), during=signal_after_s(0.5, signal.SIGTERM),
             absent=("early",), leftovers=(".",)),
        Case("build-no-room", "charbuild", [*build, "--out", "full/engine"],
             refused(r"could not be written \(a file-size limit"), fsize=200_000,
             absent=("full",), leftovers=(".",)),
        Case("build-while-another-builds", "charbuild", [*build, "--out", "twice/engine"],
             Expect(rc=0, facts=fact_is(second_refused=True, engine=True)),
             during=second_build_meanwhile, post=check_engine("twice/engine"),
             leftovers=("twice",), timeout=120),
        Case("build-after-a-killed-build", "charbuild", [*build, "--out", "again/engine"],
             Expect(rc=0, facts=fact_is(engine=True, readable=True)),
             setup=killed_build("again/engine"), post=check_readable("again/engine"),
             leftovers=("again",), timeout=120),
        Case("build-preset-of-another-family", "charbuild",
             [*build, "--preset", "tiny-livetalk", "--out", "other"],
             refused(r"is a livetalk model and target cpu-tiny serves the characters"),
             absent=("other",)),
        Case("build-prompt-nothing-encodes", "charbuild",
             ["charbuild", "--target", "cpu-tiny-livetalk", "--prompt", "a guide", "--out",
              "prompted"], refused(r"--prompt is encoded at build by --text-encoder"),
             absent=("prompted",)),
        Case("build-vae-pickles-os-system", "charbuild",
             ["charbuild", "--target", "cpu-tiny-livetalk", "--vae", "ckpt/evil.pth", "--out",
              "evil"], refused(r"refused: it pickles \S*system", facts=fact_is(ran=False)),
             setup=make_evil_vae, post=check_not_ran, absent=("evil",)),
    ]


def render_cases() -> list[Case]:
    def case(name, argv, expect, out=None, **kw):
        return Case(name, "render", argv, expect, out=out, **kw)

    def render(name, expect, image="face.png", audio="speech.wav", engine="cpu-tiny",
               out=None, extra=(), **kw):
        out = out or f"out/{name}.mp4"
        return case(name, render_argv(out, image, audio, engine, extra), expect, out=out, **kw)

    stopped = r"stopped by SIG\w+ after \d+ steps; .* holds \d+ frames"
    return [
        render("render-good", plays(line=r"^wrote .*: \d+ frames at 24 fps",
                                    facts=fact_is(four_per_step=True)),
               post=check_steps, line=r"^wrote "),
        render("render-sigint", plays(rc=130, line=stopped), audio="long.wav",
               during=signal_on("first frames written", signal.SIGINT)),
        render("render-sigterm", plays(rc=143, line=stopped), audio="long.wav",
               during=signal_on("first frames written", signal.SIGTERM)),
        render("render-sigint-twice", plays(rc=130, line=stopped), audio="long.wav",
               during=signal_on("first frames written", signal.SIGINT, twice=True)),
        render("render-sigint-while-exiting", plays(rc=130, line=stopped), audio="long.wav",
               during=signal_on("first frames written", signal.SIGINT, again_on="stopped by")),
        render("render-nan-audio", refused(r"NaN"), audio="nan.wav"),
        render("render-truncated-wav", plays(line=r"warning: .*ends early"),
               audio="truncated.wav", line=r"warning"),
        render("render-m4a-3s", plays(facts=fact_audio_s(3.0, 0.05)), audio="speech3s.m4a",
               post=check_audio_duration("out/render-m4a-3s.mp4")),
        render("render-not-an-image", refused(r"not an image"), image="not-an-image.png"),
        render("render-16000px", refused(r"megapixels", max_s=8.0, max_mb=500),
               image="huge-16000.png"),
        render("render-6000px", plays(), image="big-6000.png", line=r"^wrote "),
        render("render-8px", refused(r"at least"), image="tiny-8.png"),
        render("render-transparent", plays(line=r"background"), image="transparent.png",
               line=r"background"),
        render("render-out-dir", refused(r"is a directory"), out="outdir", setup=make_out_dir,
               guard=("outdir",)),
        render("render-out-txt", refused(r"video file name"), out="out/x.txt",
               absent=("out/x.txt",)),
        render("render-out-proc", refused(r"cannot be created|not writable"),
               out="/proc/x.mp4"),
        render("render-slack-0", refused(r"slack", rc=2), extra=("--slack", "0")),
        render("render-existing-out-kept", Expect(rc=1, line=r"NaN"), audio="nan.wav",
               out="out/existing.mp4", setup=make_existing_video, guard=("out/existing.mp4",),
               leftovers=("out",)),
        render("render-not-audio", refused(r"not an audio file"), audio="face.png"),
        render("render-missing-engine", refused(r"not an engine directory"),
               engine="no-engine"),
        render("render-manifest-list", refused(r"JSON object"), engine="eng-list",
               setup=engine_copy("eng-list", manifest_list)),
        render("render-manifest-type", refused(r"dim|config"), engine="eng-type",
               setup=engine_copy("eng-type", manifest_dim_string)),
        render("render-damaged-rank", refused(r"checksum|damaged"), engine="eng-damaged",
               setup=engine_copy("eng-damaged", flip_rank_byte)),
        render("render-tp2", plays(), engine="cpu-tiny-tp2", line=r"^wrote ", timeout=90),
        render("render-tp2-rank-killed", plays(rc=1, line=r"rank"), engine="cpu-tiny-tp2",
               audio="long.wav", during=kill_rank_on("first frames written"), timeout=90),
        render("render-no-room", Expect(rc=1, line=r"could not be written \(File too large\)"
                                        r".*as it was"),
               audio="long.wav", out="out/kept.mp4", setup=make_existing_video_at("kept.mp4"),
               guard=("out/kept.mp4",), leftovers=("out",), fsize=40_000),
        render("render-sighup", plays(rc=129, line=stopped), audio="long.wav",
               during=signal_on("first frames written", signal.SIGHUP)),
        render("render-after-a-killed-render", plays(line=r"^wrote "),
               out="out/again.mp4", setup=killed_render("out/again.mp4"),
               leftovers=("out",), line=r"^wrote "),
        render("render-1hz-wav", refused(r"declares a sample rate of 1 Hz"), audio="1hz.wav"),
        render("render-seed-2**70", refused(r"--seed", rc=2), extra=("--seed", str(2 ** 70))),
        render("render-manifest-version-string", refused(r"format_version' is str"),
               engine="eng-version", setup=engine_copy("eng-version", version_string)),
        *([render("render-engine-file-not-readable",
                  refused(r"cannot read engine file rank0.safetensors \(permission denied"),
                  engine="eng-private", setup=private_rank_file, wrap=NO_READ_OVERRIDE)]
          if can_drop_read_override() else []),
    ]


def serve_cases() -> list[Case]:
    serve = ["charrun", "--engine", "cpu-tiny", "--serve", "--port", "{port}"]
    return [
        Case("serve-port-in-use", "serve", serve,
             Expect(rc="nonzero", line=r"cannot listen", facts=fact_is(served=False)),
             setup=hold_port, post=check_not_served),
        Case("serve-port-70000", "serve", [*serve[:-1], "70000"],
             Expect(rc=2, line=r"70000", facts=fact_is(served=False)),
             post=check_not_served),
        Case("serve-offer-malformed", "serve", serve,
             Expect(rc=0, facts=fact_http(400)), setup=pick_port,
             during=offer_then_stop(lambda: b"{not json", "malformed JSON")),
        Case("serve-offer-no-sdp", "serve", serve,
             Expect(rc=0, facts=fact_http(400)), setup=pick_port,
             during=offer_then_stop(lambda: b'{"type": "offer"}', "JSON without sdp")),
        Case("serve-offer-bad-sdp", "serve", serve,
             Expect(rc=0, facts=fact_http(400)), setup=pick_port,
             during=offer_then_stop(lambda: b'{"type": "offer", "sdp": "v=0\\r\\n"}',
                                    "sdp 'v=0'")),
        Case("serve-offer-65MB", "serve", serve,
             Expect(rc=0, facts=fact_http(413)), setup=pick_port,
             during=offer_then_stop(lambda: b'{"sdp": "' + b"x" * (65 << 20) + b'"}',
                                    "65 MB body")),
        Case("serve-metrics-during-6000px-offer", "serve", serve,
             Expect(rc=0, facts=fact_metrics_fast(1.0)), setup=pick_big_offer,
             during=metrics_during_offer, timeout=90),
        Case("serve-tp2-sigterm", "serve",
             ["charrun", "--engine", "cpu-tiny-tp2", "--serve", "--port", "{port}"],
             Expect(rc=0, facts=fact_tree_gone(2.0)), setup=pick_port,
             during=sigterm_served_tree(0.5), timeout=90),
        Case("serve-sigterm-on-ready", "serve", serve,
             Expect(rc=0, line=r"stopping"), setup=pick_port,
             during=sigterm_served_tree(0.0)),
        *hostile_request_cases(serve),
        Case("serve-uploads-in-flight", "serve", serve,
             Expect(rc=0, facts=fact_is(fifth="503 Retry-After 2")), setup=pick_port,
             during=uploads_in_flight),
        Case("serve-rank-dies-idle", "serve",
             ["charrun", "--engine", "cpu-tiny-tp2", "--serve", "--port", "{port}",
              "--health-port", "{health}"],
             Expect(rc=0, facts=fact_is(not_ready_at_once=True, offer_on_fresh_ranks=True,
                                        logged=True, ready_again=True)),
             setup=pick_ports, during=rank_dies_idle, timeout=120),
    ]


def peer_cases() -> list[Case]:
    """Cases with a WebRTC peer: in a network namespace of the run's own (aioice gathers no
    loopback candidates), so only where one can be made (root, iproute2)."""
    if not can_netns():
        return []
    serve = ["charrun", "--engine", "cpu-tiny", "--serve", "--port", "{port}"]
    return [Case("serve-client-vanishes", "serve", serve,
                 Expect(rc=0, facts=fact_freed_within(5.0)), setup=pick_port,
                 during=client_vanishes, wrap=("ip", "netns", "exec", NETNS), timeout=90)]


def all_cases() -> list[Case]:
    return charbuild_cases() + render_cases() + serve_cases() + peer_cases()


# ---------------------------------------------------------------------------------------
# fact checks (of what `during` / `post` recorded in ctx["facts"])


def fact_is(**want) -> Callable[[dict], list[str]]:
    def check(facts):
        return [f"{k} is {facts.get(k)!r}, expected {v!r}" for k, v in want.items()
                if facts.get(k) != v]
    return check


def fact_http(status: int) -> Callable[[dict], list[str]]:
    def check(facts):
        problems = []
        if facts.get("status") != status:
            problems.append(f"HTTP status {facts.get('status')}, expected {status}")
        if not facts.get("json_error"):
            problems.append("the body is not JSON with 'error'")
        return problems
    return check


def fact_audio_s(seconds: float, tol: float) -> Callable[[dict], list[str]]:
    def check(facts):
        got = facts.get("audio_s")
        if got is None or abs(got - seconds) > tol:
            return [f"output audio is {got} s, expected {seconds} s"]
        return []
    return check


def fact_metrics_fast(limit_s: float) -> Callable[[dict], list[str]]:
    def check(facts):
        problems = []
        if not facts.get("metrics_during"):
            problems.append("no /metrics request completed while the offer was processed")
        if facts.get("metrics_max_s") is None or facts["metrics_max_s"] > limit_s:
            problems.append(f"/metrics took {facts.get('metrics_max_s')} s (limit {limit_s} s)")
        return problems
    return check


def fact_freed_within(limit_s: float) -> Callable[[dict], list[str]]:
    def check(facts):
        freed = facts.get("freed_s")
        if freed is None or freed > limit_s:
            return [f"the slot was freed after {freed} s (limit {limit_s} s)"]
        return []
    return check


def fact_tree_gone(limit_s: float) -> Callable[[dict], list[str]]:
    def check(facts):
        gone = facts.get("tree_gone_s")
        if gone is None or gone > limit_s:
            return [f"process tree gone after {gone} s (limit {limit_s} s)"]
        if facts.get("tree_size", 0) < 3:
            return [f"only {facts.get('tree_size')} processes in the tree before SIGTERM"]
        return []
    return check


# ---------------------------------------------------------------------------------------
# set-up: shared media and engines, per-case files


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
        for i in range(0, len(x), size):
            chunk = np.ascontiguousarray(x[i:i + size], dtype=np.float32)[None]
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

    (root / "ckpt").mkdir(exist_ok=True)
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


def reap_leftovers(procs: list[psutil.Process]) -> int:
    """Processes of the case still running GRACE_S after its main process ended: killed,
    and counted."""
    deadline = time.monotonic() + GRACE_S
    while any(alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in procs if alive(p)]
    kill_all(left)
    return len(left)


# ---------------------------------------------------------------------------------------
# things a case does while its command runs


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


def hostile_request_cases(serve: list[str]) -> list[Case]:
    """What a page elsewhere, a rebinding or a careless client sends to --serve: each one
    request, answered in one JSON line with a 4xx, nothing changed."""
    both = [*serve, "--health-port", "{health}"]
    evil = {"Host": "evil.example:8080"}

    def case(name, status, method, path, body, what, headers=None, port="port"):
        return Case(name, "serve", both, Expect(rc=0, facts=fact_http(status)),
                    setup=pick_ports, during=request_then_stop(method, path, body, what,
                                                               headers, port))

    return [
        case("serve-host-rebound", 403, "GET", "/status", None, "Host: evil.example", evil),
        case("serve-probe-host-rebound", 403, "GET", "/metrics", None,
             "probe port, Host: evil.example", evil, port="health"),
        case("serve-post-from-another-origin", 403, "POST", "/stop",
             lambda: b'{"session": "guess"}', "Origin: http://evil.example",
             {"Origin": "http://evil.example"}),
        case("serve-offer-as-text-plain", 415, "POST", "/offer", offer_with(),
             "Content-Type: text/plain", {"Content-Type": "text/plain"}),
        case("serve-json-nested-100000", 400, "POST", "/offer",
             lambda: b"[" * 100_000 + b"]" * 100_000, "JSON nested 100,000 deep"),
        case("serve-fit-as-a-list", 400, "POST", "/offer", offer_with(fit=["cover"]),
             "fit as a list"),
        case("serve-background-as-an-object", 400, "POST", "/offer",
             offer_with(background={"r": 1}), "background as an object"),
        case("serve-empty-speech", 400, "POST", "/offer",
             offer_with(speech="data:audio/wav;base64,"), "a 0-byte speech file"),
        case("serve-speech-at-1hz", 400, "POST", "/offer",
             offer_with(speech=wav_data_url(1, 50_000)), "100 kB WAV declaring 1 Hz"),
        case("serve-speech-601s", 400, "POST", "/offer",
             offer_with(speech=wav_data_url(8000, 8000 * 601)), "601 s of speech"),
        case("serve-stop-without-session", 400, "POST", "/stop", lambda: b"{}",
             "no session id"),
        case("serve-stop-another-session", 404, "POST", "/stop",
             lambda: b'{"session": "Zm9yZ2VkLXRva2VuLWd1ZXNz"}', "a guessed session id"),
    ]


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


def snapshot(root: Path, rels: tuple[str, ...]) -> dict[str, str]:
    """sha256 of every file under the guarded paths (paths relative to root)."""
    out = {}
    for rel in rels:
        base = root / rel
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for p in files:
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def lost_files(root: Path, before: dict[str, str]) -> list[str]:
    lost = []
    for rel, digest in before.items():
        p = root / rel
        if not p.is_file():
            lost.append(f"{rel} removed")
        elif hashlib.sha256(p.read_bytes()).hexdigest() != digest:
            lost.append(f"{rel} changed")
    return lost


def leftovers(root: Path, case: Case) -> list[str]:
    found = [f"{rel} exists" for rel in case.absent if (root / rel).exists()]
    for rel in case.leftovers:
        d = root / rel
        for pattern in LEFTOVER_GLOBS:
            found += [f"{p.relative_to(root)} left" for p in d.glob(pattern)] if d.is_dir() else []
    return found


def meaningful(line: str) -> bool:
    """A line a person would read as the command's message (rich's table, bar and title
    lines are not)."""
    s = line.strip()
    if not s or BOX_CHARS & set(s) or s.startswith("generating"):
        return False
    return not re.match(r"(\d+ steps, \d+ frames in|generated; real time is)", s)


def printed_line(stdout: str, stderr: str, pattern: str | None) -> str:
    lines = [LOG_STAMP.sub("", l) for l in stderr.splitlines()]
    if pattern:
        hits = [l for l in lines + stdout.splitlines() if re.search(pattern, l.strip())]
        if hits:
            return hits[-1].strip()
    kept = [l.strip() for l in lines if meaningful(l)]
    return kept[-1] if kept else ""


def frame_claim(text: str) -> int | None:
    hits = re.findall(r"holds (\d+) frames|wrote \S+: (\d+) frames", text)
    if not hits:
        return None
    a, b = hits[-1]
    return int(a or b)


# ---------------------------------------------------------------------------------------
# one case


def short_command(argv: list[str]) -> str:
    """The command as the table shows it: {port} as P and {health} as H (they change every
    run)."""
    return " ".join(shlex.quote(a.replace("{port}", "P").replace("{health}", "H"))
                    for a in argv)


def fill(argv: list[str], ctx: dict) -> list[str]:
    return [a.format(**ctx) if "{" in a else a for a in argv]


def execute(case: Case, root: Path, tools: dict[str, str], ctx: dict) -> dict:
    """Set up, run and supervise the command; what the row needs from the run."""
    if case.setup:
        case.setup(root, ctx)
    before = snapshot(root, case.guard)
    argv = fill(case.argv, ctx)
    running = Running([*case.wrap, *(tools.get(a, a) for a in argv)], root / case.cwd,
                      case.fsize)
    helper = None
    if case.during:
        helper = threading.Thread(target=guarded, args=(case.during, running, ctx), daemon=True)
        helper.start()
    try:
        result = supervise(running, case.timeout)
    finally:
        if running.proc.poll() is None:
            kill_all([*running.descendants(), running.ps])
    if helper:
        helper.join(15)
    result["left_running"] = reap_leftovers(result.pop("seen"))
    running.close_streams()
    ctx["stdout"], ctx["stderr"] = running.text("stdout"), running.text("stderr")
    result["lost"] = lost_files(root, before)
    result["leftovers"] = leftovers(root, case)
    return result


def guarded(fn, running: Running, ctx: dict) -> None:
    try:
        fn(running, ctx)
    except Exception as e:  # noqa: BLE001 - a helper's failure is the row's, not the run's
        ctx["notes"].append(f"case error: {type(e).__name__}: {e}")


def output_cell(case: Case, row: dict, ctx: dict) -> str:
    parts = []
    d = ctx.get("decoded")
    if d is not None:
        if d["state"] == "plays":
            parts.append(f"plays ({d['frames']} frames)")
        else:
            parts.append(d["state"] + (f" ({d['why']})" if d.get("why") else ""))
        claim = row["claim"]
        if claim is not None and d["state"] == "plays":
            parts.append(f"claim {claim} {'matches' if claim == d['frames'] else 'DOES NOT match'}")
    parts += ctx["notes"]
    return "; ".join(parts) or "—"


def lost_cell(case: Case, row: dict) -> str:
    if not (case.guard or case.absent or case.leftovers):
        return "—"
    problems = row["lost_list"] + row["leftovers"]
    return "nothing lost" if not problems else "; ".join(problems)


def judge(case: Case, row: dict, facts: dict) -> list[str]:
    e, problems = case.expect, []
    rc = row["exit"]
    if e.rc == "nonzero" and rc in (0, None):
        problems.append(f"exit {rc}, expected non-zero")
    elif isinstance(e.rc, tuple) and rc not in e.rc:
        problems.append(f"exit {rc}, expected one of {e.rc}")
    elif isinstance(e.rc, int) and rc != e.rc:
        problems.append(f"exit {rc}, expected {e.rc}")
    if e.plays is True and row["plays"] is not True:
        problems.append("the output does not play")
    if e.plays is False and case.out and row["decoded_state"] != "no file":
        problems.append(f"an output was written ({row['decoded_state']})")
    if e.line and not re.search(e.line, row["line"]):
        problems.append(f"line does not match /{e.line}/")
    if e.claim and row["plays"] and row["claim"] != row["frames"]:
        problems.append(f"claims {row['claim']} frames, decoded {row['frames']}")
    if e.max_s is not None and row["wall_s"] > e.max_s:
        problems.append(f"took {row['wall_s']:.1f} s (limit {e.max_s} s)")
    if e.max_mb is not None and row["peak_mb"] > e.max_mb:
        problems.append(f"peak {row['peak_mb']:.0f} MB (limit {e.max_mb} MB)")
    if e.facts:
        problems += e.facts(facts)
    if row["traceback"]:
        problems.append("traceback printed")
    if row["lost_list"] or row["leftovers"]:
        problems.append("lost or left: " + "; ".join(row["lost_list"] + row["leftovers"]))
    if row["left_running"]:
        problems.append(f"{row['left_running']} processes still running {GRACE_S:g} s after "
                        "exit (killed)")
    if row["timed_out"]:
        problems.append("timed out")
    problems += [n for n in row["notes"] if n.startswith("case error")]
    return problems


def run_case(case: Case, root: Path, tools: dict[str, str]) -> dict:
    ctx = {"root": root, "tools": tools, "notes": [], "facts": {}, "close": [], "port": 0,
           "command": short_command(case.argv), "stdout": "", "stderr": ""}
    try:
        result = execute(case, root, tools, ctx)
    except Exception as e:  # noqa: BLE001 - one case's failure must not end the run
        ctx["notes"].append(f"case error: {type(e).__name__}: {e}")
        result = {"rc": None, "wall_s": 0.0, "peak_mb": 0.0, "timed_out": False,
                  "left_running": 0, "lost": [], "leftovers": []}
    finally:
        for c in ctx["close"]:
            c.close()
    return make_row(case, root, ctx, result)


def make_row(case: Case, root: Path, ctx: dict, result: dict) -> dict:
    both = ctx["stdout"] + "\n" + ctx["stderr"]
    if case.out and result["rc"] is not None:
        ctx["decoded"] = decode(root / case.out if not case.out.startswith("/")
                                else Path(case.out))
    if case.post and result["rc"] is not None:
        guarded(lambda _, c: case.post(root, c), None, ctx)
    d = ctx.get("decoded", {})
    row = {"case": case.name, "group": case.group, "command": ctx["command"],
           "exit": result["rc"], "wall_s": round(result["wall_s"], 2),
           "line": printed_line(ctx["stdout"], ctx["stderr"], case.line)[:LINE_WIDTH],
           "traceback": "Traceback" in both, "decoded_state": d.get("state"),
           "plays": d.get("state") == "plays" if d else None, "frames": d.get("frames"),
           "audio_s": d.get("audio_s"), "claim": frame_claim(both),
           "peak_mb": round(result["peak_mb"], 1), "timed_out": result["timed_out"],
           "left_running": result["left_running"], "lost_list": result["lost"],
           "leftovers": result["leftovers"], "notes": list(ctx["notes"]),
           "facts": dict(ctx["facts"]), "should_play": case.expect.plays is True,
           "stderr_tail": ctx["stderr"].splitlines()[-25:],
           "stdout_tail": ctx["stdout"].splitlines()[-5:]}
    row["output"] = output_cell(case, row, ctx)
    row["lost"] = lost_cell(case, row)
    row["problems"] = judge(case, row, ctx["facts"])
    return row


# ---------------------------------------------------------------------------------------
# the table and the document


def cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def exit_text(rc: int | None) -> str:
    if rc is None:
        return "not run"
    if rc < 0:
        return f"{rc} = {signal.Signals(-rc).name}"
    return str(rc)


def table(rows: list[dict]) -> str:
    head = ("| case | command | exit | line printed | traceback | output | lost | peak MB |\n"
            "|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        exit_ = "killed (timeout)" if r["timed_out"] else exit_text(r["exit"])
        lines.append("| " + " | ".join([
            cell(r["case"]), f"`{cell(r['command'])}`", f"{cell(exit_)} ({r['wall_s']:.1f} s)",
            cell(r["line"]) or "—", "**yes**" if r["traceback"] else "no", cell(r["output"]),
            cell(r["lost"]), f"{r['peak_mb']:.0f}"]) + " |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    tb = sum(r["traceback"] for r in rows)
    lost = sum(bool(r["lost_list"] or r["leftovers"]) for r in rows)
    silent = sum(r["should_play"] and not r["plays"] for r in rows)
    odd = sum(bool(r["problems"]) for r in rows)
    return (f"{len(rows)} cases: {tb} with a traceback, {lost} that lost or left something, "
            f"{silent} outputs that should play and do not; {odd} differ from what was "
            "expected.")


def section(rows: list[dict], seconds: float) -> str:
    return (f"{BEGIN}\n_Generated by `{REGENERATE}` in {seconds:.0f} s; exit shows the code "
            "and the wall time._\n\n" + table(rows) + "\n\n" + summary(rows) + f"\n{END}")


INTRO = f"""# Reliability

The goal: whatever a user gives charbuild or charrun (a wrong path, a damaged file, odd
media, a full disk, a signal at any moment), and whatever reaches `--serve` (a careless
client, a page elsewhere in the user's browser), the tools answer with one line and no
traceback, nothing the user had is lost, no temporary file outlives the next run, and every
output that should play plays and holds what the command says it holds. Regenerate both
tables below with

```
{REGENERATE}
```

## The fault matrix

Each row runs the real command against freshly built tiny engines on the CPU: charbuild's
and charrun's command-line faults (a file-size limit stands in for a full disk: the same
EFBIG a write meets; `setpriv` drops root's right to read others' files, as the container's
user lacks it), and `--serve` met by one request each: a host name it does not answer to
(DNS rebinding), a POST from another origin, a body that is not JSON, malformed fields,
speech that would decode to gigabytes, uploads past the in-flight caps, control requests
naming no session or another's, a TP rank killed while idle, and a WebRTC client killed
mid-session (inside a network namespace of the run's own, where root can make one). What
the server checks and why: `docs/DEPLOY.md` ("Who may use the server").

"""


def write_doc(path: Path, rows: list[dict], seconds: float, hostile: str | None) -> None:
    text = path.read_text() if path.exists() else INTRO
    text = replace_block(text, BEGIN, END, section(rows, seconds))
    if hostile is not None:
        text = replace_block(text, HOSTILE_BEGIN, HOSTILE_END, hostile)
    path.write_text(text)


def replace_block(text: str, begin: str, end: str, block: str) -> str:
    """`text` with the part between the markers replaced by `block` (which holds them), or
    `block` added at its end."""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        return head + block + rest.split(end, 1)[1]
    return text.rstrip("\n") + "\n\n" + block + "\n"


# ---------------------------------------------------------------------------------------
# pages of other origins against a live session, in real Chromium


def hostile_pages(root: Path, tools: dict[str, str]) -> tuple[dict, dict] | None:
    """A session streaming to a WebRTC client while Chromium opens pages of other origins
    and a rebound page (tests/hostile_page.py), inside the run's namespace: (what the
    attackers saw, the server's /status after); None where Chromium or playwright is
    missing."""
    chromium = shutil.which("chromium")
    try:
        import playwright  # noqa: F401
    except ImportError:
        return None
    if chromium is None:
        return None
    port, health = free_port(), free_port()
    url = f"http://127.0.0.1:{port}/"
    server = Running(in_netns(tools["charrun"], "--engine", "cpu-tiny", "--serve", "--port",
                              str(port), "--health-port", str(health)), root)
    try:
        if not server.wait_for("serving on", "stdout", timeout=60):
            raise RuntimeError("the server did not start: " + server.text("stderr")[-300:])
        victim = subprocess.Popen(in_netns(sys.executable, str(REPO / "tests/webrtc_client.py"),
                                           "--url", url, "--seconds", "120"),
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            for ln in iter(victim.stdout.readline, ""):
                if json.loads(ln)["kind"] == "streaming":
                    break
            r = subprocess.run(in_netns(sys.executable, str(REPO / "tests/hostile_page.py"),
                                        "--url", url, "--health", str(health), "--chromium",
                                        chromium), capture_output=True, text=True, timeout=180)
            attacks = json.loads(r.stdout.strip().splitlines()[-1])
            status = json.loads(subprocess.run(in_netns(sys.executable, "-c",
                "import urllib.request, sys; print(urllib.request.urlopen(sys.argv[1])"
                ".read().decode())", url + "status"), capture_output=True, text=True).stdout)
            status["victim_connected"] = victim.poll() is None
        finally:
            victim.kill()
            victim.wait(10)
        return attacks, status
    finally:
        server.signal(signal.SIGTERM)
        server.proc.wait(30)
        server.close_streams()


def hostile_section(found: tuple[dict, dict] | None) -> str:
    if found is None:
        return (f"{HOSTILE_BEGIN}\n_Not run here: needs root (a network namespace), Debian's "
                f"chromium and playwright._\n{HOSTILE_END}")
    attacks, status = found
    lines = ["| page | what it tried | what the page could read |", "|---|---|---|"]
    names = {"cross_site": "another origin (localhost:9666)",
             "rebound": "evil.example re-pointed at the server's page port",
             "rebound_probes": "evil.example re-pointed at the probe port"}
    for key, label in names.items():
        for what, got in attacks["page"].get(key, {}).items():
            lines.append(f"| {label} | {cell(what)} | {cell(got[:150])} |")
    answers = ["| request that reached the server | its answers |", "|---|---|"]
    for request, codes in sorted(attacks["server"].items()):
        answers.append(f"| `{cell(request)}` | {', '.join(map(str, codes))} |")
    ok = all(c in (403, 405, 415) for codes in attacks["server"].values() for c in codes)
    verdict = (f"The victim's session after: /status reads {status['state']!r}, "
               f"{status['sessions']} session(s) started, its client "
               f"{'still connected' if status['victim_connected'] else 'DISCONNECTED'}; "
               + ("every request that reached the server was refused."
                  if ok else "SOME REQUEST WAS ANSWERED."))
    return (f"{HOSTILE_BEGIN}\n_Generated by `{REGENERATE}` (tests/hostile_page.py in headless "
            "Chromium, with the browser's own local-network checks off, so that the server's "
            "checks are what is shown)._\n\n" + "\n".join(lines) + "\n\n" +
            "\n".join(answers) + "\n\n" + verdict + f"\n{HOSTILE_END}")


# ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def namespace_of_the_run():
    """The run's network namespace (NETNS), for the cases with a WebRTC peer."""
    with namespace(NETNS.rstrip("0123456789"), NETNS_SUBNET) as name:
        assert name == NETNS, (name, NETNS)
        yield name


def find_tools() -> dict[str, str]:
    tools = {}
    for name in ("charbuild", "charrun"):
        here = Path(sys.executable).parent / name
        found = str(here) if here.exists() else shutil.which(name)
        if not found:
            raise SystemExit(f"fault_matrix: {name} not found beside {sys.executable} or on PATH")
        tools[name] = found
    return tools


def progress(i: int, n: int, row: dict) -> None:
    verdict = "ok" if not row["problems"] else "UNEXPECTED: " + "; ".join(row["problems"])
    print(f"[{i:2d}/{n}] {row['case']:<36} exit {row['exit']!s:>4} {row['wall_s']:5.1f} s "
          f"{row['peak_mb']:6.0f} MB  {verdict}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--doc", type=Path, default=DOC,
                   help="Markdown file whose fault-matrix section is replaced "
                        "(default: %(default)s)")
    p.add_argument("--no-doc", action="store_true", help="write no Markdown")
    p.add_argument("--json", type=Path, help="also write the raw results as JSON here")
    p.add_argument("--only", help="run only the cases whose name matches this regex (the "
                                  "document is then not written)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cases = [c for c in all_cases() if not args.only or re.search(args.only, c.name)]
    if args.list:
        print("\n".join(f"{c.group:<9} {c.name}" for c in cases))
        return 0
    tools = find_tools()
    t0 = time.monotonic()
    rows, hostile = [], None
    with tempfile.TemporaryDirectory(prefix="fault-matrix-") as tmp, \
            (namespace_of_the_run() if can_netns() else contextlib.nullcontext()):
        root = Path(tmp)
        print(f"fault_matrix: media and engines in {root} ...", file=sys.stderr, flush=True)
        make_shared(root, tools)
        for i, case in enumerate(cases, 1):
            rows.append(run_case(case, root, tools))
            progress(i, len(cases), rows[-1])
        if not args.only and can_netns():
            print("fault_matrix: pages of other origins against a live session ...",
                  file=sys.stderr, flush=True)
            hostile = hostile_section(hostile_pages(root, tools))
    seconds = time.monotonic() - t0
    print(f"fault_matrix: {summary(rows)} ({seconds:.0f} s)", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({"seconds": round(seconds, 1), "rows": rows}, indent=2))
    if args.only and not args.no_doc:
        print("fault_matrix: --only: the document is left as it is", file=sys.stderr)
    elif not args.no_doc:
        write_doc(args.doc, rows, seconds, hostile)
        print(f"fault_matrix: wrote {args.doc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
