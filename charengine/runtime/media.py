"""Media in and out through PyAV: speech audio to 16 kHz mono (its declared length kept,
non-finite samples refused) and an H.264 + AAC MP4 writer whose audio rides with its
frames. Reference images are read by images.py."""

from __future__ import annotations

import errno
import io
import os
import stat
import tempfile
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch

from charengine.paths import (Held, current_umask, make_dirs, missing_dirs, remove_dirs,
                              remove_stale)

from .formats import (AUDIO_CODECS, AUDIO_CODECS_SAID, AUDIO_DEMUXERS, AUDIO_FORMATS_SAID,
                      MAX_SAMPLE_RATE, MAX_SPEECH_S, MIN_SAMPLE_RATE, VIDEO_SUFFIXES,
                      MediaError, source_of)


# Audio whose container declares a length is cut to it (encoders pad their last frame); one
# that ends this much before its declared length is reported as truncated.
TRUNCATED_TOLERANCE_S = 0.05


def _wav_header_seconds(src: str | Path | bytes) -> float | None:
    """The length a PCM WAV's header declares (its data chunk's size), through the standard
    library's reader; None where it cannot say (other encodings)."""
    import wave

    try:
        with wave.open(io.BytesIO(src) if isinstance(src, (bytes, bytearray)) else str(src)) as w:
            return w.getnframes() / w.getframerate()
    except (wave.Error, EOFError, ZeroDivisionError):
        return None


def _audio_limits(path: str, stream, declared: float | None, max_seconds: float) -> None:
    """Refuse, before decoding, a stream whose declared sample rate is outside
    [MIN_SAMPLE_RATE, MAX_SAMPLE_RATE] or whose declared length is over `max_seconds`."""
    rate = stream.rate or stream.codec_context.sample_rate
    if not MIN_SAMPLE_RATE <= (rate or 0) <= MAX_SAMPLE_RATE:
        raise MediaError(f"{path}: declares a sample rate of {rate or 0} Hz; speech must be "
                         f"{MIN_SAMPLE_RATE:,} to {MAX_SAMPLE_RATE:,} Hz: re-export it")
    if declared is not None and declared > max_seconds:
        raise MediaError(f"{path}: declares {declared:,.0f} s of speech; at most "
                         f"{max_seconds:,.0f} s is taken: cut it into parts")


def read_audio(src: str | Path | bytes, rate: int, warn=None,
               max_seconds: float = MAX_SPEECH_S) -> torch.Tensor:
    """An audio file (a path or its bytes) in one of formats.AUDIO_DEMUXERS' containers and
    AUDIO_CODECS' codecs -> mono float32 samples at `rate` (stereo is averaged by
    the resampler, other rates converted), as long as the container says it is (an
    encoder's padding of the last frame dropped). Bounded before and while it
    is decoded (runtime/formats.py): a declared sample rate outside the speech range, a
    declared length over `max_seconds`, or more than that once decoded, is refused in one
    line, as is audio with NaN or infinite samples; `warn(line)` hears of a file that ends
    before its declared length."""
    f, path = source_of(src)
    most = int(max_seconds * rate) + 1
    opened = False
    try:
        with av.open(f, options={"format_whitelist": ",".join(AUDIO_DEMUXERS),
                                 "codec_whitelist": ",".join(AUDIO_CODECS)}) as c:
            opened = True
            if not c.streams.audio:
                raise MediaError(f"{path}: not an audio file (no audio stream)")
            stream = c.streams.audio[0]
            if stream.codec_context.name not in AUDIO_CODECS:
                raise MediaError(f"{path}: holds speech in the {stream.codec_context.name} "
                                 f"codec, which is not read here; give {AUDIO_CODECS_SAID}")
            declared = (float(stream.duration * stream.time_base) if stream.duration
                        else c.duration / av.time_base if c.duration else None)
            if c.format.name == "wav":  # FFmpeg clamps a WAV's length to what the file holds
                declared = _wav_header_seconds(src) or declared
            _audio_limits(path, stream, declared, max_seconds)
            rs = av.AudioResampler(format="flt", layout="mono", rate=rate)
            chunks, have = [], 0
            for frame in c.decode(stream):
                for out in rs.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
                    have += chunks[-1].size
                if have > most:
                    raise MediaError(f"{path}: holds more than {max_seconds:,.0f} s of speech "
                                     "(more than its header declares); at most that is taken: "
                                     "cut it into parts")
            chunks += [f.to_ndarray().reshape(-1) for f in rs.resample(None)]
    except av.FFmpegError as e:
        # EINVAL on opening: FFmpeg knows the file's format, one outside the list it was
        # given (its own words would read "Invalid argument")
        why = "" if e.errno == errno.EINVAL and not opened else f" ({e.strerror})"
        raise MediaError(f"{path}: not an audio file in a format read here{why}; give "
                         f"{AUDIO_FORMATS_SAID}") from None
    if not chunks:
        raise MediaError(f"{path}: the audio stream holds no samples")
    x = np.concatenate(chunks).astype(np.float32)
    bad = ~np.isfinite(x)
    if bad.any():
        first = int(np.argmax(bad)) / rate
        raise MediaError(f"{path}: holds {int(bad.sum())} NaN or infinite samples (the first "
                         f"at {first:.2f} s); refused before any work: re-export the speech")
    if declared is not None:
        n = round(declared * rate)
        if x.size > n:
            x = x[:n]
        elif x.size < n - TRUNCATED_TOLERANCE_S * rate and warn is not None:
            warn(f"{path}: ends early: its header declares {declared:.2f} s and "
                 f"{x.size / rate:.2f} s could be read (is the file truncated?); using what "
                 "was read")
    return torch.from_numpy(x)


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


def check_video_out(path: Path, inputs: dict[str, Path | None] | None = None) -> Path:
    """Refuse, before any work, an output the writer could not make: a directory, a name
    with no known container extension, or one whose directory cannot be created; and one
    that is one of the render's `inputs` (flag -> path), which it would replace."""
    for flag, given in (inputs or {}).items():
        if given is not None and path.exists() and Path(given).exists() \
                and os.path.samefile(path, given):
            raise MediaError(f"--out {path}: is the {flag} file, which the video would "
                             "replace; give the video another name")
    if path.is_dir():
        raise MediaError(f"--out {path}: is a directory; name the video file, e.g. "
                         f"{path / 'out.mp4'}")
    if path.suffix.lower() not in VIDEO_SUFFIXES:
        raise MediaError(f"--out {path}: give a video file name ending in "
                         f"{', '.join(VIDEO_SUFFIXES)}")
    missing, parent = missing_dirs(path)
    if not parent.is_dir():
        raise MediaError(f"--out {path}: cannot be created: {parent} is not a directory")
    made = []
    try:  # a trial file where the video will be written, removed with any folder it needed
        made = make_dirs(missing)
        fd, trial = tempfile.mkstemp(prefix=f".{path.stem}.trial-", dir=path.absolute().parent)
        os.close(fd)
        os.unlink(trial)
    except OSError as e:
        raise MediaError(f"--out {path}: cannot be created ({e.strerror or e})") from None
    finally:
        remove_dirs(made)
    return path


class Mp4Writer:
    """H.264 video at `fps` and AAC audio at `rate`; frames and their audio are written
    together into a file beside `path`, which close() moves to `path` once it holds a frame
    (a file already at `path` is left as it was when none was written). close() is safe to
    call at any point and leaves a playable file of every frame written (`frames`), or, where
    the file could not be written (a full disk, a file-size limit), nothing: the partial file
    is removed, `path` is as it was and `error` says why. The file being written is held
    (paths.Held): one a killed writer left is removed by the next writer into its directory."""

    def __init__(self, path: str | Path, width: int, height: int, fps: int, rate: int):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(self.path.parent, f".{self.path.stem}.writing-*{self.path.suffix}")
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.stem}.writing-",
                                   suffix=self.path.suffix, dir=self.path.parent)
        os.close(fd)
        self.tmp = Path(tmp)
        self.held = Held(self.tmp)
        self.c = av.open(str(self.tmp), "w")
        self.v = self.c.add_stream("libx264", rate=fps)
        self.v.width, self.v.height, self.v.pix_fmt = width, height, "yuv420p"
        self.v.time_base = Fraction(1, fps)
        self.v.options = {"preset": "veryfast", "crf": "18"}
        self.a = self.c.add_stream("aac", rate=rate)
        self.a.layout = "mono"
        self.rate = rate
        self.frames = 0  # frames handed to the file so far
        self.samples = 0
        self.closed = False
        self.written = False  # the file is at `path`, holding `frames` frames
        self.error: str | None = None  # why it could not be written

    def write(self, frames: torch.Tensor, audio: torch.Tensor) -> None:
        """frames [N, 3, H, W] in [0, 1]; audio [samples] float32 for those frames. A write
        that fails (a full disk) raises MediaError and the file will not be written."""
        rgb = (frames.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
        try:
            for img in rgb:
                vf = av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format="rgb24")
                vf.pts = self.frames
                self.frames += 1
                for p in self.v.encode(vf):
                    self.c.mux(p)
            if audio.numel():
                af = av.AudioFrame.from_ndarray(audio.numpy().astype(np.float32)[None],
                                                format="flt", layout="mono")
                af.sample_rate, af.pts = self.rate, self.samples
                self.samples += audio.numel()
                for p in self.a.encode(af):
                    self.c.mux(p)
        except (OSError, av.FFmpegError) as e:
            self.error = _write_error(e)
            raise MediaError(f"{self.path}: could not be written ({self.error})") from None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.error is None:
                for s in (self.v, self.a):
                    for p in s.encode():
                        self.c.mux(p)
        except (OSError, av.FFmpegError) as e:
            self.error = _write_error(e)
        finally:
            try:
                self.c.close()
            except (OSError, av.FFmpegError) as e:
                self.error = self.error or _write_error(e)
            if self.frames and self.error is None:
                os.chmod(self.tmp, replacing_mode(self.path))
                os.replace(self.tmp, self.path)
                self.written = True
            else:
                self.tmp.unlink(missing_ok=True)
            self.held.release()


def replacing_mode(path: Path) -> int:
    """The mode a file written at `path` gets: the mode of the file it replaces, else a new
    file's (0o666 less the umask; mkstemp makes 0o600, which others could not read)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return 0o666 & ~current_umask()


def _write_error(e: Exception) -> str:
    """A failed write as a few words: the OS's reason (no space left on device, ...)."""
    code = getattr(e, "errno", None)
    return os.strerror(code) if code else str(e).strip().splitlines()[0]
