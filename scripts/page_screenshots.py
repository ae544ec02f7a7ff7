"""Remake the page's screenshots in docs/ (docs/serve_wide.png at 1280 px, docs/serve_phone.png
at 390 px): serve the shipped tiny character (charbuild --target cpu-tiny into a temporary
directory, unless --engine is given), drive the page in headless Chromium through the
browser test's tour, and copy its two screenshots.

    python scripts/page_screenshots.py [--engine engines/cpu-tiny] [--out docs]

WebRTC needs an address other than loopback that both ends share (aioice gathers no loopback
candidates): on a machine with none, run it inside a network namespace that has one, as
tests/test_serve.py does, with --netns NAME. Needs Debian's chromium and playwright.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_density import stop

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ("serve_wide.png", "serve_phone.png")
READY_TIMEOUT_S = 120
POLL_S = 0.5
TOUR_SECONDS = "3"
SPEECH_REPEATS = 3  # the demo speech, three times over: it outlasts the tour's reading


def _long_speech(path: Path) -> Path:
    import wave

    with wave.open(str(ROOT / "assets/speech.wav")) as w:
        params, frames = w.getparams(), w.readframes(w.getnframes())
    with wave.open(str(path), "wb") as w:
        w.setparams(params)
        w.writeframes(frames * SPEECH_REPEATS)
    return path


def _wait(url: str, prefix: list[str], server: subprocess.Popen, log: Path) -> None:
    end = time.monotonic() + READY_TIMEOUT_S
    probe = f"import urllib.request; urllib.request.urlopen({url!r})"
    while subprocess.run(prefix + [sys.executable, "-c", probe],
                         capture_output=True).returncode != 0:
        if server.poll() is not None:
            raise SystemExit(f"page_screenshots: charrun exited:\n{log.read_text()}")
        if time.monotonic() > end:
            raise SystemExit(f"page_screenshots: {url} did not answer in {READY_TIMEOUT_S} s")
        time.sleep(POLL_S)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path,
                    help="an engine directory (default: the shipped tiny character, built)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs")
    ap.add_argument("--port", type=int, default=8799)
    ap.add_argument("--health-port", type=int, default=8798)
    ap.add_argument("--netns", help="run the server and the browser in this network namespace")
    ap.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = ap.parse_args()
    prefix = ["ip", "netns", "exec", args.netns] if args.netns else []
    with tempfile.TemporaryDirectory(prefix="charengine-shots-") as tmp:
        tmp = Path(tmp)
        engine = args.engine
        if engine is None:
            engine = tmp / "cpu-tiny"
            subprocess.run([sys.executable, "-m", "charengine.builder.cli", "--target",
                            "cpu-tiny", "--out", str(engine)], check=True)
        notes = tmp / "notes.txt"
        notes.write_text("not a face, not a voice\n")
        url = f"http://127.0.0.1:{args.port}/"
        with open(tmp / "server.log", "w") as log:
            server = subprocess.Popen(prefix + [sys.executable, "-m", "charengine.runtime.cli",
                                                "--engine", str(engine), "--serve",
                                                "--port", str(args.port),
                                                "--health-port", str(args.health_port)],
                                      stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait(url, prefix, server, tmp / "server.log")
            subprocess.run(prefix + [sys.executable, str(ROOT / "tests/browser_client.py"),
                                     "--url", url, "--tour", str(tmp / "shots"),
                                     "--image", str(ROOT / "assets/face.png"),
                                     "--speech", str(_long_speech(tmp / "speech.wav")),
                                     "--not-image", str(notes), "--seconds", TOUR_SECONDS,
                                     "--chromium", args.chromium],
                           check=True, stdout=subprocess.DEVNULL)
        finally:
            stop(server)
        args.out.mkdir(parents=True, exist_ok=True)
        for name in SHOTS:
            shutil.copyfile(tmp / "shots" / name, args.out / name)
            print(args.out / name)


if __name__ == "__main__":
    main()
