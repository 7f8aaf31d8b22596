"""Handlers' guards over real hivemind peers on 127.0.0.1: a hostile peer with its own key
opens silent streams (slowloris), floods requests and announces a huge message; it is
refused and counted, its silent streams are cut at the read deadline, and an honest
peer is served meanwhile. On the code before the guard, the silent streams stayed open
and every request was served."""

from __future__ import annotations

import asyncio
import time

import pytest
from google.protobuf.wrappers_pb2 import BytesValue
from hivemind.p2p import P2P

from agora_node.comms import streams
from agora_node.comms.collective import RoundBook
from agora_node.comms.collective.handlers import Responder
from agora_node.comms.collective.p2p import CollectiveServicer
from agora_node.comms.guard import Guard, Limits
from agora_node.comms.membership.p2p import MembershipServicer
from tests.p2p_peers import start_peers, stop_p2p

pytestmark = [pytest.mark.timeout(60), pytest.mark.integration]
READ_DEADLINE_S = 1.5


async def _until(condition, timeout: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def _closed(reader: asyncio.StreamReader, timeout: float) -> bytes:
    """What the server sent before closing the stream (within `timeout`)."""
    return await asyncio.wait_for(reader.read(), timeout)


async def test_slowloris_streams_are_capped_and_cut_while_an_honest_peer_is_served() -> None:
    server = hostile = honest = None
    writers = []
    try:
        server, hostile, honest = await start_peers(3)
        guard = Guard(
            "echo",
            Limits(
                max_streams=16,
                max_streams_per_peer=3,
                rate_per_s=100,
                burst=100,
                read_deadline_s=READ_DEADLINE_S,
                deadline_s=30,
            ),
        )

        async def echo(remote: str, request: bytes):  # noqa: ANN202
            yield remote.encode() + b":" + request

        await streams.serve(server, "/agora/test/echo/1", echo, max_request=1024, guard=guard)
        opened = time.monotonic()
        silent = []
        for _ in range(6):  # twice the per-peer cap, sending nothing
            _, reader, writer = await hostile.call_binary_stream_handler(
                server.peer_id, "/agora/test/echo/1"
            )
            silent.append(reader)
            writers.append(writer)
        await _until(lambda: guard.refused["peer_streams"] == 3)
        assert guard.streams_of(hostile.peer_id.to_base58()) == 3
        # meanwhile an honest request is served, and the server names its sender by the
        # authenticated connection
        answer = await streams.request(
            honest, server.peer_id.to_base58(), "/agora/test/echo/1", b"ping", timeout=5
        )
        assert answer == honest.peer_id.to_base58().encode() + b":ping"
        assert guard.streams_of(hostile.peer_id.to_base58()) == 3  # still held, not yet cut
        sent = [await _closed(r, READ_DEADLINE_S + 5) for r in silent]
        cut_after = time.monotonic() - opened
        assert sum(streams.KIND_ERROR in s[:1] and b"peer_streams" in s for s in sent) == 3
        assert guard.refused["read_deadline"] == 3
        assert READ_DEADLINE_S <= cut_after < READ_DEADLINE_S + 5
        assert guard.active == 0
    finally:
        for w in writers:
            w.close()
        for p in (honest, hostile, server):
            await stop_p2p(p)


async def test_rpc_guards_refuse_a_flood_a_huge_message_and_a_silent_stream() -> None:
    server = hostile = honest = None
    try:
        server, hostile, honest = await start_peers(3)
        delivered: list[str] = []
        gossip_guard = Guard("membership", Limits(rate_per_s=1, burst=5))
        await MembershipServicer(
            lambda sender, data: delivered.append(sender), gossip_guard
        ).add_p2p_handlers(server, namespace="test-swim")
        stub = MembershipServicer.get_stub(hostile, server.peer_id, namespace="test-swim")
        failures = 0
        for _ in range(25):  # a flood: beyond the burst, the rate refuses it
            try:
                await stub.rpc_gossip(BytesValue(value=b"x"), timeout=5)
            except Exception:
                failures += 1
        assert gossip_guard.refused["rate"] == failures >= 19
        assert delivered == [hostile.peer_id.to_base58()] * (25 - failures)
        honest_stub = MembershipServicer.get_stub(honest, server.peer_id, namespace="test-swim")
        await honest_stub.rpc_gossip(BytesValue(value=b"y"), timeout=5)
        assert delivered[-1] == honest.peer_id.to_base58()

        # collective (streamed RPCs): a message announcing 1 GiB is refused on its length,
        # a stream that sends nothing is cut at the read deadline
        collective_guard = Guard("collective", Limits(read_deadline_s=READ_DEADLINE_S))
        servicer = CollectiveServicer(
            Responder(RoundBook(server.peer_id.to_base58())), 1 << 20, guard=collective_guard
        )
        await servicer.add_p2p_handlers(server, namespace="test-collective")
        push = CollectiveServicer._get_handle_name("test-collective", "rpc_push")
        fetch = CollectiveServicer._get_handle_name("test-collective", "rpc_fetch")
        _, reader, writer = await hostile.call_binary_stream_handler(server.peer_id, push)
        writer.write(P2P.MESSAGE_MARKER + (1 << 30).to_bytes(8, "big"))
        await writer.drain()
        await _closed(reader, 5)
        writer.close()
        assert collective_guard.refused["oversized"] == 1
        started = time.monotonic()
        _, reader, writer = await hostile.call_binary_stream_handler(server.peer_id, fetch)
        await _closed(reader, READ_DEADLINE_S + 5)
        writer.close()
        assert collective_guard.refused["read_deadline"] == 1
        assert time.monotonic() - started >= READ_DEADLINE_S
        assert collective_guard.active == 0
    finally:
        for p in (honest, hostile, server):
            await stop_p2p(p)
