"""charrun --serve's server in this process, its start-up as charrun's (the collector frozen
once the worker is ready), and an aiortc client of it (run by tests/test_sessions.py inside a
network namespace of its own: WebRTC needs an address other than loopback). Session after
session is opened, streamed and ended one way or another; each session's peer connection,
live session and served record are watched by weak references, and this prints, as one JSON
line, how many seconds after its end each was freed (null: not within FREED_WITHIN_S). The
test collects nothing itself: what frees them is the server's own doing.

    python tests/session_release.py ENGINE_DIR [--no-collect]

--no-collect replaces the server's collection after a session by nothing (what the test's
counterpart on old behaviour runs)."""

import argparse
import asyncio
import json
import time
import weakref

import aiohttp
from aiohttp import web
from aiortc import RTCPeerConnection, RTCSessionDescription

ENDINGS = ("stop", "client-closes")
FRAMES_BEFORE_ENDING = 8
STREAM_WITHIN_S = 60.0
FREED_WITHIN_S = 10.0


async def session(server, url: str, ending: str) -> dict:
    pc = RTCPeerConnection()
    pc.addTransceiver("video", direction="recvonly")
    pc.addTransceiver("audio", direction="recvonly")
    frames = [0]

    @pc.on("track")
    def on_track(track):
        async def play():
            while True:
                try:
                    await track.recv()
                except Exception:  # noqa: BLE001 - the track ended
                    return
                frames[0] += 1

        if track.kind == "video":
            asyncio.ensure_future(play())

    await pc.setLocalDescription(await pc.createOffer())
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/offer", json={"sdp": pc.localDescription.sdp,
                                                   "type": "offer"}) as r:
            answer = await r.json()
            assert r.status == 200, answer
        await pc.setRemoteDescription(RTCSessionDescription(answer["sdp"], answer["type"]))
        end = time.monotonic() + STREAM_WITHIN_S
        while frames[0] < FRAMES_BEFORE_ENDING:
            assert time.monotonic() < end, "no frames"
            await asyncio.sleep(0.1)
        (served,) = server.live.values()
        refs = {"peer connection": weakref.ref(served.pc),
                "live session": weakref.ref(served.session), "served": weakref.ref(served)}
        del served
        if ending == "stop":
            async with http.post(url + "/stop", json={"session": answer["session"]}) as r:
                assert r.status == 200, await r.text()
        else:
            await pc.close()
    while server.live:
        await asyncio.sleep(0.05)
    ended = time.monotonic()
    await pc.close()
    freed = {}
    while len(freed) < len(refs) and time.monotonic() - ended < FREED_WITHIN_S:
        for name, ref in refs.items():
            if name not in freed and ref() is None:
                freed[name] = round(time.monotonic() - ended, 2)
        await asyncio.sleep(0.05)
    return {name: freed.get(name) for name in refs}


async def main(engine_dir: str) -> dict:
    from charengine.runtime.engine import Engine
    from charengine.runtime.garbage import freeze_start_up
    from charengine.runtime.metrics import Metrics
    from charengine.runtime.server import Server
    from charengine.runtime.worker import Worker

    server = Server(Worker(Engine.load(engine_dir)), Metrics())
    freeze_start_up()
    runner = web.AppRunner(server.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = "http://127.0.0.1:%d" % site._server.sockets[0].getsockname()[1]
    try:
        return {ending: await session(server, url, ending) for ending in ENDINGS}
    finally:
        await server.close()
        await runner.cleanup()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("engine")
    ap.add_argument("--no-collect", action="store_true")
    args = ap.parse_args()
    if args.no_collect:
        from charengine.runtime import server as server_module

        server_module.collect_after_session = lambda: None
    print(json.dumps(asyncio.run(main(args.engine))), flush=True)
