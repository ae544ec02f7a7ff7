"""A WebRTC client of charrun --serve without a browser (aiortc), run by the tests inside their
own network namespace: it sends the page's kind of offer (receive video and audio, an "events"
data channel), plays the stream, and prints one JSON line per thing that happens: its session
id once answered, "streaming" once video frames arrive (then, with --report, the frames so
far every --report seconds), each event the server sends, each /readyz state it polls, and
the peer connection's end. It exits when the connection ends or after --seconds."""

import argparse
import asyncio
import base64
import json
import time
import urllib.error
import urllib.request

from aiortc import RTCPeerConnection, RTCSessionDescription

READYZ_POLL_S = 0.1
FRAMES_BEFORE_STREAMING = 24


def say(kind: str, t0: float, **fields) -> None:
    print(json.dumps({"kind": kind, "t": round(time.monotonic() - t0, 3), **fields}), flush=True)


def http(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


async def main(args) -> None:
    t0 = time.monotonic()
    loop = asyncio.get_running_loop()
    pc = RTCPeerConnection()
    pc.addTransceiver("video", direction="recvonly")
    pc.addTransceiver("audio", direction="recvonly")
    events = pc.createDataChannel("events")
    ended = asyncio.Event()
    frames = [0]

    @events.on("message")
    def on_message(message):
        say("event", t0, event=json.loads(message), frames=frames[0])

    @pc.on("connectionstatechange")
    def on_state():
        say("connection", t0, state=pc.connectionState, frames=frames[0])
        if pc.connectionState in ("closed", "failed"):
            ended.set()

    @pc.on("track")
    def on_track(track):
        if track.kind != "video":
            return

        async def play():
            while True:
                try:
                    await track.recv()
                except Exception:  # noqa: BLE001 - the track ended with the connection
                    say("track-ended", t0, frames=frames[0])
                    ended.set()
                    return
                frames[0] += 1
                if frames[0] == FRAMES_BEFORE_STREAMING:
                    say("streaming", t0, frames=frames[0])

        asyncio.ensure_future(play())

    await pc.setLocalDescription(await pc.createOffer())
    offer = {"sdp": pc.localDescription.sdp, "type": "offer"}
    if args.image:
        with open(args.image, "rb") as f:
            offer["image"] = "data:image/png;base64," + base64.b64encode(f.read()).decode()
    status, answer = await loop.run_in_executor(None, http, args.url + "offer", offer)
    if status != 200:
        say("refused", t0, status=status, body=answer)
        return
    say("answered", t0, session=answer["session"])
    # the server sends the session's events once the channel has said the session's id
    events.on("open", lambda: events.send(json.dumps({"type": "hello",
                                                      "session": answer["session"]})))
    await pc.setRemoteDescription(RTCSessionDescription(answer["sdp"], answer["type"]))

    async def poll_readyz():
        last = None
        while True:
            try:
                status, body = await loop.run_in_executor(None, http, args.readyz)
                state = body.get("state")
            except OSError as e:  # the server has gone
                status, state = None, f"unreachable ({e})"
            if state != last:
                say("readyz", t0, status=status, state=state, frames=frames[0])
                last = state
            await asyncio.sleep(READYZ_POLL_S)

    async def report():
        while True:
            await asyncio.sleep(args.report)
            say("frames", t0, frames=frames[0])

    poller = asyncio.ensure_future(poll_readyz()) if args.readyz else None
    reporter = asyncio.ensure_future(report()) if args.report else None
    try:
        await asyncio.wait_for(ended.wait(), args.seconds)
    except asyncio.TimeoutError:
        say("timeout", t0, frames=frames[0])
    for task in (poller, reporter):
        if task is not None:
            task.cancel()
    await pc.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True, help="the page, e.g. http://127.0.0.1:8080/")
    ap.add_argument("--readyz", help="the probe server's /readyz, polled throughout")
    ap.add_argument("--image")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--report", type=float, default=0.0, help="seconds between frame counts")
    asyncio.run(main(ap.parse_args()))
