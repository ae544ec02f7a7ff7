"""What charrun reads and writes, as data (no media library imported here, so the command
line and `--check` stay light): the image bounds and fit policies, the video containers."""

from __future__ import annotations

import base64
import binascii
import io
import re
from dataclasses import dataclass
from pathlib import Path

from charengine.paths import not_a_file


class MediaError(ValueError):
    pass


UPLOAD = "upload"  # what a reader's message names a file given as bytes


def source_of(src: str | Path | bytes):
    """(what a media library opens, a name for messages) for a path or a file's bytes."""
    if isinstance(src, (bytes, bytearray)):
        return io.BytesIO(src), UPLOAD
    path = Path(src)
    if (why := not_a_file(path)) is not None:
        raise MediaError(f"{path}: {why}")
    return str(path), str(path)


def upload_message(e: MediaError) -> str:
    """A reader's message about a file given as bytes, without the name it gave the file
    ("upload: ") and the in-memory file's repr a library quoted: for the caller to say
    which file it was."""
    text = re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-f]+>", "", str(e))
    return text.removeprefix(f"{UPLOAD}: ")


def data_url_bytes(url, what: str) -> bytes | None:
    """The bytes of a data: URL, as the page and a LiveKit dispatch send a file (None for
    none given); MediaError naming `what` for anything else and for an empty file."""
    if not url:
        return None
    if not isinstance(url, str) or not url.startswith("data:") or "," not in url:
        raise MediaError(f"{what}: expected a data: URL")
    try:
        data = base64.b64decode(url.split(",", 1)[1], validate=False)
    except (binascii.Error, ValueError):
        raise MediaError(f"{what}: the data URL is not valid base64") from None
    if not data:
        raise MediaError(f"{what}: the file is empty; choose another")
    return data


def prompt_problem(prompt: str) -> str | None:
    """Why a prompt is refused, said after its name (one line), None when it is taken."""
    if len(prompt) > MAX_PROMPT_CHARS:
        return (f"is {len(prompt):,} characters long; at most {MAX_PROMPT_CHARS:,} are taken "
                "(the text encoder reads a few hundred tokens)")
    return None


VIDEO_SUFFIXES = (".mp4", ".m4v", ".mov", ".mkv")  # containers that carry H.264 + AAC

# The containers speech is read from, by FFmpeg's demuxer names (a file's format is still
# found by probing it, among these alone: FFmpeg's format_whitelist): WAV (and Wave64), AIFF,
# CAF, MP3, ADTS AAC, Ogg, FLAC, MP4/M4A/MOV, Matroska/WebM and AVI. FFmpeg has some three
# hundred more, each a parser an upload could reach for nothing.
AUDIO_DEMUXERS = ("wav", "w64", "aiff", "caf", "mp3", "aac", "ogg", "flac", "mov", "matroska",
                  "avi")
# The audio codecs speech is decoded from (FFmpeg's decoder names), in any of those
# containers: PCM, MP3, AAC, Opus, Vorbis, FLAC, ALAC. Other decoders are not opened, in
# probing (FFmpeg's codec_whitelist) or after.
AUDIO_CODECS = ("pcm_s16le", "pcm_s16be", "pcm_s24le", "pcm_s24be", "pcm_s32le", "pcm_s32be",
                "pcm_f32le", "pcm_f32be", "pcm_f64le", "pcm_u8", "pcm_alaw", "pcm_mulaw",
                "mp3", "mp3float", "aac", "opus", "libopus", "vorbis", "flac", "alac")
AUDIO_CODECS_SAID = "PCM, MP3, AAC, Opus, Vorbis, FLAC or ALAC"
AUDIO_FORMATS_SAID = ("WAV, AIFF, CAF, MP3, AAC, Ogg (Vorbis, Opus), FLAC, M4A or MP4, WebM "
                      "or MKV, AVI")

# Speech is refused before it is decoded where its declared sample rate lies outside this
# range (resampling 1 Hz to 16 kHz multiplies a file 16,000-fold) or its declared length is
# over the cap, and while it is decoded once it holds more than the cap: a render's speech
# (MAX_SPEECH_S, 3 hours: 691 MB of 16 kHz float32) and an upload to --serve
# (MAX_UPLOAD_SPEECH_S, 10 minutes).
MIN_SAMPLE_RATE = 8_000
MAX_SAMPLE_RATE = 192_000
MAX_SPEECH_S = 3 * 3600.0
MAX_UPLOAD_SPEECH_S = 600.0

FIT_POLICIES = {
    "cover": "scaled to cover the frame, centre-cropped",
    "contain": "scaled to fit inside the frame, the rest filled with the background",
    "stretch": "scaled to the frame's shape, its aspect not kept",
}
# Larger images are refused before they are decoded (a 40-megapixel RGBA image decodes to
# 160 MB); smaller ones, below this fraction of the model's frame on either side, would be
# enlarged past recognition.
MAX_IMAGE_PIXELS = 40_000_000
MIN_IMAGE_FRACTION = 0.25
# The formats a reference image is read in: the ones photographs come in. Pillow opens some
# forty more, among them EPS, which it hands to Ghostscript, and scientific and legacy
# formats no face photo uses: each a decoder an upload could reach for nothing.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "AVIF", "GIF", "BMP", "TIFF")
DEFAULT_BACKGROUND = "#ffffff"
MAX_QUOTED = 40  # a field's value longer than this is not quoted back in its refusal
MAX_SHOWN = 80  # a name a message shows (a file's, a page's origin) is cut to this
EXIF_ORIENTATION = 0x0112
# A prompt is read by a text encoder of a few hundred tokens (umT5: 512, some 2,000 to 3,000
# characters of English); a longer one is refused rather than cleaned and tokenized whole
# under the side networks' lock, where every live session's audio and decoding wait (a 60 MB
# prompt: 7.6 s of a CPU core for the tiny LiveTalk encoder alone).
MAX_PROMPT_CHARS = 10_000


def stream_audio_problem(rate: int, channels: int) -> str | None:
    """Why audio frames streamed at `rate` Hz with `channels` channels (a voice agent's, a
    TTS's) cannot be taken, None if they can: the rates speech files are taken at, mono or
    stereo."""
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        return (f"{rate:,} Hz, outside {MIN_SAMPLE_RATE:,} to {MAX_SAMPLE_RATE:,} Hz (send it "
                "at the usual 16, 24 or 48 kHz)")
    if channels not in (1, 2):
        return f"{channels} channels (send it mono or stereo)"
    return None


def quoted(text: str) -> str:
    """A field's value as its refusal names it: quoted, or its length where it is long."""
    return repr(text) if len(text) <= MAX_QUOTED else f"of {len(text):,} characters"


def cut(text: str) -> str:
    """A name as a message shows it: its first MAX_SHOWN characters, "..." after a longer one."""
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "..."


def parse_colour(text: str) -> tuple[int, int, int]:
    """'#rrggbb' (or a colour name Pillow knows) -> (r, g, b)."""
    from PIL import ImageColor  # Pillow: imported when a colour is parsed

    try:
        return ImageColor.getrgb(text)[:3]
    except ValueError:
        raise MediaError(f"background {quoted(text)}: not a colour; give #rrggbb or a colour "
                         "name") from None


@dataclass(frozen=True)
class ImageFit:
    """How a reference image becomes the model's frame: the fit policy (FIT_POLICIES) and
    the colour that transparent pixels (and contain's margins) are laid on."""
    policy: str = "cover"
    background: str = DEFAULT_BACKGROUND

    def __post_init__(self):
        if self.policy not in FIT_POLICIES:
            raise MediaError(f"fit {quoted(self.policy)}: one of {', '.join(FIT_POLICIES)}")
        parse_colour(self.background)
