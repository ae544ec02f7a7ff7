"""Shared by the tests that render with an installed charengine (a wheel in a fresh virtual
environment, a container image): the MP4 that a render of the shipped demo media must give,
checked by decoding it back."""

import wave
from pathlib import Path

import av

from charengine.characters import audio as audio_mod
from charengine.characters.spec import PRESETS

ROOT = Path(__file__).resolve().parents[1]
FACE, SPEECH = ROOT / "assets/face.png", ROOT / "assets/speech.wav"
SPEC = PRESETS["tiny"]


def expected_frames(speech: Path = SPEECH) -> int:
    """Frames a tiny engine renders for `speech` (a WAV file): a latent's frames per step."""
    with wave.open(str(speech)) as w:
        n = w.getnframes() * SPEC.side.sample_rate // w.getframerate()
    return SPEC.frames_per_latent * audio_mod.steps_for(SPEC, n)


def check_mp4(path: Path, frames: int) -> None:
    """`path` decodes back to `frames` H.264 frames of the tiny engine's size at its rate,
    with AAC audio as long as the video (within a frame)."""
    with av.open(str(path)) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        assert (v.codec_context.name, a.codec_context.name) == ("h264", "aac")
        decoded = [f for f in c.decode(v)]
        assert len(decoded) == frames and v.average_rate == SPEC.fps
        assert (decoded[0].width, decoded[0].height) == (SPEC.out_w, SPEC.out_h)
        audio_s = float(a.duration * a.time_base)
    assert abs(audio_s - frames / SPEC.fps) <= 1 / SPEC.fps
