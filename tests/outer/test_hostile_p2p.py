"""Over real hivemind peers on 127.0.0.1: a push from a peer outside the group is refused
on its first chunk, before the rest of its frame is read (main buffered the whole frame,
then checked membership)."""

import asyncio
import contextlib
import os
import signal

import pytest

from agora_node.comms.collective import GroupPlan, RoundBook
from agora_node.comms.collective.handlers import Responder
from agora_node.comms.collective.p2p import (
    CHUNK_BYTES,
    CollectiveMessage,
    CollectiveServicer,
    _request,
)
from agora_node.comms.collective.wire import Code, Header

pytestmark = [pytest.mark.timeout(120), pytest.mark.integration]
NAMESPACE = "agora-test-hostile"
CHUNKS = 8


class Watching(Responder):
    """Notes when the servicer first asks about a push (either hook), and how."""

    def __init__(self, book: RoundBook) -> None:
        super().__init__(book)
        self.decided = asyncio.Event()
        self.asked: list[str] = []

    async def admit_push(self, sender, header, total):  # noqa: ANN001, ANN201
        self.asked.append("admit_push")
        self.decided.set()
        return await super().admit_push(sender, header, total)

    async def on_push(self, sender, header, payload):  # noqa: ANN001, ANN201
        self.asked.append("on_push")
        self.decided.set()
        return await super().on_push(sender, header, payload)


async def _stop(p2p) -> None:  # noqa: ANN001
    child = getattr(p2p, "_child", None)
    pid = child.pid if child is not None else None
    with contextlib.suppress(Exception):
        await asyncio.wait_for(p2p.shutdown(), 15)
    if pid is not None and child.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def test_a_non_members_push_is_refused_before_it_is_buffered() -> None:
    from hivemind.p2p import P2P

    owner = stranger = None
    try:
        owner = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        maddrs = await owner.get_visible_maddrs()
        stranger = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        me = owner.peer_id.to_base58()
        # a group of the owner and another member; the stranger computed its group id
        plan = GroupPlan(
            round=3, phase="delta", members=(me, "12D3KooWOtherMember"), numel=1 << 22, block=256
        )
        book = RoundBook(me)
        book.register(plan)
        responder = Watching(book)
        servicer = CollectiveServicer(responder, max_frame_bytes=64 << 20)
        await servicer.add_p2p_handlers(owner, namespace=NAMESPACE)

        held_back = {"timed_out": False}
        header = Header(3, "delta", plan.group_id, 0, 0, weight=1.0, wait=1.0)
        chunk = b"\0" * CHUNK_BYTES

        async def chunks():  # noqa: ANN202
            yield _request(Code.PART, header, chunk, total=CHUNKS * CHUNK_BYTES)
            # the rest is sent only once the owner has decided (or after 10 s, as main needs)
            try:
                await asyncio.wait_for(responder.decided.wait(), 10)
            except TimeoutError:
                held_back["timed_out"] = True
            for _ in range(CHUNKS - 1):
                yield CollectiveMessage(data=chunk)

        stub = CollectiveServicer.get_stub(stranger, owner.peer_id, namespace=NAMESPACE)
        try:
            reply = await asyncio.wait_for(stub.rpc_push(chunks()), 60)
        except (BrokenPipeError, ConnectionError):
            pass  # the owner answered and closed the stream: its sender sees a broken pipe
        else:
            assert (Code(reply.code), reply.reason) == (Code.REJECTED, "not a member")
        assert not held_back["timed_out"], "the owner read the whole frame before deciding"
        assert responder.asked == ["admit_push"]
        assert book.states[(3, "delta")].stats.rejected["not a member"] == 1
        assert book.states[(3, "delta")].stats.bytes_received == 0

        # a member's refused push (here: the wrong span) still gets a clean answer: the
        # owner reads and drops the rest, so the member does not take it for a failure
        theirs = GroupPlan(
            round=3,
            phase="anchor",
            members=(me, stranger.peer_id.to_base58()),
            numel=1 << 20,
            block=256,
        )
        book.register(theirs)
        wrong_span = Header(3, "anchor", theirs.group_id, 1, 0, weight=1.0, wait=1.0)

        async def frame():  # noqa: ANN202
            yield _request(Code.PART, wrong_span, chunk, total=2 * CHUNK_BYTES)
            yield CollectiveMessage(data=chunk)

        reply = await asyncio.wait_for(stub.rpc_push(frame()), 60)
        assert (Code(reply.code), reply.reason) == (Code.REJECTED, "not my span")
    finally:
        for p2p in (stranger, owner):
            if p2p is not None:
                await _stop(p2p)


async def test_a_whole_request_through_a_relay_is_read_only_from_known_peers() -> None:
    """Requests to a relayed member come whole (outer_stream_protocol) and are read into
    memory before they can be parsed: main read a stranger's up to a frame's size first.
    Now the sender must be one the daemon knows at the stage, or a member of a collective
    this member registered; others are refused before anything is read, and counted."""
    from hivemind.p2p import P2P

    from agora_node.comms import streams
    from agora_node.protocol.names import outer_stream_protocol

    owner = stranger = None
    try:
        owner = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        maddrs = await owner.get_visible_maddrs()
        stranger = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        me, them = owner.peer_id.to_base58(), stranger.peer_id.to_base58()
        book = RoundBook(me)
        responder = Watching(book)
        servicer = CollectiveServicer(responder, max_frame_bytes=64 << 20)
        known: set[str] = set()
        await servicer.serve_streams(owner, NAMESPACE, known=known.__contains__)
        plan = GroupPlan(round=3, phase="delta", members=(me, them), numel=1 << 16, block=256)
        header = Header(3, "delta", plan.group_id, 0, 0, weight=1.0, wait=0.0)
        push = _request(Code.PART, header, b"\0" * 1024, total=1024).SerializeToString()

        async def send() -> CollectiveMessage:
            frame = await streams.request(
                stranger, me, outer_stream_protocol(NAMESPACE), push, timeout=30
            )
            return CollectiveMessage.FromString(frame)

        with pytest.raises(streams.RefusedError, match="announce a record"):
            await send()
        assert responder.asked == [] and servicer.guard.refused["no_record"] == 1

        known.add(them)  # a record at the stage: read, and answered (no round registered)
        reply = await send()
        assert Code(reply.code) is Code.REJECTED and responder.asked == ["admit_push"]

        known.clear()
        book.register(plan)  # a member of a registered collective, record or not
        reply = await send()  # read, admitted as a member, then its bytes parsed
        assert responder.asked[1:] == ["admit_push", "on_push"], reply.reason
        assert servicer.guard.refused["no_record"] == 1
    finally:
        for p2p in (stranger, owner):
            if p2p is not None:
                await _stop(p2p)
