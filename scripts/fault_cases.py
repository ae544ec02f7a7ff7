"""The fault matrix's cases as data (scripts/fault_matrix.py runs them): each a real command
(charbuild, charrun render, charrun --serve) against a fault, with what it should do.
Adding a fault is adding a `Case` here; its files and actions are fault_fixtures.py's."""


from __future__ import annotations

import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from charengine.runtime.client_bounds import ALLOWANCES  # noqa: E402
from charengine.runtime.probes import MAX_CONNECTIONS  # noqa: E402
from netns import can_netns  # noqa: E402 - the tests' namespaces, shared
from offers import offer_of_sections, wav_data_url  # noqa: E402 - and their requests
from fault_fixtures import (NETNS, NO_READ_OVERRIDE, can_drop_read_override,  # noqa: E402
    check_audio_duration, check_engine, check_not_ran, check_not_served, check_readable,
    check_replaced, check_steps, client_floods, client_vanishes, engine_copy, flip_rank_byte,
    hold_port, kill_rank_on, killed_build, killed_render, make_evil_vae, make_existing_video,
    make_existing_video_at, make_foreign_lora, make_here, make_missing_shard, make_nan_ckpt,
    make_noside_ckpt, make_old_engine, make_out_dir, make_project, make_shape_ckpt,
    make_text_ckpt, make_user_dir, make_user_file, manifest_dim_string, manifest_list,
    metrics_during_offer,
    offer_then_stop, offer_with, pick_big_offer, pick_port, pick_ports, private_rank_file,
    probe_idle_connections,
    rank_dies_idle, render_argv, request_then_stop, Running, second_build_meanwhile,
    signal_after_s, signal_on, sigterm_served_tree, sigterm_when_staging,
    uploads_in_flight, version_string)


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
        Case("build-shard-missing", "charbuild",
             [*build, "--weights", "ckpt/shards", "--out", "e-shards"],
             refused(r"shard 'model-00002-of-00002\.safetensors' is missing"),
             setup=make_missing_shard, guard=("ckpt",), absent=("e-shards",),
             leftovers=(".",)),
        Case("build-lora-other-base", "charbuild",
             [*build, "--weights", "ckpt/base.safetensors", "--lora",
              "ckpt/foreign-lora.safetensors", "--out", "e-lora"],
             refused(r"a LoRA for another base"), setup=make_foreign_lora, guard=("ckpt",),
             absent=("e-lora",), leftovers=(".",)),
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
        render("render-au-speech", refused(r"not an audio file in a format read here"),
               audio="speech.au"),
        render("render-adpcm-wav", refused(r"adpcm_ms codec, which is not read here"),
               audio="adpcm.wav"),
        render("render-speech-from-dev-zero", refused(r"not a regular file"),
               audio="/dev/zero"),
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
        Case("serve-sessions-0", "serve", [*serve, "--sessions", "0"],
             Expect(rc=2, line=r"'--sessions'", facts=fact_is(served=False)),
             setup=pick_port, post=check_not_served),
        Case("serve-sessions-past-what-the-machine-holds", "serve",
             [*serve, "--sessions", "64"],
             Expect(rc=1, line=r"holds \d+ real-time session", facts=fact_is(served=False)),
             setup=pick_port, post=check_not_served, timeout=120),
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
    peer = dict(setup=pick_port, wrap=("ip", "netns", "exec", NETNS), timeout=90)
    ended = lambda why: Expect(rc=0, facts=fact_is(why=why, ready_again=True))  # noqa: E731
    return [Case("serve-client-vanishes", "serve", serve,
                 Expect(rc=0, facts=fact_freed_within(5.0)), during=client_vanishes, **peer),
            Case("serve-client-floods-its-channel", "serve", serve,
                 ended(ALLOWANCES["messages"].why()),
                 during=client_floods("messages"), **peer),
            Case("serve-client-sends-60kB-messages", "serve", serve,
                 ended(ALLOWANCES["kB"].why()),
                 during=client_floods("kB"), **peer),
            Case("serve-client-microphone-unpaced", "serve", serve,
                 ended(ALLOWANCES["audio_s"].why()),
                 during=client_floods("audio"), **peer),
            Case("serve-client-floods-ice-checks", "serve", serve,
                 ended(ALLOWANCES["ice_checks"].why()),
                 during=client_floods("stun"), **peer)]


def all_cases() -> list[Case]:
    return charbuild_cases() + render_cases() + serve_cases() + peer_cases()


# ---------------------------------------------------------------------------------------
# fact checks (of what `during` / `post` recorded in ctx["facts"])


def fact_is(**want) -> Callable[[dict], list[str]]:
    def check(facts):
        return [f"{k} is {facts.get(k)!r}, expected {v!r}" for k, v in want.items()
                if facts.get(k) != v]
    return check


def fact_at_most(**limits) -> Callable[[dict], list[str]]:
    def check(facts):
        return [f"{k} is {facts.get(k)!r}, expected at most {v!r}" for k, v in limits.items()
                if facts.get(k) is None or facts[k] > v]
    return check


def fact_all(*checks: Callable[[dict], list[str]]) -> Callable[[dict], list[str]]:
    def check(facts):
        return [problem for c in checks for problem in c(facts)]
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
        case("serve-prompt-60MB", 400, "POST", "/offer",
             offer_with(prompt="a face speaking " * 3_750_000), "a prompt of 60 MB"),
        case("serve-stop-without-session", 400, "POST", "/stop", lambda: b"{}",
             "no session id"),
        case("serve-stop-another-session", 404, "POST", "/stop",
             lambda: b'{"session": "Zm9yZ2VkLXRva2VuLWd1ZXNz"}', "a guessed session id"),
        case("serve-stop-60MB", 413, "POST", "/stop",
             lambda: b'{"session": "' + b"x" * (60 << 20) + b'"}', "a 60 MB body"),
        case("serve-offer-5000-media-sections", 400, "POST", "/offer",
             lambda: offer_of_sections(5000), "an SDP of 5,000 media sections (6 MB)"),
        Case("serve-probe-300-idle-connections", "serve", both,
             Expect(rc=0, facts=fact_all(fact_is(closed=300, healthz=200),
                                         fact_at_most(threads_added=MAX_CONNECTIONS))),
             setup=pick_ports, during=probe_idle_connections(300), timeout=90),
    ]


