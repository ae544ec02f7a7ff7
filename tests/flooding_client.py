"""A WebRTC client of charrun --serve that sends more than a page does, run by the tests and
scripts/fault_matrix.py inside a network namespace of their own. It makes the page's offer
(video and audio to receive, the events channel; with a microphone for `audio` and
`real-time`), says the session's id on the events channel, and then sends, until the
session ends or --seconds pass:
- watch: nothing (it only watches, as a page nobody speaks to does);
- messages: small messages on the events channel, as fast as they go;
- kB: 60 kB messages, a few a second (fewer messages than the page may send, many bytes);
- audio: its microphone's audio as fast as it encodes (far faster than real time);
- real-time: its microphone at real time, as a person or a voice bot does (nothing more);
- stun: ICE binding requests on its connection's pair, signed with the session's ICE
  password as its own checks are, as fast as they go (the server answers each).
It prints one JSON line at the end: the session's end as the server told it ("why"), the
connection's state, and how much it sent (messages and bytes on the channel, ICE checks).
An offer refused: its status on stderr, exit 1."""

import argparse
import asyncio
import fractions
import json
import time

import av
import numpy as np
from aiortc import MediaStreamTrack, RTCPeerConnection, RTCSessionDescription

from webrtc_client import http

RATE = 48000  # the microphone's samples a second, as browsers send Opus
FRAME = 960  # 20 ms
LEVEL = 3000  # a voice's loudness, of 32767
SMALL = "x" * 16
LARGE = "x" * 60_000
LARGE_EVERY_S = 0.15
BATCH = 50  # small messages sent between yields to the loop
MAX_BUFFERED = 1 << 20  # what the channel may hold unsent before the flood waits


class Microphone(MediaStreamTrack):
    """Noise at a voice's level, paced at real time, or as fast as it is asked for."""

    kind = "audio"

    def __init__(self, real_time: bool):
        super().__init__()
        self.real_time, self.pts, self.t0 = real_time, 0, time.monotonic()
        self.noise = np.random.default_rng(0)

    async def recv(self) -> av.AudioFrame:
        if self.real_time:
            await asyncio.sleep(max(0.0, self.t0 + self.pts / RATE - time.monotonic()))
        else:
            await asyncio.sleep(0)  # the rest of the loop (the channel, RTCP) goes on
        pcm = (self.noise.standard_normal((1, FRAME)) * LEVEL).astype(np.int16)
        frame = av.AudioFrame.from_ndarray(pcm, format="s16", layout="mono")
        frame.sample_rate, frame.pts = RATE, self.pts
        frame.time_base = fractions.Fraction(1, RATE)
        self.pts += FRAME
        return frame


async def main(args) -> dict:
    pc = RTCPeerConnection()
    pc.addTransceiver("video", direction="recvonly")
    microphone = args.flood in ("audio", "real-time")
    if microphone:
        pc.addTransceiver(Microphone(args.flood == "real-time"), direction="sendrecv")
    else:
        pc.addTransceiver("audio", direction="recvonly")
    events = pc.createDataChannel("events")
    ended, got = asyncio.Event(), {"why": None, "ended": False}
    sent = {"messages": 0, "bytes": 0, "checks": 0}

    @events.on("message")
    def on_message(message):
        event = json.loads(message)
        if event.get("type") == "ended":
            got.update(ended=True, why=event.get("why"))
            ended.set()

    @pc.on("connectionstatechange")
    def on_state():
        if pc.connectionState in ("closed", "failed"):
            ended.set()

    @pc.on("track")
    def on_track(track):
        async def drain():
            while True:
                try:
                    await track.recv()
                except Exception:  # noqa: BLE001 - the track ended with the connection
                    return
        asyncio.ensure_future(drain())

    await pc.setLocalDescription(await pc.createOffer())
    status, answer = await asyncio.get_running_loop().run_in_executor(
        None, http, args.url + "offer", {"sdp": pc.localDescription.sdp, "type": "offer"})
    if status != 200:
        await pc.close()
        raise SystemExit(f"the offer was refused: {status} {answer}")
    events.on("open", lambda: events.send(json.dumps({"type": "hello",
                                                      "session": answer["session"]})))
    await pc.setRemoteDescription(RTCSessionDescription(answer["sdp"], answer["type"]))

    def send(message: str) -> None:
        events.send(message)
        sent["messages"] += 1
        sent["bytes"] += len(message)

    async def after_hello():
        while events.readyState != "open":
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # the hello first

    async def stun_flood():
        await after_hello()
        ice = pc.sctp.transport.transport.iceGatherer._connection  # aioice's, which checks
        pair = ice._nominated[1]
        key = ice.remote_password.encode("utf8")
        while pc.connectionState == "connected":
            for _ in range(BATCH):
                request = ice.build_request(pair, nominate=False)
                request.add_message_integrity(key)
                request.add_fingerprint()
                pair.protocol.send_stun(request, pair.remote_addr)
                sent["checks"] += 1
            await asyncio.sleep(0)

    async def flood():
        await after_hello()
        while events.readyState == "open":
            if events.bufferedAmount > MAX_BUFFERED:
                await asyncio.sleep(0.01)
            elif args.flood == "messages":
                for _ in range(BATCH):
                    send(SMALL)
                await asyncio.sleep(0)
            else:
                send(LARGE)
                await asyncio.sleep(LARGE_EVERY_S)

    flooder = {"messages": flood, "kB": flood, "stun": stun_flood}.get(args.flood)
    flooding = asyncio.ensure_future(flooder()) if flooder is not None else None
    try:
        await asyncio.wait_for(ended.wait(), args.seconds)
    except asyncio.TimeoutError:
        pass
    if flooding is not None:
        flooding.cancel()
    state = pc.connectionState
    await pc.close()
    return {**got, "state": state, **sent}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True, help="the page, e.g. http://127.0.0.1:8080/")
    ap.add_argument("--flood", required=True,
                    choices=("watch", "messages", "kB", "audio", "real-time", "stun"))
    ap.add_argument("--seconds", type=float, default=30.0)
    print(json.dumps(asyncio.run(main(ap.parse_args()))), flush=True)
