"""Two stand-in LiveKit rooms joined by an in-process loopback: participants, RPC and byte
streams, the parts of rtc.Room that LiveKit's avatar data-stream I/O and AvatarRunner use.
(No LiveKit server can run here; the real-server tests are opt-in.)"""

import asyncio
import inspect
import types
import uuid

from livekit import rtc


class Publication:
    def __init__(self, kind):
        self.kind = kind

    async def wait_for_subscription(self):
        return None


class RemoteView:
    """How one room sees the other's participant."""

    def __init__(self, identity, kind):
        self.identity, self.kind = identity, kind
        self.state = rtc.ParticipantState.PARTICIPANT_STATE_ACTIVE
        self.attributes, self.track_publications = {}, {}


class Reader:
    def __init__(self, attributes):
        self.info = types.SimpleNamespace(attributes=attributes, stream_id=uuid.uuid4().hex)
        self.queue: asyncio.Queue = asyncio.Queue()

    def __aiter__(self):
        return self

    async def __anext__(self):
        chunk = await self.queue.get()
        if chunk is None:
            raise StopAsyncIteration
        return chunk


class Writer:
    def __init__(self, readers):
        self.readers = readers

    async def write(self, data: bytes):
        for r in self.readers:
            r.queue.put_nowait(bytes(data))

    async def aclose(self):
        for r in self.readers:
            r.queue.put_nowait(None)


class LocalParticipant:
    def __init__(self, room, identity, kind):
        self.room, self.identity, self.kind = room, identity, kind
        self._rpc_handlers = {}
        self.published = []

    def register_rpc_method(self, method, handler=None):
        if handler is None:
            return lambda h: self.register_rpc_method(method, h)
        self._rpc_handlers[method] = handler
        return handler

    async def perform_rpc(self, *, destination_identity, method, payload, response_timeout=None):
        peer = self.room.peers[destination_identity]
        handler = peer.local_participant._rpc_handlers.get(method)
        if handler is None:
            raise rtc.RpcError(rtc.RpcError.ErrorCode.UNSUPPORTED_METHOD, "unsupported method")
        out = handler(rtc.RpcInvocationData(uuid.uuid4().hex, self.identity, payload,
                                            response_timeout or 10.0, method))
        return await out if inspect.isawaitable(out) else out

    async def publish_track(self, track, options):
        kind = (rtc.TrackKind.KIND_VIDEO if options.source == rtc.TrackSource.SOURCE_CAMERA
                else rtc.TrackKind.KIND_AUDIO)
        self.published.append(options.source)
        pub = Publication(kind)
        for peer in self.room.peers.values():
            view = peer.remote_participants[self.identity]
            view.track_publications[uuid.uuid4().hex] = pub
            peer.emit("track_published", pub, view)
        return pub

    async def stream_bytes(self, *, name, topic, destination_identities, attributes=None, **_):
        readers = []
        for ident in destination_identities:
            peer = self.room.peers[ident]
            reader = Reader(dict(attributes or {}))
            readers.append(reader)
            handler = peer.byte_handlers.get(topic)
            if handler is not None:
                handler(reader, self.identity)
        return Writer(readers)


class Room(rtc.EventEmitter):
    def __init__(self, name, identity, kind=rtc.ParticipantKind.PARTICIPANT_KIND_STANDARD):
        super().__init__()
        self.name = name
        self.local_participant = LocalParticipant(self, identity, kind)
        self.remote_participants, self.peers, self.byte_handlers = {}, {}, {}

    def isconnected(self):
        return True

    def register_byte_stream_handler(self, topic, handler):
        self.byte_handlers[topic] = handler


def pair(agent_identity="agent", avatar_identity="charengine-avatar"):
    """An agent's room and the avatar's room, each seeing the other participant."""
    agent = Room("test-room", agent_identity, rtc.ParticipantKind.PARTICIPANT_KIND_AGENT)
    avatar = Room("test-room", avatar_identity, rtc.ParticipantKind.PARTICIPANT_KIND_AGENT)
    for a, b in ((agent, avatar), (avatar, agent)):
        a.peers[b.local_participant.identity] = b
        a.remote_participants[b.local_participant.identity] = RemoteView(
            b.local_participant.identity, b.local_participant.kind)
    return agent, avatar
