"""What one client may send a --serve session, and the account that holds it to that.

aiortc receives, decrypts and parses every packet a peer sends in Python, on the event loop
that every session's media shares: a connected client that floods its data channel, sends
its microphone faster than real time or sends ICE checks as fast as they go costs every
other session its frames (scripts/flood_neighbour.py measures it; docs/PERFORMANCE.md). So
each session keeps an account of what its client sends, in token buckets: a steady rate,
and a burst that may come at once above it (credit saved while quiet never exceeds the
burst). A client past any of them has its session ended, saying why.

The allowances leave a wide margin over what the real clients send. Measured on the tiny
LiveTalk engine (2026-12-07): the page in Chromium with its microphone sends about 5 kB and
58 packets a second, an aiortc client speaking at real time (as charengine.pipecat does)
about 11 kB and 62 packets, and each says one message on its data channel (the hello); over
30 s the page made 19 ICE checks (4 in its first second), the aiortc client 8. A browser
behind NAT, with IPv6 and a TURN server, checks a few dozen candidate pairs at the start.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Allowance:
    """A steady rate (per second) and a burst above it; `says` is why a session past it is
    ended, formatted with both."""

    per_s: float
    burst: float
    says: str

    def why(self) -> str:
        return self.says.format(per_s=self.per_s, burst=self.burst)


# what a client may send: kB and packets on its transport (every section of the offer is
# bundled on one), messages on its data channels (a channel's opening counts as one),
# seconds of audio from its microphone (real time, and a network's delay delivered at once),
# and ICE checks (STUN binding requests) to its transport's port, which ICE answers before
# any of the others counts a packet
ALLOWANCES = {
    "kB": Allowance(64.0, 256.0, "the client sent more than {per_s:g} kB a second"),
    "packets": Allowance(300.0, 1500.0, "the client sent more than {per_s:g} packets a second"),
    "messages": Allowance(10.0, 50.0, "the client sent more than {per_s:g} messages a second "
                                      "on its data channels"),
    "audio_s": Allowance(1.0, 5.0, "the client's microphone ran more than {burst:g} s ahead "
                                   "of real time"),
    "ice_checks": Allowance(20.0, 200.0, "the client sent more than {per_s:g} ICE checks a "
                                         "second"),
}


class Bucket:
    """A token bucket: full (the burst) at `now`, filled at per_s, never above the burst."""

    def __init__(self, allowance: Allowance, now: float):
        self.allowance, self.level, self.t = allowance, allowance.burst, now

    def take(self, amount: float, now: float) -> bool:
        """Spend `amount` at `now` (what was sent is owed, taken or not); False once the
        bucket is overdrawn."""
        a = self.allowance
        self.level = min(a.burst, self.level + max(0.0, now - self.t) * a.per_s) - amount
        self.t = max(self.t, now)
        return self.level >= 0


class ClientAccount:
    """One session's buckets, one per ALLOWANCES entry, full when the account is opened;
    `clock` tells the time in seconds."""

    def __init__(self, allowances: dict[str, Allowance] = ALLOWANCES,
                 clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        now = clock()
        self.buckets = {kind: Bucket(a, now) for kind, a in allowances.items()}
        self.totals = dict.fromkeys(allowances, 0.0)

    def spend(self, kind: str, amount: float) -> str | None:
        """Spend `amount` of `kind` now; None while within its allowance, else why not."""
        self.totals[kind] += amount
        if self.buckets[kind].take(amount, self.clock()):
            return None
        return self.buckets[kind].allowance.why()

    def spend_to(self, kind: str, total: float) -> str | None:
        """spend() for a count the transport keeps (its total so far)."""
        return self.spend(kind, max(0.0, total - self.totals[kind]))


def watch_ice_checks(pc, allow: Callable[[], bool]) -> int:
    """Puts `allow` before the answer to every ICE check (STUN request) that reaches `pc`'s
    transports: a check it returns False for goes unanswered. aiortc gives no public hold on
    them: aioice's connection, under each transport's ICE gatherer, answers them itself.
    Returns how many connections are watched (one: the offer bundles every section; 0 where
    an aiortc of another shape holds them elsewhere, which tests/test_client_bounds.py
    catches)."""
    transports = [t.receiver.transport for t in pc.getTransceivers()]
    if pc.sctp is not None:
        transports.append(pc.sctp.transport)
    found = (getattr(t.transport.iceGatherer, "_connection", None)
             for t in transports if t is not None)
    connections = {id(c): c for c in found if hasattr(c, "request_received")}
    for connection in connections.values():
        connection.request_received = _allowed(connection.request_received, allow)
    return len(connections)


def _allowed(answer: Callable, allow: Callable[[], bool]) -> Callable:
    def request_received(message, addr, protocol) -> None:
        if allow():
            answer(message, addr, protocol)
    return request_received
