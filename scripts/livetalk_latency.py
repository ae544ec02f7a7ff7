"""LiveTalk's live latency, paced, as charrun's live session runs it (runtime/live.py's
LiveSession over runtime/worker.py's Worker and an engine loaded by runtime/engine.py).

Speech arrives in real time in 20 ms frames (a speech-like synthetic signal, or --audio
looped), pushed into the session by a feeder thread the way the server's microphone track
pushes it; the session's pipeline encodes, denoises and decodes each chunk, and its pacer
plays the frames at the model's 16 fps to a sink (the publish callback the server hands to
WebRTC). What is measured, all on the pacer's clock (time.monotonic):

  latency (per chunk)   the time from the arrival of a chunk's last audio frame to the
                        chunk's first video frame at the sink. A chunk's audio is what its
                        step took from the session's speech buffer (SpeechBuffer.take: the
                        samples its frames play and the encoder's lookahead past them, the
                        rest silence); its last audio frame is the 20 ms frame holding the
                        last of those samples, the arrival that the chunk's computation
                        could start after. A chunk that took no speech has no latency.
  first_frames_s        from session start (the first audio frame, pushed as the session
                        is started: the reference image and prompt are encoded in it) to the
                        first video frame at the sink.
  speech_latency        runtime/metrics.py's own figure, kept whole: speech that reached an
                        empty buffer to the frame that plays that sample (what /metrics and
                        the page show). It is later than `latency` by the time from that
                        sample's arrival to the take, plus the lookahead, plus the sample's
                        place in the chunk, so it is reported beside it, not as it.
  ready_s               Engine.load through the Worker's load and warm-up, in this process
                        (the page cache as it is: scripts/bench_startup.py measures a cold
                        start).

The session runs just in time (runtime/live.py): a step takes its speech once it has
arrived or at its deadline (its play slot less the measured processing time and a margin),
and each latent's frames go to the pacer as they are decoded, so the latency is the
processing time and the margin, not queues. `take_to_first_frame_chunks_p50` says how far
ahead of its first frame a take runs, in chunks; `chunks_taken_whole` counts the takes that
found all their speech (the rest were taken at the deadline, the missing speech padded with
silence: `padded_ms`); `dropped_ms` is the leading silence dropped to bring a late phase
back (runtime/live.py). The deadlines before a session's own steps are measured
use the worker's measure of a steady step's processing time (`Worker.time_processing`, at
ready on a GPU; a CPU worker does not warm up, so here the script measures it the same way
after a short render: `processing_estimate_s`); --no-estimate leaves them the first step's.
--turn-s S feeds the speech in turns of S seconds with --pause-s seconds of nothing between
them, and --burst X has each turn arrive at X times real time, as a TTS sends a turn. Then
`turn_start` is the figure to read: from a turn's first speech arriving to the frame that
plays it (the session's own speech-latency figure for that speech, which found the buffer
empty; where a turn begins in a pause, its first loud sample, as the session drops the
silence before it). `speech_latency` also counts speech arriving later in a turn, which in a burst came
ahead of its playback and waits behind the turn's earlier speech (it cannot play faster
than real time); `latency` counts from a chunk's last speech, early in a burst.
--speech-after S feeds S seconds of silent frames before the speech (a session that starts
listening); by default speech flows from the session's first moment. `first_chunk` is the
session's start (reference image and prompt) and chunk 0's stages, which set the first
frames' time. --no-just-in-time and --no-stream-decode measure the session without
each (both off: each step's speech taken when the pipeline asks for it, the chunk decoded
whole, so the take runs as far ahead of playback as the queues and the pacer's slack hold).

Per chunk the time between its last frame's arrival and its first frame at the sink is
split into the pipeline's stages (runtime/pipeline.py's StepTimes, `PARTS`): to the
audio stage's start, the take and audio encode, waiting for the diffusion, diffusion, waiting
for the decoder, decode (to the chunk's first frames: its first latent's, or the whole
chunk's where it is decoded whole), handing over to the sink, and the sink's wait in the
pacer (its backpressure and the frames queued ahead of it, then the slot). Chunks before
--warmup (default: the sink and the window filled) are run and left out. Unpaced, the same
worker runs --unpaced chunks through Worker.run (the render path) for each stage's own
time and the end-to-end `capacity_fps` (frames a second reaching the sink over the steady
chunks), and the decoder is timed on one latent of a chunk against the whole chunk.

    python scripts/livetalk_latency.py --engine /tmp/tiny-livetalk --chunks 20
    python scripts/livetalk_latency.py --engine /path/to/h200-livetalk \\
        --chunks 100   # docs/results/livetalk/latency_livetalk-1.3b_h200_<date>.json
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from charengine.runtime.engine import Engine
from charengine.runtime.live import LiveSession, SpeechBuffer, wait_until
from charengine.runtime.metrics import Metrics
from charengine.runtime.worker import Worker
from charengine.provenance import provenance

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "livetalk"
FEED_FRAME_S = 0.020  # live audio arrives in frames of 20 ms
QUANTILES = (0.5, 0.9)
SPEECH_SEED = 0
SPEECH_SECONDS = 30.0  # the synthetic speech's length (looped as long as the session runs)
UNPACED_CHUNKS = 20
DECODE_REPS = 5  # timed decodes of one latent and of a whole chunk (after one untimed)
# a chunk's time from its last audio frame to its first frame at the sink, in the order it
# passes: to the start of its step's audio stage (a few ms below zero where the frame came
# within that stage, before its take), the take and audio encode, waiting for the
# diffusion, the diffusion,
# waiting for the decoder, the decode, to the sink's call, and in the pacer
PARTS = ("to_take", "audio_encode", "wait_diffusion", "diffusion", "wait_decode", "decode",
         "to_sink", "pacer")
SESSION_MARGIN_S = 60.0  # beyond the session's own length, before giving up on its frames


def speech_signal(audio: Path | None, sample_rate: int) -> torch.Tensor:
    """The speech fed live: --audio's file (any format PyAV reads), else random formant
    syllables with pauses (tinychar/synth.py)."""
    if audio is not None:
        from charengine.runtime.media import read_audio

        return read_audio(audio, sample_rate)
    from tinychar.synth import speech

    x, _ = speech(SPEECH_SECONDS, sample_rate, np.random.default_rng(SPEECH_SEED))
    return torch.from_numpy(x).float()


@dataclass(frozen=True)
class Speaking:
    """How speech reaches the session: continuously (turn_s 0), or in turns of turn_s
    seconds, each followed by pause_s seconds in which nothing arrives, a turn's frames
    arriving at `rate` times real time (4: as a TTS sends a turn, in a burst)."""

    turn_s: float = 0.0
    pause_s: float = 0.0
    rate: float = 1.0

    def tag(self) -> str:
        """The result file's suffix for this way of speaking ('' for continuous speech)."""
        if not self.turn_s:
            return ""
        return f"_turns-{self.turn_s:g}-{self.pause_s:g}" + \
            (f"_burst-{self.rate:g}" if self.rate != 1 else "")


class Feeder:
    """Pushes `speech` (looped) into a session one frame of `frame_s` at a time, in real
    time or as `speaking` says, and records each frame's arrival: the index just past its
    last sample (counted over all speech pushed) and the clock when it was pushed."""

    def __init__(self, session: LiveSession, speech: torch.Tensor, sample_rate: int,
                 frame_s: float = FEED_FRAME_S, clock=time.monotonic, silent_s: float = 0.0,
                 speaking: Speaking = Speaking()):
        """`silent_s`: frames of silence fed first (then the speech, looped)."""
        self.session, self.clock, self.speaking = session, clock, speaking
        self.silent = round(silent_s * sample_rate)
        self.speech = torch.cat([speech.new_zeros(self.silent), speech])
        self.frame = round(frame_s * sample_rate)
        self.frame_s = frame_s
        self.ends: list[int] = []  # sample index just past each frame
        self.times: list[float] = []  # each frame's arrival
        self.turn_starts: list[float] = []  # with turns: each turn's first frame's arrival
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="speech-feeder", daemon=True)

    def start(self) -> float:
        """Start feeding; returns the first frame's time (the session's start)."""
        self.t0 = self.clock()
        self.thread.start()
        return self.t0

    def _run(self) -> None:
        pushed, k = 0, 0
        n = self.speech.numel()
        while not self.stop.is_set():
            wait = self.t0 + self.due(k) - self.clock()
            if wait > 0:
                self.stop.wait(wait)
            start = pushed if pushed < n else self.silent + (pushed - n) % (n - self.silent)
            part = self.speech[start: start + self.frame]
            if part.numel() < self.frame:  # wrap around the loop (the speech, not the lead-in)
                loop = self.speech[self.silent:]
                part = torch.cat([part, loop[: self.frame - part.numel()]])
            self.times.append(self.clock())
            if self.starts_turn(k):
                self.turn_starts.append(self.times[-1])
            self.session.say(part)
            pushed += part.numel()
            self.ends.append(pushed)
            k += 1

    def due(self, k: int) -> float:
        """Seconds from the start to frame k's arrival (the lead-in of silence in real
        time, then the speech as `speaking` says)."""
        lead = round(self.silent / self.frame) if self.frame else 0
        sp = self.speaking
        if k < lead or not sp.turn_s:
            return k * self.frame_s
        per_turn = max(1, round(sp.turn_s / self.frame_s))
        turn, j = divmod(k - lead, per_turn)
        return lead * self.frame_s + turn * (sp.turn_s + sp.pause_s) + j * self.frame_s / sp.rate

    def starts_turn(self, k: int) -> bool:
        """Whether frame k is a turn's first (speaking in turns)."""
        lead = round(self.silent / self.frame) if self.frame else 0
        sp = self.speaking
        return bool(sp.turn_s) and k >= lead and \
            (k - lead) % max(1, round(sp.turn_s / self.frame_s)) == 0

    def arrival(self, sample: int) -> float:
        """When the frame holding speech sample `sample` arrived."""
        return self.times[bisect.bisect_right(self.ends, sample)]

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


class TakeLog(SpeechBuffer):
    """The session's speech buffer, recording after each step's take how much speech (not
    silence) has been taken in all and when: step k's take is the k-th."""

    def __init__(self, clock=time.monotonic):
        super().__init__(clock)
        # (samples taken or dropped so far, time, silence dropped so far)
        self.takes: list[tuple[int, float, int]] = []

    def take(self, n: int):
        out = super().take(n)
        self.takes.append((self.taken, self.clock(), self.dropped))
        return out


class KeptMetrics(Metrics):
    """Metrics that also keep every speech latency of its sessions (their live windows keep
    one minute): a session reports to metrics of its own (Metrics.session), whose figure is
    kept here as it is reported."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.all_latencies: list[float] = []
        self.arrivals: list[tuple[float, float]] = []  # (arrival, latency) of each

    def session(self, session_id: str = ""):
        child = super().session(session_id)
        report = child.speech_latency

        def speech_latency(seconds: float, arrived: float | None = None) -> None:
            self.all_latencies.append(seconds)
            if arrived is not None:
                self.arrivals.append((arrived, seconds))
            report(seconds, arrived)

        child.speech_latency = speech_latency
        return child


def stats_ms(values: list[float]) -> dict:
    """p50 and p90 (and min, max) in milliseconds of values in seconds."""
    if not values:
        return {"p50": None, "p90": None, "min": None, "max": None}
    q = np.quantile(np.asarray(values) * 1e3, QUANTILES)
    return {"p50": float(q[0]), "p90": float(q[1]), "min": 1e3 * min(values),
            "max": 1e3 * max(values)}


def step_frame_starts(worker: Worker, steps: int) -> list[int]:
    """The index of each step's first frame in the played sequence."""
    starts, n = [], 0
    for k in range(steps):
        starts.append(n)
        n += worker.family.step_frames(worker.spec, k)
    return starts + [n]


def measure_live(worker: Worker, speech: torch.Tensor, chunks: int, warmup: int,
                 slack: int = 2, seed: int = 0, just_in_time: bool = True,
                 stream_decode: bool = True, silent_s: float = 0.0,
                 speaking: Speaking = Speaking()) -> dict:
    """One paced live session of warmup + chunks steps with speech fed as `speaking` says; the
    per-chunk latencies (seconds) and their parts, the first frames' time, and the
    session's own metrics."""
    spec = worker.spec
    steps = warmup + chunks
    starts = step_frame_starts(worker, steps)
    published: list[float] = []

    def sink(frame, audio, t, voiced):
        published.append(t)

    metrics = KeptMetrics(target_fps=spec.fps)  # as charrun makes it
    session = LiveSession(worker, sink, slack=slack, metrics=metrics, seed=seed,
                          just_in_time=just_in_time, stream_decode=stream_decode)
    session.speech = takes = TakeLog()
    feeder = Feeder(session, speech, spec.side.sample_rate, silent_s=silent_s,
                    speaking=speaking)
    g = torch.Generator().manual_seed(seed)
    image = torch.rand((3, spec.out_h, spec.out_w), generator=g)
    # a perf_counter time (the pipeline's StepTimes) on the pacer's clock
    offset = time.monotonic() - time.perf_counter()
    t0 = feeder.start()
    session.start(image)
    started_s = time.monotonic() - t0  # the reference image and prompt encoded
    budget = starts[steps] / spec.fps + SESSION_MARGIN_S
    done = wait_until(lambda: len(published) >= starts[steps], budget)
    times = session.pipeline.times
    session.stop()
    feeder.close()
    if not done:
        raise SystemExit(f"the session played {len(published)} of {starts[steps]} frames in "
                         f"{budget:.0f} s")
    if session.error is not None:
        raise SystemExit(f"the session failed: {session.error}")

    # the decode to the chunk's first frames (its first piece; the whole where decoded whole)
    decoded = times.first_piece or times.decode
    rows = []
    for k in range(warmup, steps):
        before, _, dropped_before = takes.takes[k - 1] if k else (0, 0.0, 0)
        taken, take_t, dropped = takes.takes[k]
        first = published[starts[k]]
        row = {"chunk": k, "speech_samples": taken - before - (dropped - dropped_before),
               "dropped_samples": dropped - dropped_before,
               "take_samples": session.take_size(k), "take_t": take_t - t0,
               "first_frame_t": first - t0}
        if row["speech_samples"] > 0:
            arrived = feeder.arrival(taken - 1)
            a0, a1 = (t + offset for t in times.audio[k])
            d0, d1 = (t + offset for t in times.diffusion[k])
            v0, v1 = (t + offset for t in decoded[k])
            s0, _ = (t + offset for t in times.sink[k])
            edges = (arrived, a0, a1, d0, d1, v0, v1, s0, first)
            row |= {"last_audio_t": arrived - t0, "latency_s": first - arrived,
                    "parts_s": {p: edges[j + 1] - edges[j] for j, p in enumerate(PARTS)}}
        rows.append(row)
    first_chunk = {"start_s": started_s} | {
        name: 1e3 * (b - a) for name, (a, b) in (
            ("audio_ms", times.audio[0]), ("diffusion_ms", times.diffusion[0]),
            ("decode_to_first_frames_ms", decoded[0]))}
    latencies = [r["latency_s"] for r in rows if "latency_s" in r]
    parts = {p: stats_ms([r["parts_s"][p] for r in rows if "parts_s" in r]) for p in PARTS}
    # how many chunks of playback a take runs ahead of its first frame: the steps in flight
    chunk_s = spec.frames_per_latent / spec.fps
    ahead = float(np.median([(r["first_frame_t"] - r["take_t"]) / chunk_s for r in rows]))
    whole = sum(r["speech_samples"] == r["take_samples"] for r in rows)
    # with turns: each measured turn's first speech to the frame that plays it (the
    # session's own figure for the speech that arrived first in the turn, its buffer empty
    # then: the turn's first loud sample where the silence it began with was dropped)
    measured_from = published[starts[warmup]] if warmup < len(starts) else published[0]
    turn_start = []
    for a, b in zip(feeder.turn_starts, [*feeder.turn_starts[1:], math.inf]):
        if a < measured_from:
            continue
        first = sorted((arrived, lat) for arrived, lat in metrics.arrivals if a <= arrived < b)
        if first:
            turn_start.append(first[0][1])
    padded = sum(r["take_samples"] - r["speech_samples"] for r in rows)
    return {"chunks": len(rows), "chunks_with_speech": len(latencies),
            "chunks_taken_whole": whole, "padded_ms": 1e3 * padded / spec.side.sample_rate,
            "dropped_ms": 1e3 * sum(r["dropped_samples"] for r in rows) / spec.side.sample_rate,
            "take_to_first_frame_chunks_p50": ahead,
            "latency_ms": stats_ms(latencies), "parts_ms": parts,
            "first_frames_s": published[0] - t0, "first_chunk": first_chunk,
            "speech_latency_ms": stats_ms(metrics.all_latencies),
            "turn_start_ms": stats_ms(turn_start), "turns": len(turn_start),
            "stalls": len(session.pacer.playout.stalls),
            "stall_s": sum(s for _, s in session.pacer.playout.stalls),
            "rows": rows}


def measure_unpaced(worker: Worker, speech: torch.Tensor, chunks: int, seed: int = 0) -> dict:
    """Each pipeline stage's time per chunk with nothing paced (Worker.run, the render
    path), the chunks that fill the window left out; and the end-to-end capacity: video
    frames a second reaching the sink over the steady chunks (`capacity_fps`), with the
    period between chunks at the sink."""
    g = torch.Generator().manual_seed(seed)
    spec = worker.spec
    worker.start(torch.rand((3, spec.out_h, spec.out_w), generator=g), "")
    sunk: list[tuple[float, int]] = []  # (when a chunk's frames reached the sink, frames)
    times = worker.run(speech, chunks,
                       lambda i, frames: sunk.append((time.perf_counter(), frames.shape[0])),
                       seed=seed)
    skip = max(0, min(worker.spec.sink_chunks + worker.spec.window_chunks, chunks - 2))
    out = {}
    for name in ("audio", "diffusion", "decode"):
        spans = getattr(times, name)[skip:]
        out[name] = stats_ms([b - a for a, b in spans])
    steady = sunk[skip:]
    frames = sum(n for _, n in steady[1:])
    out["capacity_fps"] = frames / (steady[-1][0] - steady[0][0]) if frames else None
    out["period_ms"] = stats_ms([b[0] - a[0] for a, b in zip(steady, steady[1:])])
    out["capacity_chunks"] = len(steady) - 1
    return out


def measure_decode(worker: Worker, reps: int = DECODE_REPS, seed: int = 0) -> dict:
    """The decoder on one latent of a steady chunk against the whole chunk, as the worker
    runs it (its side stream, synchronized): the first frames' wait for the rest."""
    spec, side = worker.spec, worker.side
    shape = worker.family.step_shapes(spec).latent
    g = torch.Generator().manual_seed(seed)

    def decode(latents):
        return worker.on_side_stream(
            lambda x: side.decoder(x.to(worker.decoder_device)).cpu(), latents)

    with torch.inference_mode():
        side.decoder.reset()
        decode(torch.randn(shape, generator=g))  # the session's first chunk
        one, whole = [], []
        for _ in range(reps + 1):  # the first of each untimed
            z = torch.randn(shape, generator=g)
            t = time.perf_counter()
            decode(z[:, :1])
            one.append(time.perf_counter() - t)
            decode(z[:, 1:])
            z = torch.randn(shape, generator=g)
            t = time.perf_counter()
            decode(z)
            whole.append(time.perf_counter() - t)
        one, whole = one[1:], whole[1:]
        side.decoder.reset()
    return {"first_latent": stats_ms(one), "whole_chunk": stats_ms(whole)}


def measure_estimate(worker: Worker, speech: torch.Tensor, seed: int = 0) -> float:
    """A steady step's processing time as a GPU worker measures it at ready
    (Worker.time_processing), for a worker that did not: a short render first brings its
    session to the steady point."""
    g = torch.Generator().manual_seed(seed)
    spec = worker.spec
    worker.start(torch.rand((3, spec.out_h, spec.out_w), generator=g), "")
    worker.run(speech, spec.sink_chunks + spec.window_chunks + 1, lambda i, frames: None,
               seed=seed)
    return worker.time_processing(seed)


def engine_summary(engine: Engine, worker: Worker) -> dict:
    cfg = engine.config
    return {"target": engine.target.name, "gpu": engine.target.gpu, "preset": cfg.model.name,
            "device": str(worker.device), "decoder": engine.target.decoder,
            "numerics": dataclasses.asdict(cfg.numerics),
            "switches": dataclasses.asdict(cfg.switches),
            "fps": cfg.model.fps, "frames_per_chunk": cfg.model.frames_per_latent,
            "lookahead_frames": cfg.model.audio.lookahead_frames,
            "vae_dtype": cfg.model.vae.gpu_dtype if worker.decoder_device.type == "cuda"
            else "float32"}


def run(engine_dir: Path, chunks: int, warmup: int | None = None, slack: int = 2,
        unpaced: int = UNPACED_CHUNKS, decode_reps: int = DECODE_REPS,
        audio: Path | None = None, seed: int = 0, just_in_time: bool = True,
        stream_decode: bool = True, estimate: bool = True, silent_s: float = 0.0,
        speaking: Speaking = Speaking()) -> dict:
    """Load the engine as charrun does, then measure; the results document."""
    t = time.perf_counter()
    engine = Engine.load(engine_dir)
    worker = Worker(engine)
    ready_s = time.perf_counter() - t
    spec = worker.spec
    if warmup is None:
        warmup = spec.sink_chunks + spec.window_chunks
    speech = speech_signal(audio, spec.side.sample_rate)
    at_ready = worker.processing_s is not None
    try:
        if not estimate:
            worker.processing_s = None
        elif not at_ready:
            worker.processing_s = measure_estimate(worker, speech, seed)
        live = measure_live(worker, speech, chunks, warmup, slack, seed, just_in_time,
                            stream_decode, silent_s, speaking)
        stages = measure_unpaced(worker, speech, unpaced, seed) if unpaced else {}
        decode = measure_decode(worker, decode_reps, seed) if decode_reps else {}
    finally:
        worker.close()
    return {
        "preset": spec.name, "engine": engine_summary(engine, worker),
        **provenance(),
        "latency_p50_ms": live["latency_ms"]["p50"], "latency_p90_ms": live["latency_ms"]["p90"],
        "capacity_fps": stages.get("capacity_fps"),
        "first_frames_s": live["first_frames_s"], "first_chunk": live["first_chunk"],
        "ready_s": ready_s,
        "chunks": live["chunks"], "chunks_with_speech": live["chunks_with_speech"],
        "warmup_chunks": warmup, "slack": slack, "feed_frame_ms": 1e3 * FEED_FRAME_S,
        "just_in_time": just_in_time, "stream_decode": stream_decode,
        "processing_estimate_s": worker.processing_s,
        "estimate_measured": ("at ready" if at_ready else "by the script") if estimate
        else None, "speech_after_s": silent_s, "speaking": dataclasses.asdict(speaking),
        "audio": str(audio) if audio else "synthetic formant speech",
        "latency_ms": live["latency_ms"], "latency_parts_ms": live["parts_ms"],
        "take_to_first_frame_chunks_p50": live["take_to_first_frame_chunks_p50"],
        "chunks_taken_whole": live["chunks_taken_whole"], "padded_ms": live["padded_ms"],
        "dropped_ms": live["dropped_ms"],
        "speech_latency_ms": live["speech_latency_ms"],
        "turn_start_ms": live["turn_start_ms"], "turns": live["turns"],
        "stalls": live["stalls"], "stall_s": live["stall_s"],
        "startup": worker.startup,
        "unpaced_stage_ms": stages, "decode_ms": decode,
        "per_chunk": live["rows"],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, required=True, help="an engine charbuild wrote")
    ap.add_argument("--chunks", type=int, default=100, help="measured chunks")
    ap.add_argument("--warmup", type=int, default=None,
                    help="chunks run first and left out (default: sink and window filled)")
    ap.add_argument("--slack", type=int, default=2, help="as charrun --slack")
    ap.add_argument("--unpaced", type=int, default=UNPACED_CHUNKS,
                    help="chunks of the unpaced per-stage run (0: none)")
    ap.add_argument("--decode-reps", type=int, default=DECODE_REPS,
                    help="timed decodes of one latent and of a chunk (0: none)")
    ap.add_argument("--audio", type=Path, help="speech to feed (default: synthetic)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-just-in-time", dest="just_in_time", action="store_false",
                    help="take each step's speech when the pipeline asks for it")
    ap.add_argument("--no-stream-decode", dest="stream_decode", action="store_false",
                    help="hand each chunk's frames to the pacer whole")
    ap.add_argument("--no-estimate", dest="estimate", action="store_false",
                    help="the first deadlines from the first step's processing time")
    ap.add_argument("--speech-after", type=float, default=0.0, metavar="S",
                    help="seconds of silent frames fed before the speech")
    ap.add_argument("--turn-s", type=float, default=0.0, metavar="S",
                    help="speech in turns of S seconds (0: continuous speech)")
    ap.add_argument("--pause-s", type=float, default=3.0, metavar="S",
                    help="with --turn-s: seconds with nothing arriving after each turn")
    ap.add_argument("--burst", type=float, default=1.0, metavar="X",
                    help="with --turn-s: a turn's speech arrives at X times real time, as a "
                         "TTS sends it")
    ap.add_argument("--out", type=Path, help="default: docs/results/livetalk/latency_<preset>_"
                    "<gpu or cpu>[_no-jit][_no-stream][_no-estimate][_after-S]"
                    "[_turns-S-P[_burst-X]]_<date>.json")
    args = ap.parse_args()
    if args.burst != 1 and not args.turn_s:
        ap.error("--burst needs --turn-s: continuous speech faster than real time only "
                 "piles up")
    speaking = Speaking(args.turn_s, args.pause_s if args.turn_s else 0.0, args.burst)
    doc = run(args.engine, args.chunks, args.warmup, args.slack, args.unpaced,
              args.decode_reps, args.audio, args.seed, args.just_in_time, args.stream_decode,
              args.estimate, args.speech_after, speaking)
    gpu = doc["engine"]["gpu"] or "cpu"
    arm = ("" if args.just_in_time else "_no-jit") + ("" if args.stream_decode else "_no-stream")
    arm += ("" if args.estimate else "_no-estimate") + \
        (f"_after-{args.speech_after:g}" if args.speech_after else "") + speaking.tag()
    out = args.out or RESULTS / f"latency_{doc['preset']}_{gpu.lower()}{arm}_{doc['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: v for k, v in doc.items() if k != "per_chunk"}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
