"""What the node says about being reached through a relay (node/dialback.py, pure logic)."""

from __future__ import annotations

import pytest

from agora_node.comms.host import relay_candidates
from agora_node.node.dialback import Relayed

pytestmark = pytest.mark.timeout(30)

ME = "12D3KooWMe"
RELAY = "12D3KooWRelayAbcdefgh"
DIRECT = f"/ip4/192.168.1.5/tcp/4001/p2p/{ME}"
CIRCUIT = f"/ip4/203.0.113.9/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{ME}"


def test_a_relayed_address_is_said_once_and_its_loss_too():
    r = Relayed()
    assert r.update([DIRECT], [], now=1.0) is None  # nothing relayed: nothing to say
    line = r.update([DIRECT, CIRCUIT], ["12D3KooWPeerXYZ12345"], now=2.0)
    assert line is not None and "through relay(s) Abcdefgh" in line and CIRCUIT in line
    assert r.update([CIRCUIT, DIRECT], ["12D3KooWPeerXYZ12345"], now=3.0) is None  # same
    assert r.addrs == [CIRCUIT] and r.relays() == [RELAY] and r.since == 2.0
    status = r.status({"12D3KooWPeerXYZ12345": 10, "12D3KooWOther": 5}, {"12D3KooWPeerXYZ12345": 7})
    assert status["relays"] == ["Abcdefgh"] and status["relayed_peers"] == ["XYZ12345"]
    assert (status["bytes_sent"], status["bytes_received"]) == (10, 7)  # relayed peers only
    gone = r.update([DIRECT], [], now=4.0)
    assert gone is not None and "no relayed address" in gone
    assert r.addrs == [] and r.since is None


def test_relays_are_the_direct_addresses_of_named_peers():
    peers = [
        f"/ip4/203.0.113.9/tcp/4001/p2p/{RELAY}",
        "/ip4/203.0.113.10/tcp/4001",  # no peer id: libp2p cannot reserve on it
        CIRCUIT,  # itself relayed
    ]
    assert relay_candidates(peers) == [peers[0]]
    assert len(relay_candidates([peers[0]] * 20)) == 8
