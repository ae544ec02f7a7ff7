"""`CharacterVideoService`: a Pipecat frame processor, placed after the bot's TTS, that turns
the bot's speech into the character speaking it, from a `charrun --serve` the bot runs itself.

Frames in and out:
- `StartFrame` opens a session on the server (client.py: over WebRTC, as the page does) with
  the reference image and prompt; `EndFrame` and `CancelFrame` end it and free its place.
- `TTSAudioRawFrame`: resampled to the engine's rate and sent to the session as it arrives;
  not passed on. The character's speech comes back in its place, in step with its frames.
- Pushed downstream as they arrive from the server (paced there from one clock): the
  character's frames as `OutputImageRawFrame` (RGB, the engine's size, at its fps) and its
  audio as `SpeechOutputAudioRawFrame` (an `OutputAudioRawFrame` of a continuous stream: the
  speech, and silence between turns), 16-bit mono at the pipeline's output rate.
- `InterruptionFrame` (the user began speaking) is the session's barge-in: speech not yet
  sent is dropped here, the rest and the frames not yet played at the server; the character
  returns to listening. Passed on.
- Everything else passes through in order.

When the server refuses the session (busy, full, draining, a bad image) or the session fails,
an `ErrorFrame` carries the server's own sentence upstream; the service never waits without
a bound. A lost connection (or a session the server ended) is opened again on `Reconnect`'s
policy (3 tries, 0.5 s, 1 s, 2 s apart by default), then given up with an `ErrorFrame`.
While the service reconnects, the bot's speech is held and then given to the new session;
while no session is open otherwise (a refusal, or the policy given up) the bot's speech
passes through unchanged: the user still hears the bot, without the character.

Metrics: time to first byte, from the first TTS audio of a turn to the first frame of the
character speaking it leaving the service (`can_generate_metrics`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
from loguru import logger
from pipecat.frames.frames import (CancelFrame, EndFrame, Frame, InterruptionFrame,
                                   OutputImageRawFrame, SpeechOutputAudioRawFrame, StartFrame,
                                   TTSAudioRawFrame, TTSStartedFrame, TTSStoppedFrame)
from pipecat.processors.frame_processor import FrameDirection, FrameProcessorSetup
from pipecat.services.ai_service import AIService
from pipecat.services.settings import ServiceSettings

from ..paths import not_a_file
from ..runtime.formats import stream_audio_problem
from .client import CharacterClient, EngineInfo, Refused, Unreachable

# a received audio frame louder than this (RMS, of full scale) carries speech: the end of a
# turn's time to first byte (Opus decodes silence to exact zeros or near them)
VOICED_RMS = 10 ** (-50 / 20)


def voiced(pcm: np.ndarray) -> bool:
    """Whether 16-bit samples carry speech (louder than VOICED_RMS)."""
    return bool(pcm.size) and float(np.sqrt(np.mean((pcm / 32768.0) ** 2))) > VOICED_RMS
# the bot's speech held while a lost session is opened again (given to the new one, or
# passed on if none opens): more than the default policy's 3.5 s of waiting in TTS frames
MAX_HELD_FRAMES = 2000


@dataclass(frozen=True)
class Reconnect:
    """What a lost connection gets: `attempts` new sessions, the first after `delay_s`, each
    next `factor` times later; then an ErrorFrame. attempts=0: none."""
    attempts: int = 3
    delay_s: float = 0.5
    factor: float = 2.0

    def delays(self) -> list[float]:
        return [self.delay_s * self.factor ** i for i in range(self.attempts)]


def _pcm(frame: av.AudioFrame) -> np.ndarray:
    return frame.to_ndarray().reshape(-1)


def _s16(samples: np.ndarray) -> np.ndarray:
    """Float samples in [-1, 1] as 16-bit."""
    return (np.clip(samples, -1, 1) * 32767).round().astype(np.int16)


class CharacterVideoService(AIService):
    """The character of a local `charrun --serve` at `url` (its page's address), animated
    from `image` (a path or the file's bytes; None: the server's grey frame) and `prompt`.
    A path that is not a file is a ValueError here, when the bot is put together, not a
    failure of each session it opens."""

    def __init__(self, url: str, image: str | Path | bytes | None = None,
                 prompt: str | None = None, *, reconnect: Reconnect = Reconnect(),
                 ice_servers: tuple[str, ...] = (), connect_timeout_s: float | None = None,
                 **kwargs):
        # no model to name: the settings say so (Pipecat checks every field is given)
        if isinstance(image, (str, Path)) and (why := not_a_file(Path(image))) is not None:
            raise ValueError(f"CharacterVideoService: the image {image}: {why}")
        super().__init__(settings=ServiceSettings(model=None), **kwargs)
        self._url, self._image, self._prompt = url, image, prompt
        self._reconnect = reconnect
        client_kw = {"ice_servers": tuple(ice_servers)}
        if connect_timeout_s is not None:
            client_kw["connect_timeout_s"] = connect_timeout_s
        self._client_kw = client_kw
        self._client: CharacterClient | None = None
        self._info: EngineInfo | None = None
        self._out_rate = 24000
        self._to_engine: av.AudioResampler | None = None
        self._to_engine_from: tuple[int, int] | None = None
        self._refused_audio = False  # TTS audio the engine cannot take was dropped (said once)
        self._to_pipeline: av.AudioResampler | None = None
        self._open = False  # a session is connected
        self._ending = False  # EndFrame or CancelFrame seen
        self._turn_waiting = False  # TTS audio of a turn sent, its first frame not yet out
        self._rejoin: asyncio.Task | None = None
        self.sessions_opened = 0  # sessions this service has opened (reconnections count)
        self._held: list[TTSAudioRawFrame] = []  # the bot's speech while reconnecting

    @property
    def engine(self) -> EngineInfo | None:
        """The engine of the open session (/status): fps, frame size, sample rate."""
        return self._info

    def can_generate_metrics(self) -> bool:
        return True

    async def setup(self, setup: FrameProcessorSetup):
        await super().setup(setup)
        self._out_rate = setup.audio_out_sample_rate

    async def start(self, frame: StartFrame):
        await super().start(frame)
        self._ending = False
        # to float, not 16-bit: FFmpeg's resampler scales a 16-bit downmix of the decoded
        # stereo by a further 1/sqrt(2) (the received speech would be 3 dB quieter than sent)
        self._to_pipeline = av.AudioResampler(format="flt", layout="mono", rate=self._out_rate)
        await self._connect()

    async def stop(self, frame: EndFrame):
        await super().stop(frame)
        await self._end()

    async def cancel(self, frame: CancelFrame):
        await super().cancel(frame)
        await self._end()

    async def cleanup(self):
        await super().cleanup()
        await self._end()

    # the session

    def _new_client(self) -> CharacterClient:
        return CharacterClient(self._url, self._image, self._prompt, on_video=self._video,
                               on_audio=self._audio, on_lost=self._lost, **self._client_kw)

    async def _open_session(self) -> Refused | Unreachable | None:
        """A new session on the server, the service's from here; the refusal if none."""
        client = self._new_client()
        try:
            self._info = await client.open()
        except (Refused, Unreachable) as e:
            return e
        self._client, self._open = client, True
        self.sessions_opened += 1
        logger.info(f"{self}: session {self.sessions_opened} open on {self._url} "
                    f"({self._info.preset}, {self._info.width}x{self._info.height} at "
                    f"{self._info.fps} fps)")
        return None

    async def _connect(self) -> None:
        """Open a session; an ErrorFrame with the server's sentence if it cannot be."""
        refused = await self._open_session()
        if refused is not None:
            await self.push_error(error_msg=str(refused), exception=refused)

    @property
    def _rejoining(self) -> bool:
        return self._rejoin is not None and not self._rejoin.done()

    def _lost(self, why: str) -> None:
        """The session ended without us: open another on the reconnect policy."""
        self._open = False
        if self._ending or self._rejoining:
            return
        logger.warning(f"{self}: {why}")
        self._rejoin = self.create_task(self._rejoin_after(why))

    async def _rejoin_after(self, why: str) -> None:
        old, self._client = self._client, None
        if old is not None:
            await old.close(tell_server=False)
        for i, delay in enumerate(self._reconnect.delays()):
            await asyncio.sleep(delay)
            if self._ending:
                return
            logger.info(f"{self}: reconnecting ({i + 1} of {self._reconnect.attempts})")
            refused = await self._open_session()
            if refused is not None:
                why = str(refused)
                continue
            held, self._held = self._held, []
            for frame in held:  # what the bot said meanwhile, to the new session
                self._client.say(self._resampled(frame))
            return
        await self.push_error(error_msg=f"{why}; gave up after {self._reconnect.attempts} "
                                        "reconnection attempts")
        held, self._held = self._held, []
        for frame in held:  # the bot's voice, without its character
            await self.push_frame(frame)

    async def _end(self) -> None:
        self._ending, self._open = True, False
        if self._rejoin is not None:
            await self.cancel_task(self._rejoin)
            self._rejoin = None
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    # what comes back

    async def _video(self, frame: av.VideoFrame) -> None:
        rgb = frame.to_ndarray(format="rgb24")
        await self.push_frame(OutputImageRawFrame(image=rgb.tobytes(),
                                                  size=(rgb.shape[1], rgb.shape[0]),
                                                  format="RGB"))

    async def _audio(self, frame: av.AudioFrame) -> None:
        frame.pts = None  # the resampler keeps its own count
        for part in self._to_pipeline.resample(frame):
            pcm = _s16(_pcm(part))
            if self._turn_waiting and voiced(pcm):
                self._turn_waiting = False
                await self.stop_ttfb_metrics()
            await self.push_frame(SpeechOutputAudioRawFrame(
                audio=pcm.tobytes(), sample_rate=self._out_rate, num_channels=1))

    # what goes in

    def _resampled(self, frame: TTSAudioRawFrame) -> np.ndarray:
        """The frame's samples at the engine's rate, mono, 16-bit (after what the resampler
        held, where the frame's rate or channels differ from the last one's). Audio at a rate
        or of channels the engine's speech is never taken at is dropped, the log saying so
        once."""
        key = (frame.sample_rate, frame.num_channels)
        problem = stream_audio_problem(*key)
        if problem is not None:
            if not self._refused_audio:
                logger.warning(f"{self}: the TTS's audio is dropped: {problem}")
            self._refused_audio = True
            return np.zeros(0, np.int16)
        parts = self._resampler_tail() if key != self._to_engine_from else []
        if self._to_engine is None:
            self._to_engine = av.AudioResampler(format="flt", layout="mono",
                                                rate=self._info.sample_rate)
            self._to_engine_from = key
        pcm = np.frombuffer(frame.audio, dtype=np.int16).reshape(-1, frame.num_channels)
        af = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm.reshape(1, -1)), format="s16",
                                        layout="mono" if frame.num_channels == 1 else "stereo")
        af.sample_rate = frame.sample_rate
        parts += [_pcm(p) for p in self._to_engine.resample(af)]
        return _s16(np.concatenate(parts or [np.zeros(0, np.float32)]))

    def _resampler_tail(self) -> list[np.ndarray]:
        """What the resampler to the engine holds, handed on; the next frame starts another."""
        parts = [] if self._to_engine is None else \
            [_pcm(p) for p in self._to_engine.resample(None)]
        self._to_engine = self._to_engine_from = None
        return parts

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame) and self._open:
            if not self._turn_waiting and self._client.speech.queued == 0:
                self._turn_waiting = True
                await self.start_ttfb_metrics()
            self._client.say(self._resampled(frame))
            return
        if isinstance(frame, TTSAudioRawFrame) and self._rejoining and \
                len(self._held) < MAX_HELD_FRAMES:
            self._held.append(frame)
            return
        if isinstance(frame, TTSStartedFrame):
            self._turn_waiting = False
        if isinstance(frame, TTSStoppedFrame) and self._open:  # the turn's last samples
            tail = self._resampler_tail()
            if tail:
                self._client.say(_s16(np.concatenate(tail)))
        if isinstance(frame, InterruptionFrame):
            self._held.clear()
            self._to_engine = self._to_engine_from = None  # it holds the dropped turn's
        if isinstance(frame, InterruptionFrame) and self._open:
            self._turn_waiting = False
            await self.cancel_ttfb_metrics()
            await self._client.interrupt()
        await self.push_frame(frame, direction)
