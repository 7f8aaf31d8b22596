"""Requests through a relay of our own (comms/relay.py) over real hivemind peers on
127.0.0.1: the caller, the relay and the target each with their own key. The target
serves the request as the caller's (never the relay's), the answer comes back whole and
checked, and a relay cannot pass on what it may not: a request to a peer with no direct
connection to it, or anything when its operator turned relaying off. What a hostile
relay could do to a request or an answer is checked in test_relay_checks.py."""

from __future__ import annotations

import os

import pytest
from hivemind.p2p import P2P

from agora_node.comms import streams
from agora_node.comms.relay import Relaying
from agora_node.protocol.identity import Identity
from tests.p2p_peers import stop_p2p

pytestmark = [pytest.mark.timeout(90), pytest.mark.integration]
RUN = "relaytest"
ECHO = f"/agora/{RUN}/echo/1"


async def _peer(tmp_path, name: str, initial: list | None = None) -> tuple[P2P, Identity]:  # noqa: ANN001
    path = tmp_path / f"{name}.key"
    identity = Identity.load_or_create(path)
    p2p = await P2P.create(
        identity_path=str(path),
        check_if_identity_free=False,  # it parses RSA keys only; ours are Ed25519
        initial_peers=initial or [],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
    )
    return p2p, identity


async def _swarm(tmp_path, offer: bool = True):  # noqa: ANN001, ANN202
    """relay first; target dialed to it (a direct connection); caller dialed to it too."""
    relay_p2p, relay_id = await _peer(tmp_path, "relay")
    peers = [relay_p2p]
    try:
        maddrs = await relay_p2p.get_visible_maddrs()
        target_p2p, target_id = await _peer(tmp_path, "target", maddrs)
        peers.append(target_p2p)
        caller_p2p, caller_id = await _peer(tmp_path, "caller", maddrs)
        peers.append(caller_p2p)
    except BaseException:
        for p in peers:
            await stop_p2p(p)
        raise
    relaying = {
        "relay": Relaying(relay_id, RUN, offer=offer),
        "target": Relaying(target_id, RUN),
        "caller": Relaying(caller_id, RUN),
    }
    for p2p, r in zip(peers, relaying.values(), strict=True):
        await r.serve(p2p, refuse=None)
        streams.set_route(p2p, r)
    return peers, relaying


@pytest.mark.parametrize("size", [10, 3 << 20])
async def test_a_request_and_its_answer_pass_through_the_relay(tmp_path, size: int) -> None:
    peers = []
    try:
        peers, relaying = await _swarm(tmp_path)
        relay_p2p, target_p2p, caller_p2p = peers
        seen = []

        async def echo(remote: str, request: bytes):  # noqa: ANN202
            seen.append(remote)
            yield request[::-1]
            yield remote.encode()

        await streams.serve(target_p2p, ECHO, echo, max_request=8 << 20)
        target, caller = target_p2p.peer_id.to_base58(), caller_p2p.peer_id.to_base58()
        relay = relay_p2p.peer_id.to_base58()
        relaying["caller"].routes = {target: [relay]}
        body = os.urandom(size)  # 3 MiB: far past the 128 KiB a libp2p circuit carries here
        frames = [
            f async for f in streams.request_stream(caller_p2p, target, ECHO, body, timeout=20)
        ]
        assert frames == [body[::-1], caller.encode()]
        assert seen == [caller]  # served as the caller's, not the relay's
        assert relaying["relay"].forwarded["requests"] == 1
        assert relaying["relay"].forwarded["bytes"] > 2 * size
        assert relaying["caller"].sent_via[relay] == 2 * size + len(caller)
        assert relaying["target"].served == 1
    finally:
        for p in peers:
            await stop_p2p(p)


async def test_a_relay_passes_nothing_to_a_peer_without_a_direct_connection(tmp_path) -> None:
    peers = []
    try:
        peers, relaying = await _swarm(tmp_path)
        relay_p2p, _, caller_p2p = peers
        who = Identity.generate().peer_id  # a peer id the relay holds no connection to
        relaying["caller"].routes = {who: [relay_p2p.peer_id.to_base58()]}
        with pytest.raises(streams.StreamError, match="holds no direct connection"):
            await streams.request(caller_p2p, who, ECHO, b"x", timeout=10)
        assert relaying["relay"].refused["target"] == 1
        assert relaying["relay"].forwarded["requests"] == 0
    finally:
        for p in peers:
            await stop_p2p(p)


async def test_a_node_that_offers_no_relay_passes_nothing_on(tmp_path) -> None:
    peers = []
    try:
        peers, relaying = await _swarm(tmp_path, offer=False)
        relay_p2p, target_p2p, caller_p2p = peers

        async def echo(remote: str, request: bytes):  # noqa: ANN202
            yield request

        await streams.serve(target_p2p, ECHO, echo)
        target = target_p2p.peer_id.to_base58()
        relaying["caller"].routes = {target: [relay_p2p.peer_id.to_base58()]}
        with pytest.raises(streams.StreamError, match="through its relay"):
            await streams.request(caller_p2p, target, ECHO, b"x", timeout=10)
        relaying["caller"].routes = {}  # direct, as before: on loopback it can be dialed
        assert await streams.request(caller_p2p, target, ECHO, b"x", timeout=10) == b"x"
    finally:
        for p in peers:
            await stop_p2p(p)
