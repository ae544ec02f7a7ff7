"""Requests a client of charrun --serve can make, for the tests and scripts/fault_matrix.py:
speech as a data URL, an offer as the page makes it, an offer whose body has barely begun to
arrive, and an offer of many media sections."""

import asyncio
import base64
import io
import json
import socket
import wave

import numpy as np


def wav_data_url(rate: int, samples: int) -> str:
    """A silent 16-bit mono WAV of `samples` at `rate` Hz, as the page sends a file."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes(np.zeros(samples, np.int16).tobytes())
    return "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode()


def slow_upload(port: int, declared: int) -> socket.socket:
    """An offer to 127.0.0.1:port whose headers declare `declared` bytes and whose body has
    barely begun (one byte sent)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST /offer HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: "
              f"application/json\r\nContent-Length: {declared}\r\n\r\n{{".encode())
    return s


def answer_of(s: socket.socket, timeout_s: float = 30.0) -> tuple[str, bytes]:
    """(the response's head, its body) read from a socket whose request is answered with a
    JSON body."""
    s.settimeout(timeout_s)
    answer = b""
    while b"}" not in answer.partition(b"\r\n\r\n")[2]:
        chunk = s.recv(65536)
        if not chunk:
            break
        answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return head.decode(), body


def offer_sdp(*kinds: str, direction: str, events: bool = False) -> str:
    """The SDP of an offer aiortc makes with one transceiver of `direction` per kind in
    `kinds` and, with `events`, the page's data channel, from a client closed at once: it
    will never connect."""
    from aiortc import RTCPeerConnection

    async def make() -> str:
        pc = RTCPeerConnection()
        for kind in kinds:
            pc.addTransceiver(kind, direction=direction)
        if events:
            pc.createDataChannel("events")
        await pc.setLocalDescription(await pc.createOffer())
        sdp = pc.localDescription.sdp
        await pc.close()
        return sdp

    return asyncio.run(make())


def page_offer() -> bytes:
    """An offer's body as the page makes it (video and audio to receive, the events
    channel), from a client that will never connect."""
    sdp = offer_sdp("video", "audio", direction="recvonly", events=True)
    return json.dumps({"type": "offer", "sdp": sdp}).encode()


def offer_of_sections(n: int) -> bytes:
    """An offer's body whose SDP holds `n` audio media sections, each as aiortc offers one
    (about 1.2 kB), bundled together."""
    head, m, section = offer_sdp("audio", direction="sendonly").partition("m=audio")
    sections = "".join((m + section).replace("a=mid:0", f"a=mid:{k}") for k in range(n))
    head = head.replace("a=group:BUNDLE 0", "a=group:BUNDLE " + " ".join(map(str, range(n))))
    return json.dumps({"type": "offer", "sdp": head + sections}).encode()
