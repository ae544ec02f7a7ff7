"""Sessions one after another through one server, as a day of users comes and goes: `charrun
--serve --sessions N` (and `--batch B`) started once, then `--waves` waves of N sessions at
once, each session ending one of four ways in turn: it runs to its end and closes, it is
stopped by its id halfway, its client vanishes halfway (killed: no goodbye), or it is
interrupted (a barge-in) halfway and runs on to its end. Sessions send speech in real time as
20 ms packets (bench_density's clients); the vanishing ones are separate processes
(tests/webrtc_client.py) so they can be killed.

After each wave, once /status reads no session, it records the server's resident memory,
open files, threads and GPU memory, and its child processes' (a TP engine's ranks), so a
leak shows as a rise wave over wave; the first wave's figures are the baseline (it makes
what is made once: pools, the lanes' graphs and buffers). The JSON gives every wave's
figures and every session's first frame and end, and the growth from the first wave to the
last.

    python scripts/soak.py --engine /tmp/tl --sessions 3 --batch 3 --waves 12 --netns \\
        --out docs/results/soak/soak_tiny-livetalk_cpu.json

WebRTC needs an address other than loopback (`--netns`: root and iproute2), as for
bench_density.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from charengine.provenance import provenance

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_density import Client, free_port, gpu_memory_mb, http, serve, stop  # noqa: E402

ENDINGS = ("full", "stop", "vanish", "barge-in")
SETTLE_S = 60.0  # the longest a wave's sessions may take to be gone after its clients end
QUIET_S = 1.0  # after /status reads no session, before the figures are read


def figures(pid: int) -> dict:
    """A process's and its children's resident memory (MB), open files and threads, and the
    process's GPU memory (None without a GPU)."""
    def one(p: psutil.Process) -> dict:
        with p.oneshot():
            return {"rss_mb": round(p.memory_info().rss / 2**20, 1), "fds": p.num_fds(),
                    "threads": p.num_threads()}

    proc = psutil.Process(pid)
    return {**one(proc), "gpu_memory_mb": gpu_memory_mb(pid),
            "children": [one(c) for c in proc.children(recursive=True)]}


async def vanishing(url: str, seconds: float) -> dict:
    """A client that streams, then is killed halfway through `seconds`."""
    p = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "tests" / "webrtc_client.py"), "--url", url + "/",
        "--seconds", str(seconds), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL)
    await asyncio.sleep(seconds / 2)
    ended_first = p.returncode is not None
    if not ended_first:
        p.kill()
    out, _ = await p.communicate()
    said = [json.loads(ln) for ln in out.decode().splitlines() if ln.strip()]
    first = next((s["t"] for s in said if s["kind"] == "streaming"), None)
    refused = next((s for s in said if s["kind"] == "refused"), None)
    return {"first_frame_s": first, "refused": refused,
            "ended_before_killed": said[-1] if ended_first and said else ended_first}


async def speaking(url: str, index: int, seconds: float, ending: str) -> dict:
    """A speaking client that ends as `ending` says (full, stop, barge-in)."""
    loop = asyncio.get_running_loop()
    c = Client(url, index, seconds)
    task = asyncio.ensure_future(c.run())
    acted = None
    if ending != "full":
        await asyncio.sleep(seconds / 2)
        if c.token is not None:
            path = "/stop" if ending == "stop" else "/interrupt"
            acted = (await loop.run_in_executor(None, http, url + path,
                                                {"session": c.token}))[0]
    await task
    return {"first_frame_s": c.first_frame_s, "frames": c.frames, "refused": c.refused,
            "acted": acted}


async def wave(url: str, n: int, seconds: float, w: int) -> list[dict]:
    endings = [ENDINGS[(w * n + i) % len(ENDINGS)] for i in range(n)]
    runs = [vanishing(url, seconds) if e == "vanish" else speaking(url, w * n + i, seconds, e)
            for i, e in enumerate(endings)]
    results = await asyncio.gather(*runs)
    return [{"ending": e, **r} for e, r in zip(endings, results)]


def settle(status_url: str) -> float | None:
    """Seconds until /status reads no session (None: not within SETTLE_S)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < SETTLE_S:
        status, body = http(status_url, timeout=10)
        if status == 200 and isinstance(body, dict) and body.get("active") == 0:
            return time.monotonic() - t0
        time.sleep(0.2)
    return None


def excerpts(log: str, context: int = 3) -> list[str]:
    """Each traceback in the server's log with the lines before it, up to the next logged
    line (one that starts with a date)."""
    lines, out = log.splitlines(), []
    for i, ln in enumerate(lines):
        if ln.startswith("Traceback"):
            end = next((j for j in range(i + 1, len(lines)) if lines[j][:2] == "20"),
                       len(lines))
            out.append("\n".join(lines[max(0, i - context):end]))
    return out


def growth(waves: list[dict]) -> dict:
    """The server's figures at the last wave less the first wave's."""
    first, last = waves[0]["server"], waves[-1]["server"]
    return {k: round(last[k] - first[k], 1) for k in ("rss_mb", "fds", "threads")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--sessions", type=int, default=3, help="the server's --sessions")
    ap.add_argument("--batch", type=int, default=1, help="the server's --batch")
    ap.add_argument("--waves", type=int, default=12)
    ap.add_argument("--seconds", type=float, default=12.0, help="each session's length")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--netns", action="store_true",
                    help="run inside a network namespace of its own (root, iproute2)")
    args = ap.parse_args(argv)
    if args.netns:
        sys.path.insert(0, str(ROOT / "tests"))
        from netns import namespace

        with namespace("charsk", "10.233.8") as name:
            rest = [a for a in (argv or sys.argv[1:]) if a != "--netns"]
            sys.exit(subprocess.call(["ip", "netns", "exec", name, sys.executable,
                                      str(Path(__file__).resolve()), *rest]))
    port, health = free_port(), free_port()
    url, status_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/status"
    log = tempfile.TemporaryFile("w+")
    server = serve(args.engine, args.sessions, args.batch, port, health, log=log)
    waves = []
    try:
        ready = {"server": figures(server.pid)}
        for w in range(args.waves):
            sessions = asyncio.run(wave(url, args.sessions, args.seconds, w))
            gone = settle(status_url)
            time.sleep(QUIET_S)
            waves.append({"wave": w, "settled_s": None if gone is None else round(gone, 2),
                          "server": figures(server.pid), "sessions": sessions})
            s = waves[-1]["server"]
            print(json.dumps({"wave": w, "settled_s": waves[-1]["settled_s"],
                              "rss_mb": s["rss_mb"], "fds": s["fds"], "threads": s["threads"],
                              "gpu_memory_mb": s["gpu_memory_mb"],
                              "children": s["children"],
                              "first_frames": [x["first_frame_s"] for x in sessions],
                              "refused": [x["refused"] for x in sessions if x["refused"]]}),
                  flush=True)
    finally:
        code = stop(server)
        log.seek(0)
        text = log.read()
    tracebacks = excerpts(text)
    for t in tracebacks:
        print(t, file=sys.stderr)
    doc = {"engine": os.path.abspath(args.engine), "sessions": args.sessions,
           "batch": args.batch, "seconds": args.seconds, **provenance(),
           "ready": ready, "waves": waves, "growth": growth(waves), "exit_code": code,
           "tracebacks": tracebacks}
    print(json.dumps({"growth": doc["growth"], "exit_code": code,
                      "tracebacks": len(tracebacks)}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
