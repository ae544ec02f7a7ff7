"""charrun: load an engine (checked against this machine) and run a session from a reference
image and speech into an MP4, or serve sessions (--serve, --livekit) with probes for an
orchestrator (runtime/probes.py) and a drain on SIGTERM (runtime/lifecycle.py)."""

from __future__ import annotations

import importlib.util
import signal
import socket
import statistics
import sys
import time
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


from ..paths import PathOption
from .access import Access, AccessError
from .formats import (AUDIO_FORMATS_SAID, DEFAULT_BACKGROUND, FIT_POLICIES, IMAGE_FORMATS,
                      MAX_IMAGE_PIXELS, MAX_PROMPT_CHARS, VIDEO_SUFFIXES, ImageFit,
                      prompt_problem)
from .lifecycle import GRACE_PERIOD_S, STOP_SIGNALS
from .prefetch import readahead_in_background
from .probes import HEALTH_PORT
from .run_config import AUTO, IDLE_TIMEOUT_S, RunConfig, livekit_setup_error

if TYPE_CHECKING:  # torch is imported when an engine is loaded, after the probes answer
    from .engine import Engine


MAX_SEED = 2**63 - 1  # the largest seed torch.Generator takes
MAX_SESSIONS = 64  # a bound on --sessions: each holds its own caches on the device


class SessionsParam(click.ParamType):
    """--sessions: a count from 1 to MAX_SESSIONS, or AUTO."""

    name = "N|auto"

    def convert(self, value, param, ctx):
        if value == AUTO or isinstance(value, int):
            return value
        try:
            n = int(value)
        except ValueError:
            self.fail(f"{value!r} is not a count of sessions or {AUTO!r}", param, ctx)
        if not 1 <= n <= MAX_SESSIONS:
            self.fail(f"{n} is not between 1 and {MAX_SESSIONS}", param, ctx)
        return n


def percentiles(ms: list[float]) -> dict[str, float]:
    if not ms:
        return {}
    qs = statistics.quantiles(ms, n=100, method="inclusive") if len(ms) > 1 else [ms[0]] * 99
    return {"p50": qs[49], "p90": qs[89], "p99": qs[98], "max": max(ms)}


def summary_table(times, steps_done: int, frames: int, wall_s: float, fps: int):
    t = Table(title=f"{steps_done} steps, {frames} frames in "
                    f"{wall_s:.2f} s ({frames / max(wall_s, 1e-9):.1f} fps "
                    f"generated; real time is {fps})")
    t.add_column("ms per step")
    for c in ("p50", "p90", "p99", "max"):
        t.add_column(c, justify="right")
    # each part's busy time (GPU time on a GPU); the period between steps' frames leaving
    # the decoder, which waits for its work, on the host's clock
    ends = [e for _, e in times.decode]
    rows = {"audio encoder": [1e3 * s for s in times.busy_s("audio")],
            "diffusion": [1e3 * s for s in times.busy_s("diffusion")],
            "decoder": [1e3 * s for s in times.busy_s("decode")],
            "period": [1e3 * (b - a) for a, b in zip(ends, ends[1:])]}
    for name, ms in rows.items():
        p = percentiles(ms)
        if p:
            t.add_row(name, *(f"{p[c]:.1f}" for c in ("p50", "p90", "p99", "max")))
    return t


def ready_check(cfg: RunConfig) -> None:
    """--check: load the engine, get ready, report what it took and exit."""
    from .distributed import RankFailure
    from .engine import Engine, EngineError

    t0 = time.perf_counter()
    try:
        engine = Engine.load(cfg.engine_dir, verify_in_background=True)
        t1 = time.perf_counter()
        from .distributed import open_worker

        worker = open_worker(engine, cfg.sessions, cfg.over_capacity, cfg.batch)
    except (EngineError, RankFailure) as e:
        raise click.ClickException(str(e)) from None
    total = time.perf_counter() - t0
    startup = getattr(worker, "startup", {})
    compiles = getattr(worker, "compiles", 0)
    worker.close()
    parts = [f"engine checked in {t1 - t0:.2f} s"]
    if startup:
        parts.append(f"weights loaded in {startup['load_s']:.2f} s")
    if startup.get("warm_up_steps"):
        parts.append(f"{startup['warm_up_steps']}-step warm-up and graph capture in "
                     f"{startup['warm_up_s']:.2f} s")
    click.echo(f"ready in {total:.2f} s ({', '.join(parts)}); {compiles} kernels compiled "
               "at start")
    capacity = getattr(worker, "capacity", None)
    if capacity is not None:  # --check --sessions N or auto: what the machine holds
        click.echo(f"sessions: {len(worker.lanes)}; {capacity.describe()}")


class Stop:
    """SIGINT, SIGTERM and SIGHUP (what `docker stop` and `timeout` send, and a closed
    terminal) while a render runs: the
    first takes effect between steps, so the MP4 holds whole steps with their audio; a
    second, or one before any step could be kept, stops at once. `on_signal(sig)` is told of
    each first (a serving charrun's drain starts its grace period there: should the
    KeyboardInterrupt be lost in code that swallows it, the drain still stops charrun)."""

    def __init__(self, on_signal=None):
        self.signum: int | None = None
        self.generating = False
        # a render's stop is on its way out (its KeyboardInterrupt raised): a later signal
        # changes nothing, so that the pipeline's stages stop and the MP4 closes unhindered
        # (one landing in their midst lost the file, or aborted the process at exit)
        self.stopping = False
        self.on_signal = on_signal
        for sig in STOP_SIGNALS:
            signal.signal(sig, self)

    def __call__(self, signum, _frame):
        if self.stopping:
            return
        if self.on_signal is not None and self.signum is None:
            self.on_signal(signal.Signals(signum))
        if self.signum is not None or not self.generating:
            self.signum = self.signum or signum
            if self.generating:
                self.interrupt()
            raise KeyboardInterrupt
        self.signum = signum

    def interrupt(self) -> None:
        """Stop the render now (between steps, or on a second signal at once)."""
        self.stopping = True
        raise KeyboardInterrupt

    def done(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum or signal.SIGINT).name

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)


def check_port(host: str, port: int) -> None:
    """Refuse a port this process cannot listen on, before the engine loads."""
    try:
        socket.create_server((host, port)).close()
    except OSError as e:
        raise click.ClickException(f"--port {port}: cannot listen on {host}:{port} "
                                   f"({e.strerror or e}); choose another port or stop what "
                                   "uses it") from None


def side_networks_note(engine: Engine) -> str | None:
    """A warning line where the engine's side networks (or weights) are random."""
    m = engine.manifest
    side, weights = m.get("side_networks"), m.get("weights") or {}
    parts = []
    if isinstance(weights, dict) and "random_seed" in weights:
        parts.append(f"its weights are random (seed {weights['random_seed']})")
    if isinstance(side, str) and side != "checkpoint":
        parts.append(f"its side networks (audio encoder, decoder, image and text encoders) are "
                     f"{side}")
    if not parts:
        return None
    return (f"charrun: engine {engine.target.name}: {' and '.join(parts)}; the frames are not "
            "a trained model's")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--engine", "engine_dir", type=PathOption(), required=True,
              help="Engine directory written by charbuild.")
@click.option("--image", type=PathOption(),
              help=f"Reference image of the character ({', '.join(IMAGE_FORMATS)}; at most "
                   f"{MAX_IMAGE_PIXELS // 1_000_000} megapixels).")
@click.option("--fit", type=click.Choice(list(FIT_POLICIES)), default="cover", show_default=True,
              help="How an image of another shape is fitted to the model's frame: "
                   + "; ".join(f"{k}: {v}" for k, v in FIT_POLICIES.items()) + ".")
@click.option("--background", default=DEFAULT_BACKGROUND, show_default=True,
              help="Colour that transparent pixels (and contain's margins) are laid on.")
@click.option("--audio", "audio_path", type=PathOption(),
              help=f"Speech ({AUDIO_FORMATS_SAID}; at any rate, converted to 16 kHz "
                   "mono).")
@click.option("--out", type=PathOption(),
              help=f"Video to write ({', '.join(VIDEO_SUFFIXES)}).")
@click.option("--prompt", default="",
              help=f"Text prompt (at most {MAX_PROMPT_CHARS:,} characters).")
@click.option("--seed", type=click.IntRange(0, MAX_SEED), default=0, show_default=True,
              help="Noise seed.")
@click.option("--serve", is_flag=True, help="Serve a local page that streams over WebRTC.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address the page and the probe server listen on (0.0.0.0 in a container).")
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True)
@click.option("--ice-server", "ice_servers", multiple=True,
              help="STUN/TURN URL for WebRTC (none by default: loopback and LAN only).")
@click.option("--slack", type=click.IntRange(min=1), default=2, show_default=True,
              help="Finished steps that may queue ahead of playback (at least 1).")
@click.option("--livekit", is_flag=True,
              help="Run a LiveKit avatar worker (needs charengine[livekit] and LIVEKIT_URL, "
                   "LIVEKIT_API_KEY, LIVEKIT_API_SECRET).")
@click.option("--agent-name", default="charengine-avatar", show_default=True,
              help="LiveKit agent name the worker registers for explicit dispatch.")
@click.option("--health-port", type=click.IntRange(1, 65535), default=HEALTH_PORT,
              show_default=True,
              help="With --serve or --livekit: the probe server's port (on --host): GET "
                   "/healthz (alive), /readyz (200 only when a session can start; 503 with "
                   "the state: loading, busy, draining, failed) and /metrics.")
@click.option("--grace-period", type=click.FloatRange(min=0, min_open=True),
              default=GRACE_PERIOD_S, show_default=True,
              help="With --serve or --livekit: seconds SIGTERM's drain may take. The session "
                   "in progress goes on until shortly before, then ends cleanly, the ranks "
                   "stop and charrun exits 0; past it charrun gives up and exits 1 at once.")
@click.option("--idle-timeout", type=click.FloatRange(min=0), default=IDLE_TIMEOUT_S,
              show_default=True,
              help="With --serve: seconds a session's character may only listen (nothing "
                   "said to it, by upload, microphone or client) before the session ends and "
                   "frees its place; 0: never.")
@click.option("--allow-host", "allow_hosts", multiple=True,
              help="With --serve or --livekit: a host name the ports answer to besides IP "
                   "addresses and localhost (the name users open the page by, behind a "
                   "proxy); '*' for any. Requests naming another host are refused (DNS "
                   "rebinding).")
@click.option("--allow-origin", "allow_origins", multiple=True,
              help="With --serve: an origin (https://chars.example.com) whose pages may start "
                   "and control sessions besides the page's own, e.g. your own front end.")
@click.option("--sessions", type=SessionsParam(), default="1", show_default=True,
              help="With --serve or --livekit: live sessions served at once over one copy of "
                   "the engine "
                   "(each with its own caches, decoder state, speech and pacing; their steps "
                   "take turns on the device, earliest deadline first). More than one is "
                   "checked at start against what this machine holds in real time (a number "
                   "it cannot hold is refused); 'auto' takes that number. An offer past "
                   "them gets 503 with Retry-After (a LiveKit worker reports its load as "
                   "sessions / N), and /readyz reads busy.")
@click.option("--over-capacity", is_flag=True,
              help="With --sessions: serve that many even where this machine holds fewer in "
                   "real time (they play below real time while all are busy).")
@click.option("--batch", type=click.IntRange(1, MAX_SESSIONS), default=1, show_default=True,
              help="With --sessions: the most sessions whose steps run as one batch when "
                   "they wait for the device together (their tokens stacked through every "
                   "GEMM, each attending over its own cache; a session's frames equal its "
                   "frames alone up to the GEMMs' roundings). 1: every step alone.")
@click.option("--check", is_flag=True,
              help="Load the engine and get ready (kernels loaded, warm-up, step graphs "
                   "captured), report what it took and how many kernels had to be compiled, "
                   "and exit.")
def main(engine_dir, image, fit, background, audio_path, out, prompt, seed, serve, host, port,
         ice_servers, slack, livekit, agent_name, health_port, grace_period, idle_timeout,
         allow_hosts, allow_origins, sessions, over_capacity, batch, check):
    """Render a talking character (the image animated to the speech, H.264 + AAC MP4), or
    with --serve stream one over WebRTC to a local page."""
    return run(RunConfig(engine_dir, image=image, fit=fit, background=background,
                         audio=audio_path, out=out, prompt=prompt, seed=seed, serve=serve,
                         host=host, port=port, ice_servers=ice_servers, slack=slack,
                         livekit=livekit, agent_name=agent_name, check=check,
                         health_port=health_port, grace_period=grace_period,
                         idle_timeout=idle_timeout,
                         allow_hosts=allow_hosts, allow_origins=allow_origins,
                         sessions=sessions, over_capacity=over_capacity, batch=batch))


def run(cfg: RunConfig):
    """Run the mode `cfg` selects (RunConfig.mode); bad input ends in one line. Once the
    input is checked, the engine's files are read into the page cache in the background
    (runtime/prefetch.py) while torch is imported."""
    if (why := prompt_problem(cfg.prompt)) is not None:
        raise click.BadParameter(why, param_hint="'--prompt'")
    if cfg.sessions != AUTO and cfg.batch > cfg.sessions:
        raise click.UsageError(f"--batch {cfg.batch} is more than the {cfg.sessions} "
                               "session(s) of --sessions")
    if cfg.mode == "check":
        readahead_in_background(cfg.engine_dir)
        return ready_check(cfg)
    image_fit = image_fit_of(cfg)
    if cfg.mode in ("serve", "livekit"):
        access = access_of(cfg)
        if cfg.serve:
            check_port(cfg.host, cfg.port)
        readahead_in_background(cfg.engine_dir)
        return serve_live(cfg, image_fit, access)
    from .media import MediaError, check_video_out

    if not (cfg.image and cfg.audio and cfg.out):
        raise click.UsageError("give --image, --audio and --out, or --serve, or --livekit")
    try:
        check_video_out(cfg.out, {"--audio": cfg.audio, "--image": cfg.image})
    except MediaError as e:
        raise click.ClickException(str(e)) from None
    readahead_in_background(cfg.engine_dir)
    render_file(cfg, image_fit)


def access_of(cfg: RunConfig) -> Access:
    """--allow-host and --allow-origin, checked (one line for one that does not parse)."""
    try:
        return Access(cfg.allow_hosts, cfg.allow_origins)
    except AccessError as e:
        raise click.UsageError(str(e)) from None


def image_fit_of(cfg: RunConfig) -> ImageFit:
    from .formats import MediaError

    try:
        return ImageFit(cfg.fit, cfg.background)
    except MediaError as e:
        raise click.BadParameter(str(e), param_hint="--background") from None


def serve_live(cfg: RunConfig, image_fit: ImageFit, access: Access):
    """--serve or --livekit: one engine, --sessions at a time, until SIGINT or SIGTERM. The
    probe server answers from before the engine loads (/readyz: loading, then ready once a
    session can start); SIGTERM drains within --grace-period (runtime/lifecycle.py), then
    every rank process stops and charrun exits 0."""
    from .lifecycle import Drain, signals_held
    from .probes import ProbeError, ProbeServer, Readiness

    if cfg.livekit:
        if importlib.util.find_spec("livekit") is None \
                or importlib.util.find_spec("livekit.agents") is None:
            raise click.ClickException("--livekit needs the livekit extra: pip install "
                                       "'charengine[livekit]'")
        if livekit_setup_error():
            raise click.ClickException(livekit_setup_error())
    elif cfg.health_port == cfg.port:
        raise click.BadParameter(f"{cfg.health_port} is --port's too; give the probe server "
                                 "a port of its own", param_hint="--health-port")
    readiness = Readiness()
    try:
        with signals_held():  # the probe server's threads never take SIGINT or SIGTERM
            probes = ProbeServer(readiness, cfg.host, cfg.health_port, access=access).start()
    except ProbeError as e:
        raise click.ClickException(str(e)) from None
    print(f"charrun: probes on {probes.url}/healthz, /readyz and /metrics", flush=True)
    try:
        return _serve_engine(cfg, image_fit, readiness, probes, Drain(cfg.grace_period),
                             access)
    finally:
        probes.stop()


def _serve_engine(cfg: RunConfig, image_fit: ImageFit, readiness, probes, drain,
                  access: Access):
    """serve_live's engine: loaded (SIGTERM meanwhile stops at once, exit 0), then the mode,
    then its ranks stopped."""
    from .lifecycle import signals_held

    # a signal while the engine loads stops the load at once
    stop = Stop(on_signal=lambda sig: drain.begin(sig.name, now=sig == signal.SIGINT))
    try:
        with signals_held():  # torch's import, cut short, would go on without NumPy
            readiness.loading("loading the runtime (torch)")
            from .distributed import RankFailure, open_worker
            from .engine import Engine, EngineError
            from .garbage import freeze_start_up
            from .metrics import Metrics
        readiness.loading("checking the engine")
        engine = Engine.load(cfg.engine_dir, verify_in_background=True)
        readiness.engine = engine.target.name
        metrics = probes.metrics = Metrics(target_fps=engine.config.model.fps)
        readiness.loading("loading the weights, warm-up and graph capture")
        # TP engines: rank 0 here, one process per TP rank
        worker = open_worker(engine, cfg.sessions, cfg.over_capacity, cfg.batch)
        note = side_networks_note(engine)
        if note:
            click.echo(note, err=True)
        freeze_start_up()  # a collection after each session scans what sessions made
    except KeyboardInterrupt:
        readiness.draining(f"stopped by {stop.name} while loading")
        click.echo(f"charrun: stopped by {stop.name} while the engine loaded; no session was "
                   "in progress", err=True)
        drain.finish()
        sys.exit(0 if stop.signum == signal.SIGTERM else stop.exit_code)
    except (EngineError, RankFailure) as e:
        readiness.failed(str(e))
        raise click.ClickException(str(e)) from None
    try:
        if cfg.livekit:
            from .livekit_avatar import LiveKitSetupError, run_worker

            try:
                return run_worker(worker, cfg.agent_name, image_fit=image_fit,
                                  readiness=readiness, metrics=metrics, drain=drain,
                                  host=cfg.host)
            except LiveKitSetupError as e:
                raise click.ClickException(str(e)) from None
        from .server import ServeError, serve as run_server

        readiness.loading("starting the page")
        try:
            return run_server(worker, cfg.host, cfg.port, list(cfg.ice_servers), cfg.slack,
                              image_fit, readiness=readiness, metrics=metrics, drain=drain,
                              access=access, idle_timeout_s=cfg.idle_timeout)
        except ServeError as e:
            raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:  # a signal before the mode took over its handling
        pass
    finally:
        stop.done()  # stopping: a further signal changes nothing
        worker.close()
        drain.finish()


class StepProgress:
    """A render's progress bar on `console` (steps done, fps generated against real time)
    and its per-step callback, which writes the first frames' line and turns a stop asked
    for between steps into KeyboardInterrupt. `t0`: when the render began."""

    def __init__(self, spec, steps: int, stop: Stop, console: Console):
        self.spec, self.steps, self.stop = spec, steps, stop
        self.t0 = time.perf_counter()
        self.bar = Progress(TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[fps]:.1f} fps (real time {task.fields[rt]})"),
                            TimeElapsedColumn(), console=console)

    def __enter__(self) -> "StepProgress":
        self.bar.__enter__()
        self.task = self.bar.add_task("steps", total=self.steps, fps=0.0, rt=self.spec.fps)
        return self

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)

    def on_step(self, done: int) -> None:
        if done == 1:
            click.echo("charrun: first frames written", err=True)
        fps = done * self.spec.frames_per_latent / (time.perf_counter() - self.t0)
        self.bar.update(self.task, completed=done, fps=fps)
        if self.stop.signum is not None:
            self.stop.interrupt()


def open_render(cfg: RunConfig, image_fit: ImageFit, stop: Stop):
    """The engine's worker, its model spec, the speech and the fitted image of a render; one
    line (and exit) for bad input or a stop before any step."""
    from .images import load_image
    from .media import MediaError, read_audio

    warn = lambda line: click.echo(f"charrun: warning: {line}", err=True)  # noqa: E731
    try:
        from .distributed import RankFailure, open_worker
        from .engine import Engine, EngineError

        engine = Engine.load(cfg.engine_dir, verify_in_background=True)
        spec = engine.config.model
        speech = read_audio(cfg.audio, spec.side.sample_rate, warn=warn)
        picture = load_image(cfg.image, spec.out_h, spec.out_w, image_fit)
        worker = open_worker(engine)
        note = side_networks_note(engine)
        if note:
            click.echo(note, err=True)
        click.echo(f"charrun: {cfg.image}: {picture.describe()}", err=True)
    except KeyboardInterrupt:
        click.echo(f"charrun: stopped by {stop.name} before any step; {cfg.out} was not "
                   "written", err=True)
        sys.exit(stop.exit_code)
    except (EngineError, MediaError, RankFailure) as e:
        raise click.ClickException(str(e)) from None
    return worker, spec, speech, picture


def holds(cfg: RunConfig, result) -> str:
    """What the render's output holds, as the file on disk is, for the line that ends it."""
    if result.error is not None:
        return (f"{cfg.out} could not be written ({result.error}): free space there and run "
                "again; a file that was there before is as it was")
    if not result.written:
        return f"{cfg.out} was not written (no frames were made)"
    return f"{cfg.out} holds {result.frames} frames"


def render_file(cfg: RunConfig, image_fit: ImageFit) -> None:
    from .render import Rendered, render

    err = Console(stderr=True)
    stop = Stop()
    worker, spec, speech, picture = open_render(cfg, image_fit, stop)
    progress = StepProgress(spec, worker.family.steps_for(spec, speech.numel()), stop, err)
    result = Rendered()
    try:
        with progress:
            stop.generating = True
            render(worker, picture.pixels, cfg.prompt, speech, cfg.out, cfg.seed,
                   progress.on_step, result)
            stop.generating = False
    except KeyboardInterrupt:
        stop.done()  # the file is closed: further signals change nothing
        worker.close()
        click.echo(f"charrun: stopped by {stop.name} after {result.steps} steps; "
                   f"{holds(cfg, result)}", err=True)
        sys.exit(stop.exit_code)
    except Exception as e:  # noqa: BLE001 - one line, and the MP4 so far is kept
        worker.close()
        if result.error is not None:  # the file, not the session, failed
            raise click.ClickException(f"stopped after {result.steps} steps: "
                                       f"{holds(cfg, result)}") from None
        raise click.ClickException(f"session failed after {result.steps} steps "
                                   f"({type(e).__name__}: {e}); {holds(cfg, result)}") from None
    worker.close()
    if not result.written:  # the file could not be finished (its last write found no room)
        raise click.ClickException(holds(cfg, result))
    wall = time.perf_counter() - progress.t0
    err.print(summary_table(result.times, result.steps, result.frames, wall, spec.fps))
    click.echo(f"wrote {cfg.out}: {result.frames} frames at {spec.fps} fps with audio")


if __name__ == "__main__":
    main()
