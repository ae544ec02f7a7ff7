"""Media in and out through PyAV: speech audio to 16 kHz mono, a reference image to the
model's frame size, and an H.264 + AAC MP4 writer whose audio rides with its frames."""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch
import torch.nn.functional as F


class MediaError(ValueError):
    pass


def _source(src: str | Path | bytes):
    """(what av.open takes, a name for messages) for a path or a file's bytes."""
    if isinstance(src, (bytes, bytearray)):
        return io.BytesIO(src), "upload"
    path = Path(src)
    if not path.is_file():
        raise MediaError(f"{path}: no such file")
    return str(path), str(path)


def read_audio(src: str | Path | bytes, rate: int) -> torch.Tensor:
    """Any audio file PyAV decodes (a path or its bytes) -> mono float32 samples at `rate`
    (stereo is averaged by the resampler, other rates converted)."""
    f, path = _source(src)
    try:
        with av.open(f) as c:
            if not c.streams.audio:
                raise MediaError(f"{path}: not an audio file (no audio stream)")
            rs = av.AudioResampler(format="flt", layout="mono", rate=rate)
            chunks = []
            for frame in c.decode(c.streams.audio[0]):
                chunks += [f.to_ndarray().reshape(-1) for f in rs.resample(frame)]
            chunks += [f.to_ndarray().reshape(-1) for f in rs.resample(None)]
    except av.FFmpegError as e:
        raise MediaError(f"{path}: not an audio file ({e})") from None
    if not chunks:
        raise MediaError(f"{path}: the audio stream holds no samples")
    return torch.from_numpy(np.concatenate(chunks).astype(np.float32))


def read_image(src: str | Path | bytes, height: int, width: int) -> torch.Tensor:
    """An image file (a path or its bytes) -> [3, height, width] in [0, 1]: scaled to cover,
    then center-cropped."""
    f, path = _source(src)
    try:
        with av.open(f) as c:
            if not c.streams.video:
                raise MediaError(f"{path}: not an image (no picture in it)")
            frame = next(c.decode(c.streams.video[0]))
            rgb = frame.to_ndarray(format="rgb24")
    except (av.FFmpegError, StopIteration) as e:
        raise MediaError(f"{path}: not an image ({e or 'no frame'})") from None
    x = torch.from_numpy(rgb).permute(2, 0, 1).float()[None] / 255.0
    s = max(height / x.shape[2], width / x.shape[3])
    x = F.interpolate(x, size=(max(height, round(x.shape[2] * s)), max(width, round(x.shape[3] * s))),
                      mode="bilinear", align_corners=False, antialias=True)
    top, left = (x.shape[2] - height) // 2, (x.shape[3] - width) // 2
    return x[0, :, top: top + height, left: left + width].clamp(0, 1)


def write_png(path: str | Path, image: np.ndarray) -> None:
    """[H, W, 3] uint8 -> PNG."""
    with av.open(str(path), "w", format="image2") as c:
        s = c.add_stream("png")
        s.height, s.width = image.shape[:2]
        s.pix_fmt = "rgb24"
        for p in s.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
            c.mux(p)
        for p in s.encode():
            c.mux(p)


class Mp4Writer:
    """H.264 video at `fps` and AAC audio at `rate`; frames and their audio are written
    together. close() is safe to call at any point and leaves a playable file."""

    def __init__(self, path: str | Path, width: int, height: int, fps: int, rate: int):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.c = av.open(str(self.path), "w")
        self.v = self.c.add_stream("libx264", rate=fps)
        self.v.width, self.v.height, self.v.pix_fmt = width, height, "yuv420p"
        self.v.time_base = Fraction(1, fps)
        self.v.options = {"preset": "veryfast", "crf": "18"}
        self.a = self.c.add_stream("aac", rate=rate)
        self.a.layout = "mono"
        self.rate = rate
        self.frames = 0
        self.samples = 0
        self.closed = False

    def write(self, frames: torch.Tensor, audio: torch.Tensor) -> None:
        """frames [N, 3, H, W] in [0, 1]; audio [samples] float32 for those frames."""
        rgb = (frames.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
        for img in rgb:
            vf = av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format="rgb24")
            vf.pts = self.frames
            self.frames += 1
            for p in self.v.encode(vf):
                self.c.mux(p)
        if audio.numel():
            af = av.AudioFrame.from_ndarray(audio.numpy().astype(np.float32)[None], format="flt",
                                            layout="mono")
            af.sample_rate, af.pts = self.rate, self.samples
            self.samples += audio.numel()
            for p in self.a.encode(af):
                self.c.mux(p)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for s in (self.v, self.a):
            for p in s.encode():
                self.c.mux(p)
        self.c.close()
