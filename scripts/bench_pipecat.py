"""A Pipecat bot's turn latency and barge-in time through `charengine.pipecat`, on the path
a bot runs: `charrun --serve` started afresh on --engine, and `scripts/pipecat_turns.py` (a
pipeline of a TTS-like source, `CharacterVideoService` and a recording sink) run against it
for turns of speech with the TTS streaming at real time, then in bursts (4x real time), then
barge-ins. Turn latency is from a turn's first TTS audio entering the service to the first
voiced audio of the character leaving it (its frames leave with it); the barge-in time from
the interruption to the last voiced audio leaving, and the seconds of voiced audio that left
after it. Prints and writes the medians.

    python scripts/bench_pipecat.py --engine engines/cpu-tiny --netns
    charbuild --target h200-livetalk --random-weights --out /tmp/lt
    python scripts/bench_pipecat.py --engine /tmp/lt --netns \\
        --out docs/results/pipecat/turns_livetalk-1.3b_h200.json

WebRTC needs an address other than loopback: `--netns` (root and iproute2) runs the server
and the bot in a network namespace of their own."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from charengine.provenance import provenance

from bench_density import free_port, serve, stop

ROOT = Path(__file__).resolve().parents[1]
SPEECH_S = 4.0  # each turn: a procedural speech clip of this long
SEED = 424242


def media(folder: Path) -> tuple[Path, Path]:
    """A face and a speech clip the tiny character was trained on the kind of."""
    import soundfile as sf
    from PIL import Image

    sys.path.insert(0, str(ROOT))
    from tinychar.synth import clip

    c = clip(SPEECH_S, 64, np.random.default_rng(SEED))
    image, speech = folder / "face.png", folder / "speech.wav"
    Image.fromarray(c.frames[0]).save(image)
    sf.write(speech, c.audio, c.sample_rate)
    return image, speech


def turns(url: str, image: Path, speech: Path, *extra: str) -> dict:
    r = subprocess.run([sys.executable, str(ROOT / "scripts/pipecat_turns.py"), "--url", url,
                        "--image", str(image), "--speech", str(speech), "--quiet", *extra],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"pipecat_turns.py {' '.join(extra)} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def median(values):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 4) if values else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--turns", type=int, default=5, help="turns per TTS speed")
    ap.add_argument("--barge-ins", type=int, default=5)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--netns", action="store_true",
                    help="run inside a network namespace of its own (root, iproute2)")
    args = ap.parse_args(argv)
    if args.netns:
        sys.path.insert(0, str(ROOT / "tests"))
        from netns import namespace

        with namespace("charpc", "10.233.8") as name:
            rest = [a for a in (argv or sys.argv[1:]) if a != "--netns"]
            sys.exit(subprocess.call(["ip", "netns", "exec", name, sys.executable,
                                      str(Path(__file__).resolve()), *rest]))
    port, health = free_port(), free_port()
    server = serve(args.engine, n=1, batch=1, port=port, health_port=health)
    url = f"http://127.0.0.1:{port}/"
    doc = {"engine": os.path.abspath(args.engine), **provenance()}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            image, speech = media(Path(tmp))
            for name, speed in (("realtime", 1), ("burst", 4)):
                r = turns(url, image, speech, "--turns", str(args.turns), "--tts-speed",
                          str(speed))
                lat = [t["latency_s"] for t in r["turns"]]
                doc[name] = {"tts_speed": speed, "latency_s": lat,
                             "latency_median_s": median(lat)}
                doc["engine_info"] = r["engine"]
                print(json.dumps({name: doc[name]}), flush=True)
            barge = [turns(url, image, speech, "--scenario", "interrupt")
                     for _ in range(args.barge_ins)]
            times = [(b["interrupt"] or {}).get("last_voiced_after_s") for b in barge]
            voiced = [(b["interrupt"] or {}).get("voiced_audio_after_s") for b in barge]
            doc["barge_in"] = {"last_voiced_after_s": times, "median_s": median(times),
                               "max_s": max((t for t in times if t is not None), default=None),
                               "voiced_audio_after_s": voiced,
                               "voiced_audio_median_s": median(voiced)}
            print(json.dumps({"barge_in": doc["barge_in"]}), flush=True)
    finally:
        stop(server)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
