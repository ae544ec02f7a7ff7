"""What one client may send a --serve session (runtime/client_bounds.py): the buckets on a
clock the test sets, the microphone and the data channels as the server counts them, and a
real server whose clients flood it, inside a network namespace, next to one that speaks at
real time."""

import asyncio
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from aioice import stun
from aiortc import RTCPeerConnection

from charengine.runtime.client_bounds import (ALLOWANCES, Allowance, Bucket, ClientAccount,
                                              watch_ice_checks)
from charengine.runtime.server import Served, Server
from engines import ROOT, build_target
from netns import can_netns, end_server, in_ns, namespace, serve_in


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_bucket_takes_its_rate_for_ever_and_its_burst_once():
    a = Allowance(per_s=10.0, burst=50.0, says="")
    steady = Bucket(a, now=0.0)
    assert all(steady.take(1.0, now=k / 10) for k in range(1, 10_000))  # 10 a second
    burst = Bucket(a, now=0.0)
    assert all(burst.take(1.0, now=0.0) for _ in range(50)) and not burst.take(1.0, now=0.0)
    # quiet for an hour saves no more than the burst
    quiet = Bucket(a, now=0.0)
    assert quiet.take(50.0, now=3600.0) and not quiet.take(1.0, now=3600.0)
    assert quiet.take(1.0, now=3600.5)  # it fills again at the rate (the refused one owed)


def test_an_account_says_which_allowance_a_client_went_past():
    clock = Clock()
    account = ClientAccount(clock=clock)
    assert account.spend_to("kB", 256) is None  # its burst at once
    clock.t += 1.0
    assert account.spend_to("kB", 256 + 64) is None  # a second's rate
    assert account.spend_to("kB", 256 + 64 + 1) == "the client sent more than 64 kB a second"
    assert account.spend_to("packets", 1500) is None
    assert "300 packets a second" in account.spend("packets", 1)
    assert all(account.spend("messages", 1) is None for _ in range(50))
    assert account.spend("messages", 1) == ("the client sent more than 10 messages a second "
                                            "on its data channels")
    assert account.spend("audio_s", 5.0) is None
    assert account.spend("audio_s", 0.02) == ("the client's microphone ran more than 5 s ahead "
                                              "of real time")
    assert account.spend_to("ice_checks", 200) is None
    assert account.spend("ice_checks", 1) == "the client sent more than 20 ICE checks a second"
    assert set(ALLOWANCES) == {"kB", "packets", "messages", "audio_s", "ice_checks"}


def test_the_microphone_is_heard_until_it_runs_ahead_of_real_time():
    """Ten 1-second frames at one instant: the first five (the burst) are heard, then the
    session is ended saying why and nothing more is read."""
    import av
    import numpy as np

    rate = 16000
    frames = []
    for k in range(10):
        f = av.AudioFrame.from_ndarray(np.full((1, rate), 3000, np.int16), format="s16",
                                       layout="mono")
        f.sample_rate, f.pts = rate, k * rate
        frames.append(f)

    class Track:
        async def recv(self):
            if not frames:
                raise RuntimeError("ended")
            return frames.pop(0)

    heard, overran = [], []
    served = Served("t", 1, 0, SimpleNamespace(say=lambda x: heard.append(x.numel())), None,
                    account=ClientAccount(clock=Clock()))
    this = SimpleNamespace(worker=SimpleNamespace(spec=SimpleNamespace(
        side=SimpleNamespace(sample_rate=rate))),
        _overran=lambda s, why: overran.append(why))
    asyncio.run(Server._microphone(this, Track(), served))
    assert sum(heard) == 5 * rate, heard
    assert overran == ["the client's microphone ran more than 5 s ahead of real time"]
    assert len(frames) == 4  # the sixth was read, and refused; the rest were not read


def test_every_data_channel_message_counts_and_the_hello_still_works_within_them():
    clock = Clock()
    token = "Zm9vYmFyYmF6cXV4cXV1eA"
    served = Served(token, 1, 0, None, None, account=ClientAccount(clock=clock))
    overran = []
    this = SimpleNamespace(_overran=lambda s, why: overran.append(why))
    events, other = SimpleNamespace(label="events"), SimpleNamespace(label="chat")
    hello = json.dumps({"type": "hello", "session": token})
    Server._channel_said(this, served, other, hello)
    assert served.events is None  # a hello on another channel names nothing
    for _ in range(48):
        Server._channel_said(this, served, other, "x")
    Server._channel_said(this, served, events, hello)  # the 50th
    assert served.events is events and overran == []
    Server._channel_said(this, served, events, "x")
    assert overran == ["the client sent more than 10 messages a second on its data channels"]


def test_ice_checks_are_asked_for_and_one_refused_goes_unanswered():
    """The answering side's real ICE connection (aiortc's offer bundles its video and its
    data channel on one transport): each binding request asks the account first; the one it
    refuses gets no answer, the one it allows ICE's own (here 400: it names no user)."""
    async def main():
        offerer, answerer = RTCPeerConnection(), RTCPeerConnection()
        offerer.addTransceiver("video", direction="recvonly")
        offerer.createDataChannel("events")
        await offerer.setLocalDescription(await offerer.createOffer())
        await answerer.setRemoteDescription(offerer.localDescription)
        await answerer.setLocalDescription(await answerer.createAnswer())
        verdicts = iter([True, False, True])
        watched = watch_ice_checks(answerer, lambda: next(verdicts))
        connection = answerer.sctp.transport.transport.iceGatherer._connection
        sent = []
        protocol = SimpleNamespace(send_stun=lambda message, addr: sent.append(message))
        ids = []
        for _ in range(3):
            request = stun.Message(message_method=stun.Method.BINDING,
                                   message_class=stun.Class.REQUEST)
            ids.append(request.transaction_id)
            connection.request_received(request, ("10.0.0.1", 9), protocol)
        await offerer.close()
        await answerer.close()
        return watched, ids, sent

    watched, ids, sent = asyncio.run(main())
    assert watched == 1
    assert [m.transaction_id for m in sent] == [ids[0], ids[2]]
    assert all(m.message_class == stun.Class.ERROR and m.attributes["ERROR-CODE"][0] == 400
               for m in sent)


def test_an_aiortc_that_holds_its_checks_elsewhere_is_watched_nowhere_and_says_so():
    """A transport whose gatherer has no aioice connection where watch_ice_checks looks:
    nothing is wrapped and it says 0 (the server then logs that checks go uncounted)."""
    gatherer = SimpleNamespace(connection=SimpleNamespace(request_received=print))
    transport = SimpleNamespace(transport=SimpleNamespace(iceGatherer=gatherer))
    pc = SimpleNamespace(getTransceivers=lambda: [SimpleNamespace(receiver=SimpleNamespace(
        transport=transport))], sctp=None)
    assert watch_ice_checks(pc, lambda: False) == 0
    assert gatherer.connection.request_received is print


@pytest.mark.skipif(not can_netns(), reason="needs root (network namespaces) and iproute2")
def test_a_flooding_client_ends_its_own_session_and_a_real_time_one_is_kept(tmp_path):
    """A real server: clients that flood their data channel with messages or with bytes,
    send their microphone faster than real time, or send ICE checks as fast as they go
    (which ICE answers before the transport counts a packet), each have their session ended
    saying why (in the page's events and the log), and the slot is free again; a client
    speaking at real time for longer than every burst lasts is not ended."""
    engine = build_target(tmp_path)
    with namespace("charflood", "10.233.4") as ns:
        server, url = serve_in(ns, engine, 8790)
        # until /status reads ready: the engine loaded, or the last session's slot free
        ready = in_ns(ns, sys.executable, "-c", "import json, sys, time, urllib.request\n"
                      "for _ in range(1200):\n"
                      "    if json.load(urllib.request.urlopen(sys.argv[1]))['state'] == "
                      "'ready': print('ready'); break\n"
                      "    time.sleep(0.1)\n", url + "status")
        try:
            assert subprocess.run(ready, capture_output=True, text=True,
                                  timeout=150).stdout.strip() == "ready"
            got = {}
            for flood, seconds in (("messages", 60), ("kB", 60), ("audio", 60), ("stun", 60),
                                   ("real-time", 8)):
                r = subprocess.run(in_ns(ns, sys.executable, str(ROOT / "tests/flooding_client.py"),
                                         "--url", url, "--flood", flood, "--seconds",
                                         str(seconds)), capture_output=True, text=True,
                                   timeout=seconds + 60)
                assert r.returncode == 0, r.stderr
                got[flood] = json.loads(r.stdout.strip().splitlines()[-1])
                freed = subprocess.run(ready, capture_output=True, text=True, timeout=150)
                assert freed.stdout.strip() == "ready", (flood, freed.stderr)
        finally:
            out = end_server(server)
    assert "Traceback" not in out, out
    whys = {"messages": "the client sent more than 10 messages a second on its data channels",
            "kB": "the client sent more than 64 kB a second",
            "audio": "the client's microphone ran more than 5 s ahead of real time",
            "stun": "the client sent more than 20 ICE checks a second"}
    for flood, why in whys.items():
        assert got[flood]["ended"] and got[flood]["why"] == why, (flood, got[flood])
        assert f": {why}; ended" in out, out
    assert got["messages"]["messages"] > 50 and got["kB"]["bytes"] > 256_000, got
    assert got["stun"]["checks"] > 200, got
    assert not got["real-time"]["ended"] and got["real-time"]["state"] == "connected", got
    assert out.count("; ended") == 4, out
