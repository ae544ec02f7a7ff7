"""RunConfig: every input of one charrun invocation (what its flags give), and the mode they
select; and what --livekit reads from the environment (LiveKit's own variables)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .formats import DEFAULT_BACKGROUND
from .lifecycle import GRACE_PERIOD_S
from .probes import HEALTH_PORT

# a --serve session whose character has only listened this long ends (--idle-timeout): a tab
# left open would hold its place for good
IDLE_TIMEOUT_S = 600.0

MODES = ("check", "livekit", "serve", "render")
AUTO = "auto"  # --sessions auto: as many as the devices hold in real time
LIVEKIT_ENV = ("LIVEKIT_URL", "LIVEKIT_API_KEY", "LIVEKIT_API_SECRET")  # what --livekit reads


def livekit_setup_error() -> str | None:
    """What --livekit is missing to reach its LiveKit server (LIVEKIT_ENV), in one line."""
    missing = [v for v in LIVEKIT_ENV if not os.environ.get(v)]
    if missing:
        return f"set {', '.join(missing)} to the LiveKit server's URL and credentials"
    return None


@dataclass(frozen=True)
class RunConfig:
    """One charrun run. `engine_dir`: the engine charbuild wrote. A render reads `image` and
    `audio` and writes `out`, with `prompt` and the noise `seed`; `fit` and `background` say
    how the image becomes the model's frame (runtime/formats.py). `serve` streams over
    WebRTC on `host`:`port` (`ice_servers`: STUN/TURN URLs; `slack`: finished steps that may
    queue ahead of playback); `livekit` runs a LiveKit avatar worker registered as
    `agent_name`. Both serve probes (/healthz, /readyz, /metrics) on `host`:`health_port`, and
    SIGTERM drains them within `grace_period` seconds; a --serve session whose character has
    only listened for `idle_timeout` seconds ends (0: never); their ports answer to IP
    addresses, localhost and `allow_hosts`, and take state-changing requests from the page's
    own origin, `allow_origins` or no web page (runtime/access.py). `sessions`: the live
    sessions --serve runs at once over one copy of the engine (runtime/lanes.py), refused
    past what the machine holds in real time unless `over_capacity`; `batch`, the most of
    their steps that run as one batch when they wait together (1: each alone). `check`
    loads the engine, reports its start-up and exits."""

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
    health_port: int = HEALTH_PORT
    grace_period: float = GRACE_PERIOD_S
    idle_timeout: float = IDLE_TIMEOUT_S
    allow_hosts: tuple[str, ...] = ()
    allow_origins: tuple[str, ...] = ()
    sessions: int | str = 1  # a count, or AUTO
    over_capacity: bool = False
    batch: int = 1

    def __post_init__(self):
        for name in ("ice_servers", "allow_hosts", "allow_origins"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

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
