"""WebRTC tracks fed by the pacer: video and audio frames carry timestamps from the pacer's one
monotonic clock (aiortc's own video clock assumes 30 fps), so a stall shows as a gap in both."""

from __future__ import annotations

import asyncio
from fractions import Fraction

import av
import numpy as np
import torch
from aiortc import MediaStreamTrack

VIDEO_CLOCK = 90000


class PacedTrack(MediaStreamTrack):
    """A track whose frames are put from another thread (the pacer's)."""

    def __init__(self, kind: str, loop: asyncio.AbstractEventLoop, max_queue: int = 96):
        super().__init__()
        self.kind = kind
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=max_queue)

    def _put(self, frame) -> None:
        if self.queue.full():  # a stalled consumer: keep the newest
            self.queue.get_nowait()
        self.queue.put_nowait(frame)

    def put(self, frame) -> None:
        self.loop.call_soon_threadsafe(self._put, frame)

    async def recv(self):
        return await self.queue.get()


class PacedOutput:
    """publish() for the pacer: one video and one audio track, timestamps from the clock.

    Audio leaves in 20 ms frames: aiortc sends each audio frame as one RTP packet stamped
    with the frame's first sample, so a 41.7 ms frame (one video frame's audio) would put two
    Opus packets under one timestamp and the receiver would conceal half of the audio."""

    AUDIO_FRAME_S = 0.02

    def __init__(self, loop: asyncio.AbstractEventLoop, sample_rate: int):
        self.video = PacedTrack("video", loop)
        self.audio = PacedTrack("audio", loop)
        self.rate = sample_rate
        self.chunk = round(sample_rate * self.AUDIO_FRAME_S)
        self.pending = torch.zeros(0)
        self.samples = 0
        self.t0: float | None = None

    def publish(self, frame: torch.Tensor, audio: torch.Tensor, t: float, voiced: bool) -> None:
        if self.t0 is None:
            self.t0 = t
        rgb = (frame.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        vf = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
        vf.pts, vf.time_base = round((t - self.t0) * VIDEO_CLOCK), Fraction(1, VIDEO_CLOCK)
        self.video.put(vf)
        self.pending = torch.cat([self.pending, audio.float()])
        while self.pending.numel() >= self.chunk:
            part, self.pending = self.pending[: self.chunk], self.pending[self.chunk:]
            pcm = (part.clamp(-1, 1) * 32767).round().to(torch.int16).numpy()[None]
            af = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm), format="s16", layout="mono")
            af.sample_rate = self.rate
            af.pts, af.time_base = self.samples, Fraction(1, self.rate)
            self.samples += self.chunk
            self.audio.put(af)
