"""Over two real hivemind DHTs on 127.0.0.1: a DHT that lost a peer meets it again.

hivemind drops a peer that stops answering from its routing table and never asks its
initial peers again, so after a partition healed each half kept a DHT (and a directory)
of its own for good, although SWIM met the other half again within seconds: the
partition test of the network lab (test_netlab.py) timed out three times of three.
`Host.meet` pings such peers through the DHT; the daemon asks it for the peers SWIM
finds alive that its directory lacks and for its initial peers (Node._meet_loop)."""

from __future__ import annotations

import asyncio
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from hivemind.p2p import PeerID

from agora_node.comms.host import Host, HostConfig
from agora_node.comms.reachability import addrs_by_peer
from agora_node.protocol.identity import Identity
from agora_node.protocol.names import manifest_key
from agora_node.stages.manifest_files import load_manifest

pytestmark = [pytest.mark.timeout(120), pytest.mark.integration]


async def _knows(peer: str, _dht: object, node: Any) -> bool:
    return PeerID.from_base58(peer) in node.protocol.routing_table


async def _forget(peer: str, _dht: object, node: Any) -> None:
    """What hivemind does to a peer whose calls fail (a partition): out of the table."""
    table = node.protocol.routing_table
    del table[table.get(peer_id=PeerID.from_base58(peer))]


async def _in_dht(host: Host, fn: Any, *args: Any) -> Any:
    return await host.dht.run_coroutine(partial(fn, *args), return_future=True)


async def _start(tmp_path: Path, name: str, initial_peers: list[str] = ()) -> Host:
    key_path = tmp_path / f"{name}.key"
    key_path.write_bytes(Identity.generate().to_libp2p_bytes())
    return await Host.start(HostConfig(identity_path=str(key_path), initial_peers=initial_peers))


async def _until(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        await asyncio.sleep(0.1)  # polling interval of a deadline-bounded wait


async def test_a_dht_that_lost_a_peer_meets_it_again(tmp_path: Path) -> None:
    hosts: list[Host] = []
    try:
        hosts.append(await _start(tmp_path, "a"))
        a = hosts[0]
        hosts.append(await _start(tmp_path, "b", [str(m) for m in await a.visible_maddrs()]))
        b = hosts[1]
        a_id, b_id = a.p2p.peer_id.to_base58(), b.p2p.peer_id.to_base58()

        async def both_know() -> bool:
            return await _in_dht(a, _knows, b_id) and await _in_dht(b, _knows, a_id)

        await _until(both_know, 30, "the two DHTs in each other's routing table")
        await _in_dht(a, _forget, b_id)
        await _in_dht(b, _forget, a_id)
        # two DHTs now: what one stores, the other does not find
        manifest = load_manifest("tiny")
        key = manifest_key(manifest.run_id)
        assert await a.store(key, manifest.canonical_bytes(), 60)
        assert await b.get(key) is None

        own = b.p2p.peer_id.to_base58()
        assert await b.meet({a_id: [], "not a peer id": [], own: []}, 8) == (1, 1)
        assert await both_know()  # the ping carries b's node id: a took b back too
        assert await b.get(key) == manifest.canonical_bytes()
        assert await b.meet({a_id: []}, 8) == (0, 0)  # in the table: nothing to meet
    finally:
        for host in hosts:
            await host.shutdown()


async def test_an_initial_peer_libp2p_never_dialed_is_met_at_its_addresses(
    tmp_path: Path,
) -> None:
    """An initial peer after a long outage: libp2p has forgotten its addresses, the DHT
    lost it. Two DHTs that never met stand for that: the ping alone cannot reach it, a
    dial at the addresses given first does."""
    hosts: list[Host] = []
    try:
        hosts.append(await _start(tmp_path, "a"))
        hosts.append(await _start(tmp_path, "b"))
        a, b = hosts
        a_id, b_id = a.p2p.peer_id.to_base58(), b.p2p.peer_id.to_base58()
        assert await b.meet({a_id: []}, 8) == (1, 0)  # no address to reach it at
        maddrs = addrs_by_peer([str(m) for m in await a.visible_maddrs()])[a_id]
        assert await b.meet({a_id: maddrs}, 0) == (1, 1)  # with addresses: met, whatever at_most
        assert await _in_dht(a, _knows, b_id) and await _in_dht(b, _knows, a_id)
    finally:
        for host in hosts:
            await host.shutdown()
