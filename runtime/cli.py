"""charrun: load an engine (checked against this machine) and run a session from a reference
image and speech into an MP4."""

from __future__ import annotations

import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from charengine import audio as audio_mod

from .distributed import RankFailure
from .engine import Engine, EngineError


def percentiles(ms: list[float]) -> dict[str, float]:
    if not ms:
        return {}
    qs = statistics.quantiles(ms, n=100, method="inclusive") if len(ms) > 1 else [ms[0]] * 99
    return {"p50": qs[49], "p90": qs[89], "p99": qs[98], "max": max(ms)}


def summary_table(times, steps_done: int, wall_s: float, fps: int, frames_per_latent: int):
    t = Table(title=f"{steps_done} steps, {steps_done * frames_per_latent} frames in "
                    f"{wall_s:.2f} s ({steps_done * frames_per_latent / max(wall_s, 1e-9):.1f} fps "
                    f"generated; real time is {fps})")
    t.add_column("ms per step")
    for c in ("p50", "p90", "p99", "max"):
        t.add_column(c, justify="right")
    ends = [e for _, e in times.diffusion]
    rows = {"audio encoder": [1e3 * (e - s) for s, e in times.audio],
            "diffusion": [1e3 * (e - s) for s, e in times.diffusion],
            "decoder": [1e3 * (e - s) for s, e in times.decode],
            "period": [1e3 * (b - a) for a, b in zip(ends, ends[1:])]}
    for name, ms in rows.items():
        p = percentiles(ms)
        if p:
            t.add_row(name, *(f"{p[c]:.1f}" for c in ("p50", "p90", "p99", "max")))
    return t


def ready_check(engine_dir: Path) -> None:
    t0 = time.perf_counter()
    try:
        engine = Engine.load(engine_dir, verify_in_background=True)
        t1 = time.perf_counter()
        from .distributed import open_worker

        worker = open_worker(engine)
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


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--engine", "engine_dir", type=click.Path(path_type=Path), required=True,
              help="Engine directory written by charbuild.")
@click.option("--image", type=click.Path(path_type=Path),
              help="Reference image of the character (PNG, JPEG, ...).")
@click.option("--audio", "audio_path", type=click.Path(path_type=Path),
              help="Speech (any format and rate PyAV reads; converted to 16 kHz mono).")
@click.option("--out", type=click.Path(path_type=Path), help="MP4 to write.")
@click.option("--prompt", default="", help="Text prompt.")
@click.option("--seed", type=int, default=0, show_default=True, help="Noise seed.")
@click.option("--serve", is_flag=True, help="Serve a local page that streams over WebRTC.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to serve on.")
@click.option("--port", type=int, default=8080, show_default=True)
@click.option("--ice-server", "ice_servers", multiple=True,
              help="STUN/TURN URL for WebRTC (none by default: loopback and LAN only).")
@click.option("--slack", type=int, default=2, show_default=True,
              help="Finished steps that may queue ahead of playback.")
@click.option("--livekit", is_flag=True,
              help="Run a LiveKit avatar worker (needs charengine[livekit] and LIVEKIT_URL, "
                   "LIVEKIT_API_KEY, LIVEKIT_API_SECRET).")
@click.option("--agent-name", default="charengine-avatar", show_default=True,
              help="LiveKit agent name the worker registers for explicit dispatch.")
@click.option("--check", is_flag=True,
              help="Load the engine and get ready (kernels loaded, warm-up, step graphs "
                   "captured), report what it took and how many kernels had to be compiled, "
                   "and exit.")
def main(engine_dir, image, audio_path, out, prompt, seed, serve, host, port, ice_servers, slack,
         livekit, agent_name, check):
    """Render a talking character (the image animated to the speech, H.264 + AAC MP4), or
    with --serve stream one over WebRTC to a local page."""
    err = Console(stderr=True)
    if check:
        return ready_check(engine_dir)
    from .media import MediaError, read_audio, read_image  # PyAV: not needed by --check
    from .render import Rendered, render
    if not (serve or livekit) and not (image and audio_path and out):
        raise click.UsageError("give --image, --audio and --out, or --serve, or --livekit")
    try:
        engine = Engine.load(engine_dir, verify_in_background=True)
        spec = engine.config.model
        if serve or livekit:
            from .distributed import open_worker

            worker = open_worker(engine)  # TP engines: rank 0 here, one process per TP rank
            if livekit:
                try:
                    from .livekit_avatar import LiveKitSetupError, run_worker
                except ImportError:
                    raise click.ClickException("--livekit needs the livekit extra: pip install "
                                               "'charengine[livekit]'") from None
                try:
                    return run_worker(worker, agent_name)
                except LiveKitSetupError as e:
                    raise click.ClickException(str(e)) from None
            from .server import serve as run_server

            return run_server(worker, host, port, list(ice_servers), slack)
        speech = read_audio(audio_path, spec.side.sample_rate)
        picture = read_image(image, spec.out_h, spec.out_w)
        from .distributed import open_worker

        worker = open_worker(engine)
    except (EngineError, MediaError, RankFailure) as e:
        raise click.ClickException(str(e)) from None

    steps = audio_mod.steps_for(spec, speech.numel())
    t0 = time.perf_counter()
    progress = Progress(TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[fps]:.1f} fps (real time {task.fields[rt]})"),
                        TimeElapsedColumn(), console=err)

    # Ctrl-C takes effect between steps, so the MP4 always holds whole steps with their audio;
    # a second Ctrl-C stops at once.
    interrupt = threading.Event()

    def on_sigint(*_):
        if interrupt.is_set():
            raise KeyboardInterrupt
        interrupt.set()

    signal.signal(signal.SIGINT, on_sigint)

    def on_step(done):
        if done == 1:
            click.echo("charrun: first frames written", err=True)
        fps = done * spec.frames_per_latent / (time.perf_counter() - t0)
        progress.update(task, completed=done, fps=fps)
        if interrupt.is_set():
            raise KeyboardInterrupt

    result = Rendered()
    try:
        with progress:
            task = progress.add_task("steps", total=steps, fps=0.0, rt=spec.fps)
            render(worker, picture, prompt, speech, out, seed, on_step, result)
    except KeyboardInterrupt:
        worker.close()
        frames = result.steps * spec.frames_per_latent
        click.echo(f"charrun: interrupted after {result.steps} steps; {out} holds {frames} "
                   "frames", err=True)
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - one line, and the MP4 so far is kept
        worker.close()
        frames = result.steps * spec.frames_per_latent
        raise click.ClickException(f"session failed after {result.steps} steps "
                                   f"({type(e).__name__}: {e}); {out} holds {frames} frames") from None
    worker.close()
    wall = time.perf_counter() - t0
    err.print(summary_table(result.times, result.steps, wall, spec.fps, spec.frames_per_latent))
    click.echo(f"wrote {out}: {result.steps * spec.frames_per_latent} frames at {spec.fps} fps "
               "with audio")


if __name__ == "__main__":
    main()
