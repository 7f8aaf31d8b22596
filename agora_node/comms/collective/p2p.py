"""The collective over hivemind P2P: one servicer, five RPCs, frames streamed in chunks.

Unary libp2p messages are capped at 4 MiB, so every frame travels as a stream of
~1 MiB chunks: `push` streams in (one reply), `fetch` and `query` stream out;
`check` (a nonce in, a sketch of 72 bytes out) and `inventory` (a members mask in, a
mask and the parts' signed entries out) are unary. To a peer reached only
through a relay (comms/relay.py: libp2p circuits carry 128 KiB), each request goes
whole as one request of comms/streams.py instead (`outer_stream_protocol`), which the
relay passes on, and the servicer answers it the same way. The
message type is built at import time from a descriptor, so no generated _pb2 file
or protoc run is needed. The sender's identity is the libp2p peer id of the
connection (authenticated by libp2p's secure channel), never a field in the message.

Run it beside a hivemind.DHT by sharing the DHT's daemon, in the caller's loop:

    p2p = await dht.replicate_p2p()
    servicer = CollectiveServicer(responder, max_frame_bytes)
    await servicer.add_p2p_handlers(p2p, namespace=ns)
    transport = P2PTransport(p2p, namespace=ns)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

# typing.AsyncIterator, not collections.abc: hivemind detects streaming RPCs by `hint._name`
from typing import AsyncIterator  # noqa: UP035

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from hivemind.p2p import P2P, P2PContext, PeerID

from agora_node.comms import streams
from agora_node.comms.admission import record_holders_only
from agora_node.comms.collective.handlers import (
    MAX_WAIT,
    MEMBER_REFUSALS,
    NOT_LISTED,
    Responder,
)
from agora_node.comms.collective.proofs import MAX_PROOFS_BYTES, MAX_RECEIPT_BYTES, MAX_RECEIPTS
from agora_node.comms.collective.verify import NONCE_BYTES
from agora_node.comms.collective.wire import Code, Header, Reply, rejected
from agora_node.comms.guard import Guard, Limits, Reason
from agora_node.comms.guarded_rpc import GuardedServicer
from agora_node.protocol.names import outer_stream_protocol

CHUNK_BYTES = 1 << 20


def _message_class() -> type:
    f = descriptor_pb2.FieldDescriptorProto
    fields = [
        ("code", f.TYPE_UINT32),
        ("round", f.TYPE_UINT64),
        ("phase", f.TYPE_STRING),
        ("group_id", f.TYPE_BYTES),
        ("span", f.TYPE_UINT32),
        ("attempt", f.TYPE_UINT32),
        ("weight", f.TYPE_DOUBLE),
        ("wait", f.TYPE_DOUBLE),
        ("data", f.TYPE_BYTES),
        ("total", f.TYPE_UINT64),
        ("reason", f.TYPE_STRING),
        ("members", f.TYPE_BYTES),
        ("signature", f.TYPE_BYTES),
        ("proofs", f.TYPE_BYTES),
        ("receipt", f.TYPE_BYTES),
    ]
    proto = descriptor_pb2.FileDescriptorProto(
        name="agora_collective.proto", package="agora.collective", syntax="proto3"
    )
    msg = proto.message_type.add(name="CollectiveMessage")
    for number, (name, kind) in enumerate(fields, 1):
        msg.field.add(name=name, number=number, type=kind, label=f.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName("agora.collective.CollectiveMessage")
    )


CollectiveMessage = _message_class()


def _request(code: Code, header: Header, data: bytes = b"", total: int = 0) -> CollectiveMessage:
    return CollectiveMessage(
        code=int(code),
        round=header.round,
        phase=header.phase,
        group_id=header.group_id,
        span=header.span,
        attempt=header.attempt,
        weight=header.weight,
        wait=header.wait,
        data=data,
        total=total,
        signature=header.signature,
    )


def _header(msg: CollectiveMessage) -> Header:
    return Header(
        msg.round,
        msg.phase,
        msg.group_id,
        msg.span,
        msg.attempt,
        msg.weight,
        msg.wait,
        bytes(msg.signature),
    )


def _reply_chunks(reply: Reply) -> list[CollectiveMessage]:
    data = memoryview(reply.payload)
    head = CollectiveMessage(
        code=int(reply.code),
        attempt=reply.attempt,
        weight=reply.weight,
        reason=reply.reason,
        members=reply.members,
        proofs=reply.proofs,
        receipt=reply.receipt,
        total=len(data),
        data=bytes(data[:CHUNK_BYTES]),
    )
    rest = range(CHUNK_BYTES, len(data), CHUNK_BYTES)
    return [head, *(CollectiveMessage(data=bytes(data[i : i + CHUNK_BYTES])) for i in rest)]


def _reply(head: CollectiveMessage, payload: bytes) -> Reply:
    """The reply a head message (and its payload) carries, its signed fields bounded."""
    if len(head.proofs) > MAX_PROOFS_BYTES:
        raise ValueError("reply carries too many proofs")
    if len(head.receipt) > MAX_RECEIPTS * MAX_RECEIPT_BYTES:
        raise ValueError("reply carries too long a receipt")
    return Reply(
        Code(head.code),
        payload,
        head.attempt,
        head.weight,
        head.reason,
        bytes(head.members),
        bytes(head.proofs),
        bytes(head.receipt),
    )


async def _read_reply(stream: AsyncIterator[CollectiveMessage], limit: int) -> Reply:
    head = await anext(stream)
    if head.total > limit:
        raise ValueError(f"reply of {head.total} bytes exceeds {limit}")
    buf = bytearray(head.data)
    async for msg in stream:
        buf += msg.data
        if len(buf) > head.total:
            raise ValueError("reply longer than announced")
    if len(buf) != head.total:
        raise ValueError("reply shorter than announced")
    return _reply(head, bytes(buf))


async def _discard(stream: AsyncIterator[CollectiveMessage], left: int) -> None:
    async for msg in stream:
        left -= len(msg.data)
        if left < 0:
            return


LIMITS = Limits(
    # a member has a few requests open to another per phase (its pushes, fetches, checks
    # and queries to that member, two phases may overlap): far below these
    max_streams=256,
    max_streams_per_peer=32,
    rate_per_s=100.0,
    burst=400.0,
    read_deadline_s=10.0,
    drain_deadline_s=30.0,
    deadline_s=MAX_WAIT + 180.0,  # the longest wait a request may ask, then its transfer
)
MAX_MESSAGE_BYTES = CHUNK_BYTES + MAX_PROOFS_BYTES + MAX_RECEIPTS * MAX_RECEIPT_BYTES + (16 << 10)
"""One message: a chunk, the signed entries a reply may carry, and the other fields."""


class CollectiveServicer(GuardedServicer):
    """Hands requests to a Responder; refuses frames above `max_frame_bytes` while reading.
    Registered behind a Guard (comms/guarded_rpc.py): admission by the remote peer id,
    deadlines, request messages capped at MAX_MESSAGE_BYTES."""

    max_message = MAX_MESSAGE_BYTES

    def __init__(
        self, responder: Responder, max_frame_bytes: int, *, guard: Guard | None = None
    ) -> None:
        self.responder, self.max_frame_bytes = responder, max_frame_bytes
        self.guard = guard or Guard("collective", LIMITS)
        self._reading: set[tuple] = set()
        """Pushes being read: (sender, round, phase, group, span, attempt). One sender's
        32 streams of the same part held 32 buffers of it until their deadline."""

    async def rpc_push(
        self, requests: AsyncIterator[CollectiveMessage], context: P2PContext
    ) -> CollectiveMessage:
        first = await anext(requests)
        if first.total > self.max_frame_bytes:
            return _reply_chunks(rejected("oversized"))[0]
        sender = context.remote_id.to_base58()
        # membership, span, lateness and size are checked on the first chunk: nothing more
        # of a push that will be refused is read into memory
        refusal = await self.responder.admit_push(sender, _header(first), first.total)
        if refusal is not None:
            if refusal.reason in MEMBER_REFUSALS:
                # a member (late, say): read the rest without keeping it, so its client gets
                # the answer rather than a broken stream it would take for a failure
                await _discard(requests, first.total - len(first.data))
            return _reply_chunks(refusal)[0]
        header = _header(first)
        with self._reading_one(sender, header) as alone:
            if not alone:
                await _discard(requests, first.total - len(first.data))
                return _reply_chunks(rejected("duplicate"))[0]
            buf = bytearray(first.data)
            async for msg in requests:
                buf += msg.data
                if len(buf) > first.total:
                    return _reply_chunks(rejected("longer than announced"))[0]
            reply = await self.responder.on_push(sender, header, bytes(buf))
        return _reply_chunks(reply)[0]

    @contextlib.contextmanager
    def _reading_one(self, sender: str, header: Header) -> Iterator[bool]:
        """Whether this is the only push of its part from `sender` being read (then held as
        such until the block ends): one member's 32 streams of one part were each read,
        hashed, checked and decoded."""
        key = (sender, header.round, header.phase, header.group_id, header.span, header.attempt)
        if key in self._reading:
            yield False
            return
        self._reading.add(key)
        try:
            yield True
        finally:
            self._reading.discard(key)

    async def serve_streams(
        self, p2p: P2P, namespace: str, *, known: Callable[[str], bool] | None = None
    ) -> None:
        """Answer whole requests on `outer_stream_protocol` (those that came through a
        relay), behind the same guard as the RPCs.

        Such a request is read whole (up to a frame) before it can be parsed, so who may
        send one is decided first, on the sender alone: a peer a private swarm's allow list
        names, and then one `known` names (the daemon: a record read at this stage
        recently) or a member of a collective this member registered. Others are refused
        before anything is read, counted as `no_record`. known None: anyone (tests)."""
        await streams.serve(
            p2p,
            outer_stream_protocol(namespace),
            self._on_stream_request,
            max_request=self.max_frame_bytes + MAX_MESSAGE_BYTES,
            guard=self.guard,
            refuse=record_holders_only(
                self._unlisted,
                lambda peer: known is None or known(peer) or self.responder.book.has_member(peer),
                lambda peer: self.guard.refuse(Reason.NO_RECORD, peer),  # counted
            ),
        )

    def _unlisted(self, peer: str) -> str | None:
        admit = self.responder.admit
        return NOT_LISTED if admit is not None and not admit(peer) else None

    async def stop_streams(self, p2p: P2P, namespace: str) -> None:
        await streams.unserve(p2p, outer_stream_protocol(namespace))

    async def _on_stream_request(self, sender: str, request: bytes) -> AsyncIterator[bytes]:
        reply = await self._answer_whole(sender, request)
        for msg in _reply_chunks(reply):
            yield msg.SerializeToString()

    async def _answer_whole(self, sender: str, request: bytes) -> Reply:
        try:
            msg = CollectiveMessage.FromString(request)
            code = Code(msg.code)
        except Exception:  # protobuf's DecodeError, or a code we do not know
            return rejected("malformed")
        header = _header(msg)
        if code == Code.PART:
            if msg.total != len(msg.data) or msg.total > self.max_frame_bytes:
                return rejected("oversized" if msg.total > self.max_frame_bytes else "length")
            with self._reading_one(sender, header) as alone:
                if not alone:
                    return rejected("duplicate")
                refusal = await self.responder.admit_push(sender, header, msg.total)
                return refusal or await self.responder.on_push(sender, header, bytes(msg.data))
        if code == Code.FETCH:
            return await self.responder.on_fetch(sender, header)
        if code == Code.QUERY:
            return await self.responder.on_query(sender, header)
        if code == Code.CHECK:
            nonce, members = bytes(msg.data[:NONCE_BYTES]), bytes(msg.members)
            return await self.responder.on_check(sender, header, nonce, members)
        if code == Code.INVENTORY:
            return await self.responder.on_inventory(sender, header, bytes(msg.members))
        return rejected("malformed")

    async def rpc_fetch(
        self, request: CollectiveMessage, context: P2PContext
    ) -> AsyncIterator[CollectiveMessage]:
        reply = await self.responder.on_fetch(context.remote_id.to_base58(), _header(request))
        for msg in _reply_chunks(reply):
            yield msg

    async def rpc_query(
        self, request: CollectiveMessage, context: P2PContext
    ) -> AsyncIterator[CollectiveMessage]:
        reply = await self.responder.on_query(context.remote_id.to_base58(), _header(request))
        for msg in _reply_chunks(reply):
            yield msg

    async def rpc_check(self, request: CollectiveMessage, context: P2PContext) -> CollectiveMessage:
        reply = await self.responder.on_check(
            context.remote_id.to_base58(),
            _header(request),
            bytes(request.data[:NONCE_BYTES]),
            bytes(request.members),
        )
        return _reply_chunks(reply)[0]

    async def rpc_inventory(
        self, request: CollectiveMessage, context: P2PContext
    ) -> CollectiveMessage:
        reply = await self.responder.on_inventory(
            context.remote_id.to_base58(), _header(request), bytes(request.members)
        )
        return _reply_chunks(reply)[0]


class P2PTransport:
    """Calls other members' CollectiveServicer through a (replicated) hivemind P2P."""

    def __init__(self, p2p: P2P, *, namespace: str, max_frame_bytes: int) -> None:
        self.p2p, self.namespace, self.max_frame_bytes = p2p, namespace, max_frame_bytes
        self._stubs: dict[str, object] = {}
        self._stream_name = outer_stream_protocol(namespace)

    async def _whole(self, peer: str, request: CollectiveMessage) -> Reply:
        """One request sent whole through the peer's relay; its reply (servicer's
        `serve_streams`)."""
        frames = streams.request_stream(
            self.p2p,
            peer,
            self._stream_name,
            request.SerializeToString(),
            timeout=LIMITS.deadline_s,  # the round's own deadlines end it sooner
            max_response=MAX_MESSAGE_BYTES,
            max_total=2 * self.max_frame_bytes + MAX_MESSAGE_BYTES,  # a reply, its framing
        )

        async def messages() -> AsyncIterator[CollectiveMessage]:
            async for frame in frames:
                yield CollectiveMessage.FromString(frame)

        return await _read_reply(messages(), self.max_frame_bytes)

    def _stub(self, peer: str):  # noqa: ANN202 - a generated stub type
        stub = self._stubs.get(peer)
        if stub is None:
            stub = CollectiveServicer.get_stub(
                self.p2p, PeerID.from_base58(peer), namespace=self.namespace
            )
            self._stubs[peer] = stub
        return stub

    async def push(self, peer: str, header: Header, payload: bytes) -> Reply:
        if streams.relayed(self.p2p, peer):
            reply = await self._whole(peer, _request(Code.PART, header, payload, len(payload)))
            return Reply(reply.code, b"", reply.attempt, reply.weight, reply.reason)

        async def chunks() -> AsyncIterator[CollectiveMessage]:
            data = memoryview(payload)
            yield _request(Code.PART, header, bytes(data[:CHUNK_BYTES]), total=len(data))
            for i in range(CHUNK_BYTES, len(data), CHUNK_BYTES):
                yield CollectiveMessage(data=bytes(data[i : i + CHUNK_BYTES]))

        msg = await self._stub(peer).rpc_push(chunks())
        return Reply(Code(msg.code), b"", msg.attempt, msg.weight, msg.reason)

    async def fetch(self, peer: str, header: Header) -> Reply:
        if streams.relayed(self.p2p, peer):
            return await self._whole(peer, _request(Code.FETCH, header))
        stream = await self._stub(peer).rpc_fetch(_request(Code.FETCH, header))
        return await _read_reply(stream, self.max_frame_bytes)

    async def query(self, peer: str, header: Header) -> Reply:
        if streams.relayed(self.p2p, peer):
            return await self._whole(peer, _request(Code.QUERY, header))
        stream = await self._stub(peer).rpc_query(_request(Code.QUERY, header))
        return await _read_reply(stream, self.max_frame_bytes)

    async def check(self, peer: str, header: Header, nonce: bytes, members: bytes) -> Reply:
        request = _request(Code.CHECK, header, nonce)
        request.members = members
        return await self._unary(peer, request, "rpc_check")

    async def inventory(self, peer: str, header: Header, members: bytes) -> Reply:
        request = _request(Code.INVENTORY, header)
        request.members = members
        return await self._unary(peer, request, "rpc_inventory")

    async def _unary(self, peer: str, request: CollectiveMessage, rpc: str) -> Reply:
        """A request answered in one small message (a sketch, an inventory)."""
        if streams.relayed(self.p2p, peer):
            reply = await self._whole(peer, request)
        else:
            msg = await getattr(self._stub(peer), rpc)(request)
            reply = _reply(msg, bytes(msg.data))
        if len(reply.payload) > 1024:
            raise ValueError("reply too long for a sketch or an inventory")
        return reply
