"""Many live characters on one machine, loaded as users load them: for each N, `charrun --serve
--sessions N` started afresh, N WebRTC clients (aiortc) joined one after another, each
sending speech in real time as 20 ms packets (turns of speech, silences between them and a
barge-in now and then) and receiving the character's video, for --minutes. Per N it writes
every session's stalls, chunk latency (a step's speech take to its first frames) p50 / p90 /
p99, speech to lips p50 / p90 (from the server's per-session metrics), join to first frame
(the client's offer to its first video frame), and the server's GPU memory; and
`sessions_realtime`, the largest N with no stall in any session and chunk latency p90 at
most CHUNK_P90_LIMIT_S. `--batch` compares the schedulers in the same call: 1, every step
alone, earliest deadline first; `n`, the steps that wait together batched up to N (charrun
--batch N), with the batches the server ran counted from its /metrics.

    charbuild --target h200-livetalk --random-weights --out /tmp/lt
    python scripts/bench_density.py --engine /tmp/lt --sessions 1,2,4,8 --minutes 10 \\
        --batch 1,n --out docs/results/livetalk/density_livetalk-1.3b_h200.json
    python scripts/bench_density.py --engine engines/cpu-tiny --sessions 1,2 --minutes 0.5

WebRTC needs an address other than loopback to gather candidates on: `--netns` (root and
iproute2) runs the server and the clients in a network namespace of their own. Every N's
server is started with --over-capacity, so an N past what the start-up check allows is still
measured.

`--out` is written after every run, so a call cut short keeps the runs it finished; `--resume`
keeps them and runs only the rest (one long run per call, where calls are time-limited).
"""

from __future__ import annotations

import argparse
import asyncio
import fractions
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import av
import numpy as np

from charengine.provenance import provenance

ROOT = Path(__file__).resolve().parents[1]
CHUNK_P90_LIMIT_S = 1.0  # a session is real time with no stall and its chunk p90 under this
PACKET_S = 0.02  # the clients' audio packets
RATE = 48000  # the clients' audio rate (WebRTC's Opus)
TURN_S, PAUSE_S = 6.0, 3.0  # a turn of speech, then silence
BARGE_IN_EVERY = 3  # every third turn is interrupted halfway
STAGGER_S = 2.0  # between one client's join and the next's
READY_TIMEOUT_S = 600.0
STOP_GRACE_S = 60.0  # a server's drain after SIGTERM, before it is killed


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 30.0):
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body else None,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def speech_turns(seconds: float, seed: int) -> np.ndarray:
    """A client's speech at RATE: turns of speech-like sound (formant syllables) with pauses."""
    from tinychar.synth import speech

    rng = np.random.default_rng(seed)
    out, t = [], 0.0
    while t < seconds:
        out.append(speech(TURN_S, RATE, rng)[0].astype(np.float32))
        out.append(np.zeros(int(PAUSE_S * RATE), np.float32))
        t += TURN_S + PAUSE_S
    return np.concatenate(out)[: int(seconds * RATE)]


class Client:
    """One user: a peer connection sending speech in real time and receiving video."""

    def __init__(self, url: str, index: int, seconds: float):
        self.url, self.index, self.seconds = url, index, seconds
        self.samples = speech_turns(seconds, index)
        self.first_frame_s: float | None = None
        self.frames = 0
        self.token = None
        self.barge_ins = 0
        self.refused: tuple | None = None

    def track(self):
        from aiortc.mediastreams import MediaStreamTrack

        client, n = self, int(PACKET_S * RATE)

        class Speech(MediaStreamTrack):
            kind = "audio"

            def __init__(self):
                super().__init__()
                self.sent, self.t0 = 0, None

            async def recv(self):
                if self.t0 is None:
                    self.t0 = time.monotonic()
                due = self.t0 + self.sent / RATE
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                chunk = client.samples[self.sent:self.sent + n]
                if len(chunk) < n:
                    chunk = np.zeros(n, np.float32)
                frame = av.AudioFrame.from_ndarray(
                    (np.clip(chunk, -1, 1) * 32767).astype(np.int16)[None], format="s16",
                    layout="mono")
                frame.sample_rate, frame.pts = RATE, self.sent
                frame.time_base = fractions.Fraction(1, RATE)
                self.sent += n
                return frame

        return Speech()

    async def run(self) -> None:
        from aiortc import RTCPeerConnection, RTCSessionDescription

        loop = asyncio.get_running_loop()
        pc = RTCPeerConnection()
        pc.addTrack(self.track())
        pc.addTransceiver("video", direction="recvonly")
        done = asyncio.Event()

        @pc.on("track")
        def on_track(track):
            if track.kind != "video":
                return

            async def play():
                while not done.is_set():
                    try:
                        await track.recv()
                    except Exception:  # noqa: BLE001 - the connection ended
                        return
                    if self.first_frame_s is None:
                        self.first_frame_s = time.monotonic() - t0
                    self.frames += 1

            asyncio.ensure_future(play())

        await pc.setLocalDescription(await pc.createOffer())
        t0 = time.monotonic()
        status, answer = await loop.run_in_executor(None, http, self.url + "/offer", {
            "sdp": pc.localDescription.sdp, "type": "offer"})
        if status != 200:
            self.refused = (status, answer)
            await pc.close()
            return
        self.token = answer["session"]
        await pc.setRemoteDescription(RTCSessionDescription(answer["sdp"], answer["type"]))
        turn = TURN_S + PAUSE_S
        k = 0
        while time.monotonic() - t0 < self.seconds:
            k += 1
            await asyncio.sleep(turn)
            if k % BARGE_IN_EVERY == 0:  # halfway into the next turn
                await asyncio.sleep(TURN_S / 2)
                await loop.run_in_executor(None, http, self.url + "/interrupt",
                                           {"session": self.token})
                self.barge_ins += 1
        done.set()
        await pc.close()


def gpu_memory_mb(pid: int) -> float | None:
    """The server process's GPU memory (nvidia-smi), or None without a GPU."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    used = [float(m) for p, m in (ln.split(",") for ln in out.splitlines() if "," in ln)
            if int(p) == pid]
    return sum(used) if used else None


def device_counts(metrics: str) -> dict[str, float]:
    """The server's steps and batches so far (charengine_device_*_total)."""
    found = re.findall(r"^charengine_device_(steps|batches)_total (\S+)$", metrics, re.M)
    return {name: float(value) for name, value in found}


def per_session(metrics: str) -> dict[str, dict]:
    """Each session's labelled series from /metrics: {session: {name: value or {q: value}}}."""
    out: dict[str, dict] = {}
    for ln in metrics.splitlines():
        m = re.match(r"charengine_session_(\w+)\{(.*)\} (\S+)$", ln)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m[2]))
            name, sid, q, v = m[1], labels["session"], labels.get("quantile"), float(m[3])
            if q is None:
                out.setdefault(sid, {})[name] = v
            else:
                out.setdefault(sid, {}).setdefault(name, {})[q] = v
    return out


async def load(url: str, n: int, seconds: float, probes: str, pid: int) -> dict:
    clients = [Client(url, i, seconds) for i in range(n)]
    tasks = []
    for c in clients:
        tasks.append(asyncio.ensure_future(c.run()))
        await asyncio.sleep(STAGGER_S)
    # the sessions' figures near the end, while every session still runs
    await asyncio.sleep(max(0.0, seconds - STAGGER_S * n - 2 * PAUSE_S))
    _, metrics = http(probes + "/metrics")
    memory = gpu_memory_mb(pid)
    await asyncio.gather(*tasks)
    metrics = metrics if isinstance(metrics, str) else ""
    figures = per_session(metrics)
    sessions = []
    for i, (sid, c) in enumerate(zip(sorted(figures, key=int), clients)):
        f = figures[sid]
        sessions.append({"session": sid, "join_to_first_frame_s": c.first_frame_s,
                         "frames": c.frames, "barge_ins": c.barge_ins,
                         "stalls": f.get("stalls"), "stall_s": f.get("stall_seconds"),
                         "chunk_latency_s": f.get("chunk_latency_seconds"),
                         "speech_to_lips_s": f.get("speech_latency_seconds"),
                         "step_s": f.get("step_seconds")})
    refused = [c.refused for c in clients if c.refused]
    realtime = len(sessions) == n and not refused and all(
        s["stalls"] == 0 and s["chunk_latency_s"] and
        s["chunk_latency_s"].get("0.9", np.inf) <= CHUNK_P90_LIMIT_S for s in sessions)
    return {"n": n, "sessions": sessions, "refused": refused, "gpu_memory_mb": memory,
            "device": device_counts(metrics), "realtime": realtime}


def serve(engine: str, n: int, batch: int, port: int, health_port: int,
          log=subprocess.DEVNULL) -> subprocess.Popen:
    """`charrun --serve --sessions n --batch batch` once ready (its output to `log`, an open
    file)."""
    p = subprocess.Popen([sys.executable, "-m", "charengine.runtime.cli", "--engine", engine,
                          "--serve", "--port", str(port), "--health-port", str(health_port),
                          "--sessions", str(n), "--batch", str(batch), "--over-capacity"],
                         stdout=log, stderr=subprocess.STDOUT)
    end = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < end:
        if p.poll() is not None:
            raise SystemExit(f"charrun --sessions {n} exited {p.returncode}")
        try:
            if http(f"http://127.0.0.1:{health_port}/readyz", timeout=2)[0] == 200:
                return p
        except OSError:
            pass
        time.sleep(0.5)
    p.kill()
    raise SystemExit(f"charrun --sessions {n} was not ready in {READY_TIMEOUT_S:.0f} s")


def stop(p: subprocess.Popen) -> int:
    """Stops a server as an orchestrator does: SIGTERM, SIGKILL if it has not exited within
    STOP_GRACE_S (no server outlives its run to hold the GPU under the next); its exit code
    (negative: the signal that ended it)."""
    p.terminate()
    try:
        return p.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        p.kill()
        return p.wait()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--sessions", default="1,2,4,8", help="the N to load, comma-separated")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--batch", default="1",
                    help="the schedulers, comma-separated: 1 (every step alone), n (batches "
                         "of up to each N), or a count (batches of up to it, at most N)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs --out already holds (same engine and minutes) and "
                         "run only the others")
    ap.add_argument("--netns", action="store_true",
                    help="run inside a network namespace of its own (root, iproute2)")
    args = ap.parse_args(argv)
    if args.netns:
        sys.path.insert(0, str(ROOT / "tests"))
        from netns import namespace

        with namespace("chardn", "10.233.7") as name:
            rest = [a for a in (argv or sys.argv[1:]) if a != "--netns"]
            sys.exit(subprocess.call(["ip", "netns", "exec", name, sys.executable,
                                      str(Path(__file__).resolve()), *rest]))
    kept = kept_runs(args.out, args.engine, args.minutes) if args.resume else []
    results = list(kept)
    for choice in args.batch.split(","):
        for n in (int(x) for x in args.sessions.split(",")):
            if any(r["n"] == n and r["scheduler"] == choice for r in kept):
                continue
            batch = n if choice == "n" else min(n, int(choice))
            port, health = free_port(), free_port()
            server = serve(args.engine, n, batch, port, health)
            try:
                r = asyncio.run(load(f"http://127.0.0.1:{port}", n, args.minutes * 60,
                                     f"http://127.0.0.1:{health}", server.pid))
            finally:
                stop(server)
            r["batch"], r["scheduler"] = batch, choice
            results.append(r)
            report(r)
            if args.out:  # after every run: a call cut short keeps the runs before it
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(summary(results, args.engine, args.minutes),
                                               indent=1) + "\n")
    doc = summary(results, args.engine, args.minutes)
    print(json.dumps({"sessions_realtime": doc["sessions_realtime"],
                      "by_batch": doc["sessions_realtime_by_batch"]}))


def summary(results: list[dict], engine: str, minutes: float) -> dict:
    """The results file: every run, and the largest real-time N overall and per scheduler."""
    held = [r["n"] for r in results if r["realtime"]]
    by = {c: max((r["n"] for r in results if r["realtime"] and r["scheduler"] == c), default=0)
          for c in dict.fromkeys(r["scheduler"] for r in results)}
    return {"engine": os.path.abspath(engine), "minutes": minutes,
            **provenance(), "chunk_p90_limit_s": CHUNK_P90_LIMIT_S,
            "sessions_realtime": max(held, default=0), "sessions_realtime_by_batch": by,
            "runs": results}


def kept_runs(out: Path | None, engine: str, minutes: float) -> list[dict]:
    """The runs an earlier call wrote to `out` for the same engine and minutes (--resume)."""
    if out is None or not out.exists():
        return []
    doc = json.loads(out.read_text())
    if doc.get("engine") != os.path.abspath(engine) or doc.get("minutes") != minutes:
        raise SystemExit(f"{out} holds runs of another engine or length: --resume keeps "
                         "only runs of this --engine and --minutes")
    return doc["runs"]


def report(r: dict) -> None:
    """One line of an N's run."""
    print(json.dumps({"n": r["n"], "batch": r["batch"], "device": r["device"],
                      "realtime": r["realtime"], "refused": r["refused"],
                      "memory_mb": r["gpu_memory_mb"],
                      "stalls": [s["stalls"] for s in r["sessions"]],
                      "chunk_p90_s": [(s["chunk_latency_s"] or {}).get("0.9")
                                      for s in r["sessions"]],
                      "first_frame_s": [s["join_to_first_frame_s"]
                                        for s in r["sessions"]]}), flush=True)


if __name__ == "__main__":
    main()
