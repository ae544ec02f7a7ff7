"""RunConfig: every input of one charrun invocation (what its flags give), and the mode they
select."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .formats import DEFAULT_BACKGROUND

MODES = ("check", "livekit", "serve", "render")


@dataclass(frozen=True)
class RunConfig:
    """One charrun run. `engine_dir`: the engine charbuild wrote. A render reads `image` and
    `audio` and writes `out`, with `prompt` and the noise `seed`; `fit` and `background` say
    how the image becomes the model's frame (runtime/formats.py). `serve` streams over
    WebRTC on `host`:`port` (`ice_servers`: STUN/TURN URLs; `slack`: finished steps that may
    queue ahead of playback); `livekit` runs a LiveKit avatar worker registered as
    `agent_name`; `check` loads the engine, reports its start-up and exits."""

    engine_dir: Path
    image: Path | None = None
    fit: str = "cover"
    background: str = DEFAULT_BACKGROUND
    audio: Path | None = None
    out: Path | None = None
    prompt: str = ""
    seed: int = 0
    serve: bool = False
    host: str = "127.0.0.1"
    port: int = 8080
    ice_servers: tuple[str, ...] = ()
    slack: int = 2
    livekit: bool = False
    agent_name: str = "charengine-avatar"
    check: bool = False

    def __post_init__(self):
        object.__setattr__(self, "ice_servers", tuple(self.ice_servers))

    @property
    def mode(self) -> str:
        """One of MODES: --check before anything, then --livekit, then --serve (a port given
        with --serve is checked even with --livekit), else a render."""
        if self.check:
            return "check"
        if self.livekit:
            return "livekit"
        if self.serve:
            return "serve"
        return "render"
