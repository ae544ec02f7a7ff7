"""A visitor of a Pipecat bot on SmallWebRTCTransport, without a browser (aiortc), run by the
tests inside their network namespace: it offers to the bot's /api/offer (what Pipecat's
prebuilt page posts), sends a speech file as its microphone after --lead-s, receives the
bot's video and audio for --seconds (or, given --frames or --voiced-s, until it has that
many video frames and seconds of voice), and prints one JSON line: the video frames and
their size, the audio's seconds and its voiced seconds, and the connection's state at the
end (before the visitor closes it)."""

import argparse
import asyncio
import json
import time

import aiohttp
import av
import numpy as np
from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError

from charengine.pipecat import SpeechTrack
from charengine.pipecat.service import voiced

MIC_RATE = 48000
POLL_S = 0.1


def read_speech(path: str) -> np.ndarray:
    with av.open(path) as f:
        rs = av.AudioResampler(format="s16", layout="mono", rate=MIC_RATE)
        parts = [p.to_ndarray().reshape(-1) for fr in f.decode(audio=0) for p in rs.resample(fr)]
    return np.concatenate(parts)


async def main(args) -> None:
    pc = RTCPeerConnection()
    mic = SpeechTrack(MIC_RATE)
    pc.addTransceiver(mic, direction="sendrecv")
    pc.addTransceiver("video", direction="recvonly")
    got = {"frames": 0, "sizes": set(), "audio_s": 0.0, "voiced_s": 0.0, "first_frame_s": None}
    t0 = time.monotonic()

    async def play(track):
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            if track.kind == "video":
                got["frames"] += 1
                got["sizes"].add((frame.width, frame.height))
                if got["first_frame_s"] is None:
                    got["first_frame_s"] = round(time.monotonic() - t0, 3)
            else:
                seconds = frame.samples / frame.sample_rate
                got["audio_s"] += seconds
                if voiced(frame.to_ndarray().reshape(-1)):
                    got["voiced_s"] += seconds

    tasks = []
    pc.on("track", lambda track: tasks.append(asyncio.ensure_future(play(track))))
    await pc.setLocalDescription(await pc.createOffer())
    async with aiohttp.ClientSession() as http:
        async with http.post(args.url + "api/offer", json={
                "sdp": pc.localDescription.sdp, "type": "offer"}) as r:
            answer = await r.json()
    await pc.setRemoteDescription(RTCSessionDescription(answer["sdp"], answer["type"]))
    await asyncio.sleep(args.lead_s)
    mic.push(read_speech(args.speech))
    end = time.monotonic() + args.seconds - args.lead_s
    wanted = bool(args.frames or args.voiced_s)  # or all of --seconds
    while time.monotonic() < end and (not wanted or got["frames"] < args.frames or
                                      got["voiced_s"] < args.voiced_s):
        await asyncio.sleep(POLL_S)
    got["state"] = pc.connectionState
    await pc.close()
    for task in tasks:
        task.cancel()
    got["sizes"] = sorted(got["sizes"])
    got["audio_s"], got["voiced_s"] = round(got["audio_s"], 3), round(got["voiced_s"], 3)
    print(json.dumps(got), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True, help="the bot's runner, e.g. http://127.0.0.1:7860/")
    ap.add_argument("--speech", required=True)
    ap.add_argument("--lead-s", type=float, default=2.0)
    ap.add_argument("--seconds", type=float, default=10.0,
                    help="how long it receives (with --frames or --voiced-s: the most)")
    ap.add_argument("--frames", type=int, default=0, help="video frames to receive")
    ap.add_argument("--voiced-s", type=float, default=0.0, help="seconds of voice to receive")
    asyncio.run(main(ap.parse_args()))
