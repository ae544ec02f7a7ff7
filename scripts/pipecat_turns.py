"""One Pipecat pipeline through `charengine.pipecat.CharacterVideoService` against a running
`charrun --serve`: a source that speaks like a TTS service (TTSStartedFrame, the speech file's
audio as TTSAudioRawFrames of 20 ms at the TTS's rate, TTSStoppedFrame, with a text frame
before and after each turn), the service, and a sink that records every frame leaving it.

Scenarios (--scenario):
- speak: turns of the speech file, each played out: the next turn (or the tail) --gap-s
  after the last one's voice has left the service; the TTS streams at real time (--tts-speed
  1) or in bursts (4: four times real time).
- interrupt: a turn, a barge-in (Pipecat's interruption) --interrupt-after-s after its first
  voiced frame left the service, then a second turn.
- open: the session is opened and the pipeline ended at once (for a server that refuses).
- lose: the session's connection is cut from the bot's side --lose-after-s into it (as a
  network that drops would), then a turn, played out: the service opens a new session on
  its policy.

Prints one JSON line: the engine, the frames (count, size, first and last time), each turn's
latency (from its first TTS audio to the first voiced audio leaving the service: the
character's frames leave with it), the barge-in time (from the interruption to the last
voiced audio leaving) and how much voiced audio left after it, the text frames in the
order they left, the errors pushed upstream.
With --out, the frames (RGB), the audio out, and their times, as .npz.

    python scripts/pipecat_turns.py --url http://127.0.0.1:8080/ --image face.png \\
        --speech speech.wav --scenario speak --turns 3 --tts-speed 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import av
import numpy as np
from loguru import logger
from pipecat.frames.frames import (EndFrame, ErrorFrame, Frame,
                                   OutputAudioRawFrame, OutputImageRawFrame, StartFrame,
                                   TextFrame, TTSAudioRawFrame, TTSStartedFrame, TTSStoppedFrame)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.workers.runner import WorkerRunner

from charengine.pipecat import CharacterVideoService, Reconnect
from charengine.pipecat.service import voiced

TTS_RATE = 24000  # what the source's TTS frames carry (a common TTS rate, not the engine's)
OUT_RATE = 24000  # the pipeline's output rate
TTS_FRAME_S = 0.02
POLL_S = 0.01
TURN_TIMEOUT_S = 20.0  # a turn whose voice has not left the service by then is reported lost


def read_speech(path: Path, rate: int) -> np.ndarray:
    """The file's audio as 16-bit mono at `rate`."""
    out = []
    with av.open(str(path)) as f:
        rs = av.AudioResampler(format="s16", layout="mono", rate=rate)
        for frame in f.decode(audio=0):
            out += [p.to_ndarray().reshape(-1) for p in rs.resample(frame)]
        out += [p.to_ndarray().reshape(-1) for p in rs.resample(None)]
    return np.concatenate(out).astype(np.int16)


class Recorder(FrameProcessor):
    """Records what passes: downstream at the sink (frames leaving the service), upstream at
    the source (errors)."""

    def __init__(self, direction: FrameDirection):
        super().__init__()
        self.direction = direction
        self.t0 = time.monotonic()
        self.images: list[np.ndarray] = []
        self.image_t: list[float] = []
        self.sizes: set = set()
        self.audio: list[np.ndarray] = []
        self.audio_t: list[float] = []
        self.audio_kinds: set[str] = set()
        self.voiced_t: list[float] = []
        self.voiced_s: list[float] = []  # each voiced frame's length of audio
        self.texts: list[str] = []
        self.kinds: list[str] = []
        self.errors: list[str] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if direction == self.direction and not isinstance(frame, StartFrame):
            t = self.now()
            if isinstance(frame, OutputImageRawFrame):
                self.sizes.add(tuple(frame.size))
                w, h = frame.size
                self.images.append(np.frombuffer(frame.image, np.uint8).reshape(h, w, 3))
                self.image_t.append(t)
            elif isinstance(frame, OutputAudioRawFrame):
                pcm = np.frombuffer(frame.audio, np.int16)
                self.audio_kinds.add(type(frame).__name__)
                self.audio.append(pcm)
                self.audio_t.append(t)
                if voiced(pcm):
                    self.voiced_t.append(t)
                    self.voiced_s.append(len(pcm) / (frame.sample_rate * frame.num_channels))
            elif isinstance(frame, TextFrame):
                self.texts.append(frame.text)
            elif isinstance(frame, ErrorFrame):
                self.errors.append(frame.error)
            if not isinstance(frame, (OutputImageRawFrame, OutputAudioRawFrame)):
                self.kinds.append(type(frame).__name__)
        await self.push_frame(frame, direction)


async def run(args) -> dict:
    speech = read_speech(args.speech, TTS_RATE) if args.speech else np.zeros(0, np.int16)
    source = Recorder(FrameDirection.UPSTREAM)
    service = CharacterVideoService(args.url, args.image, args.prompt,
                                    reconnect=Reconnect(attempts=args.reconnects))
    sink = Recorder(FrameDirection.DOWNSTREAM)
    sink.t0 = source.t0
    worker = PipelineWorker(Pipeline([source, service, sink]), cancel_on_idle_timeout=False,
                            params=PipelineParams(audio_out_sample_rate=OUT_RATE))
    started = asyncio.Event()
    report: dict = {"scenario": args.scenario, "turns": [], "interrupt": None}

    @worker.event_handler("on_pipeline_started")
    async def on_started(worker, frame):
        started.set()

    async def say(turn: int, samples: np.ndarray, stop_at: asyncio.Event | None = None) -> float:
        """A TTS turn; returns the time of its first audio."""
        n = round(TTS_RATE * TTS_FRAME_S)
        await worker.queue_frame(TextFrame(f"turn {turn}"))
        await worker.queue_frame(TTSStartedFrame())
        t_first = source.now()
        for i, at in enumerate(range(0, len(samples), n)):
            if stop_at is not None and stop_at.is_set():
                break
            await worker.queue_frame(TTSAudioRawFrame(audio=samples[at: at + n].tobytes(),
                                                      sample_rate=TTS_RATE, num_channels=1))
            due = t_first + (i + 1) * TTS_FRAME_S / args.tts_speed
            await asyncio.sleep(max(0.0, due - source.now()))
        await worker.queue_frame(TTSStoppedFrame())
        await worker.queue_frame(TextFrame(f"end of turn {turn}"))
        return t_first

    async def first_voice_after(t: float) -> float | None:
        end = source.now() + TURN_TIMEOUT_S
        while source.now() < end:
            later = [v for v in sink.voiced_t if v > t]
            if later:
                return later[0]
            await asyncio.sleep(POLL_S)
        return None

    async def quiet_for(seconds: float) -> None:
        """Until no voiced audio has left for `seconds`."""
        while not sink.voiced_t or source.now() - sink.voiced_t[-1] < seconds:
            await asyncio.sleep(POLL_S)

    async def script():
        await asyncio.wait_for(started.wait(), args.start_timeout_s)
        await asyncio.sleep(args.lead_s)
        if args.scenario == "speak":
            for turn in range(args.turns):
                t = await say(turn + 1, speech)
                first = await first_voice_after(t)
                report["turns"].append({"tts_first_s": round(t, 4), "latency_s":
                                        None if first is None else round(first - t, 4)})
                if first is not None:  # the turn plays out, however fast its TTS sent it
                    await quiet_for(args.gap_s)
        elif args.scenario == "interrupt":
            stop = asyncio.Event()
            speaking = asyncio.ensure_future(say(1, speech, stop))
            first = await first_voice_after(0.0)
            if first is not None:
                await asyncio.sleep(max(0.0, first + args.interrupt_after_s - source.now()))
                stop.set()  # the TTS stops first, as Pipecat's do on an interruption: no
                await speaking  # audio of the interrupted turn follows the interruption
                t_int = source.now()
                await source.broadcast_interruption()
                await asyncio.sleep(args.gap_s)
                now = source.now()
                after = [(v, d) for v, d in zip(sink.voiced_t, sink.voiced_s) if t_int <= v <= now]
                last = max((v for v, _ in after), default=t_int)
                report["interrupt"] = {"at_s": round(t_int, 4),
                                       "last_voiced_after_s": round(last - t_int, 4),
                                       "voiced_audio_after_s": round(sum(d for _, d in after), 4)}
                t2 = await say(2, speech[: len(speech) // 2])
                first2 = await first_voice_after(t2)
                report["turns"].append({"tts_first_s": round(t2, 4), "latency_s":
                                        None if first2 is None else round(first2 - t2, 4)})
            else:
                await speaking
        elif args.scenario == "lose":
            await asyncio.sleep(args.lose_after_s)
            frames_before = len(sink.images)
            t_loss = source.now()
            await service._client.pc.close()  # the connection drops
            t = await say(1, speech)
            first = await first_voice_after(t)
            report["turns"].append({"tts_first_s": round(t, 4), "latency_s":
                                    None if first is None else round(first - t, 4)})
            if first is not None:  # the turn plays out
                await quiet_for(args.gap_s)
            report["frames_before_loss"] = frames_before
            report["voiced_audio_after_loss_s"] = round(sum(
                d for v, d in zip(sink.voiced_t, sink.voiced_s) if v >= t_loss), 4)
        await asyncio.sleep(args.tail_s)
        await worker.queue_frame(EndFrame())

    runner = WorkerRunner()
    await runner.add_workers(worker)
    await asyncio.gather(runner.run(), script())
    info = service.engine
    report.update({
        "engine": None if info is None else {"preset": info.preset, "fps": info.fps,
                                             "width": info.width, "height": info.height,
                                             "sample_rate": info.sample_rate,
                                             "step_s": info.step_s},
        "frames": len(sink.images), "sizes": sorted(sink.sizes),
        "frames_first_s": sink.image_t[0] if sink.image_t else None,
        "frames_last_s": sink.image_t[-1] if sink.image_t else None,
        "audio_s": round(sum(a.size for a in sink.audio) / OUT_RATE, 3),
        "audio_kinds": sorted(sink.audio_kinds),
        "texts": sink.texts, "kinds": sink.kinds, "errors": source.errors,
        "sessions_opened": service.sessions_opened})
    if args.out:
        np.savez_compressed(args.out, images=np.stack(sink.images) if sink.images else
                            np.zeros((0, 1, 1, 3), np.uint8), image_t=np.array(sink.image_t),
                            audio=np.concatenate(sink.audio) if sink.audio else
                            np.zeros(0, np.int16), audio_t=np.array(sink.audio_t),
                            audio_n=np.array([a.size for a in sink.audio]),
                            speech=speech, out_rate=OUT_RATE, tts_rate=TTS_RATE)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="charrun --serve's page, e.g. "
                                                 "http://127.0.0.1:8080/")
    ap.add_argument("--image", type=Path)
    ap.add_argument("--prompt")
    ap.add_argument("--speech", type=Path, help="the TTS's speech (any format PyAV reads)")
    ap.add_argument("--scenario", choices=("speak", "interrupt", "open", "lose"),
                    default="speak")
    ap.add_argument("--reconnects", type=int, default=0,
                    help="the service's reconnection attempts (Reconnect.attempts)")
    ap.add_argument("--lose-after-s", type=float, default=2.0)
    ap.add_argument("--turns", type=int, default=1)
    ap.add_argument("--tts-speed", type=float, default=1.0,
                    help="how fast the TTS delivers its audio: 1 real time, 4 in bursts")
    ap.add_argument("--lead-s", type=float, default=1.0, help="listening before turn 1")
    ap.add_argument("--gap-s", type=float, default=1.0, help="quiet between turns")
    ap.add_argument("--tail-s", type=float, default=1.0, help="after the last turn")
    ap.add_argument("--interrupt-after-s", type=float, default=1.0)
    ap.add_argument("--start-timeout-s", type=float, default=30.0)
    ap.add_argument("--out", type=Path, help="frames and audio out as .npz")
    ap.add_argument("--quiet", action="store_true", help="no Pipecat log")
    args = ap.parse_args()
    if args.quiet:
        logger.remove()
        logger.add(sys.stderr, level="WARNING")
    print(json.dumps(asyncio.run(run(args))), flush=True)


if __name__ == "__main__":
    main()
