"""What one client that sends more than a page does costs the session beside it: `charrun
--serve --sessions 2` with one session playing to a client that only watches
(tests/webrtc_client.py), and beside it, for `--seconds`, one of:
- alone: nothing (the baseline);
- watch: a second client that only watches (what a second session costs by itself);
- real-time: a second client speaking at real time (a person, a voice bot);
- messages, kB, audio, stun: a client flooding its data channel with small messages,
  sending 60 kB messages, sending its microphone as fast as it encodes, or sending ICE
  checks signed with its session's password as fast as they go (tests/flooding_client.py).
The second client runs at the lowest CPU priority (nice 19), so on a machine of few cores
what it costs the first session is the server's doing, not its own. Each arm runs --runs
times; the JSON has every run and each arm's medians: the first session's stalls and their
seconds (the server's own count, from the events it sends), the server's CPU over the
window (100 = one core) and how the second session ended.

    python scripts/flood_neighbour.py --engine /tmp/tl --runs 3 --netns \\
        --out docs/results/flood_neighbour_tiny-livetalk_cpu.json

WebRTC needs an address other than loopback (`--netns`: root and iproute2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from charengine.provenance import provenance

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_density import free_port, serve, stop  # noqa: E402

ARMS = ("alone", "watch", "real-time", "messages", "kB", "audio", "stun")
WARM_S = 2.0  # the first session plays this long before the second comes
TAIL_S = 3.0  # and this long after the window
STREAMING_TIMEOUT_S = 60.0


def cpu_s(pid: int) -> float:
    """User and system seconds of a process and its children so far."""
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def one_run(engine: str, arm: str, seconds: float) -> dict:
    port, health = free_port(), free_port()
    server = serve(engine, 2, 1, port, health)
    url = f"http://127.0.0.1:{port}/"
    lines: list[str] = []
    try:
        victim = subprocess.Popen([sys.executable, str(ROOT / "tests/webrtc_client.py"), "--url",
                                   url, "--seconds", str(WARM_S + seconds + TAIL_S)],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        threading.Thread(target=lambda: lines.extend(iter(victim.stdout.readline, "")),
                         daemon=True).start()
        end = time.monotonic() + STREAMING_TIMEOUT_S
        while not any('"streaming"' in ln for ln in lines) and time.monotonic() < end:
            time.sleep(0.05)
        time.sleep(WARM_S)
        cpu0, t0 = cpu_s(server.pid), time.monotonic()
        second = None
        if arm != "alone":
            second = subprocess.Popen(["nice", "-n", "19", sys.executable,
                                       str(ROOT / "tests/flooding_client.py"), "--url", url,
                                       "--flood", arm, "--seconds", str(seconds)],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      text=True)
        time.sleep(seconds)
        cpu = (cpu_s(server.pid) - cpu0) / (time.monotonic() - t0) * 100
        got = {}
        if second is not None:
            out = second.communicate(timeout=60)[0].strip().splitlines()
            got = json.loads(out[-1]) if out else {}
        victim.wait(60)
    finally:
        stop(server)
    stats = [json.loads(ln)["event"] for ln in lines
             if '"kind": "event"' in ln and '"stats"' in ln]
    last = stats[-1] if stats else {}
    return {"arm": arm, "stalls": last.get("stalls"), "stall_s": last.get("stall_s"),
            "playback_fps": last.get("playback_fps"), "server_cpu_pct": round(cpu, 1),
            "second_ended": got.get("why"), "second_sent_bytes": got.get("bytes"),
            "second_sent_checks": got.get("checks")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0, help="the second client's window")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--netns", action="store_true",
                    help="run inside a network namespace of its own (root, iproute2)")
    args = ap.parse_args(argv)
    if args.netns:
        sys.path.insert(0, str(ROOT / "tests"))
        from netns import namespace

        with namespace("charfn", "10.233.8") as name:
            rest = [a for a in (argv or sys.argv[1:]) if a != "--netns"]
            sys.exit(subprocess.call(["ip", "netns", "exec", name, sys.executable,
                                      str(Path(__file__).resolve()), *rest]))
    runs = []
    for _ in range(args.runs):
        for arm in args.arms.split(","):
            runs.append(one_run(args.engine, arm, args.seconds))
            print(json.dumps(runs[-1]), flush=True)
    medians = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm]
        medians[arm] = {k: statistics.median(r[k] for r in mine)
                        for k in ("stalls", "stall_s", "server_cpu_pct")}
        medians[arm]["second_ended"] = sorted({str(r["second_ended"]) for r in mine})
    doc = {"engine": str(Path(args.engine).resolve()), "seconds": args.seconds,
           "runs_per_arm": args.runs, **provenance(), "medians": medians, "runs": runs}
    print(json.dumps(medians, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
