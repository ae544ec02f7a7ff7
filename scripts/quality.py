"""Score generated clips (tinychar.quality): lip sync per clip (offset, confidence,
distance) and PSNR / SSIM between two runs of the same clips, with bootstrap intervals over
clips.

    python scripts/quality.py sync out/run1/*.mp4
    python scripts/quality.py compare out/run1 out/run2     # clips paired by file name
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import av
import numpy as np

from tinychar.quality import bootstrap, compare_runs, lip_sync
from charengine.runtime.media import read_audio

RATE = 16000


def frames_of(path: Path) -> tuple[np.ndarray, int]:
    with av.open(str(path)) as c:
        s = c.streams.video[0]
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(s)]), int(s.average_rate)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sync")
    s.add_argument("videos", nargs="+", type=Path)
    c = sub.add_parser("compare")
    c.add_argument("run_a", type=Path)
    c.add_argument("run_b", type=Path)
    args = ap.parse_args()
    out = {}
    if args.cmd == "sync":
        per = {}
        for v in args.videos:
            frames, fps = frames_of(v)
            r = lip_sync(frames, read_audio(v, RATE).numpy(), RATE, fps)
            per[v.name] = r.__dict__
        out = {"clips": per,
               "confidence": bootstrap([p["confidence"] for p in per.values()]),
               "distance": bootstrap([p["distance"] for p in per.values()]),
               "near": bootstrap([p["near"] for p in per.values()]),
               "offset_median": float(np.median([p["offset"] for p in per.values()]))}
    else:
        per = {}
        for a in sorted(args.run_a.glob("*.mp4")):
            b = args.run_b / a.name
            if b.exists():
                fa, fps = frames_of(a)
                fb, _ = frames_of(b)
                n = min(len(fa), len(fb))
                per[a.name] = compare_runs(fa[:n], fb[:n], fps)
        out = {"clips": per,
               "psnr": bootstrap([p["overall"]["psnr"] for p in per.values()]),
               "ssim": bootstrap([p["overall"]["ssim"] for p in per.values()])}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
