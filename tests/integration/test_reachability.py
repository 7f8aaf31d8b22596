"""Reachability on real daemons on 127.0.0.1: a node asks its peers (the bootstrap
included) to dial it back from a probe daemon of their own; one that announces an
address nobody can dial is told so in one line and on its status page, one that can
be dialed says it is."""

from __future__ import annotations

import socket

import pytest

from tests.integration.harness import TestSwarm, poll, small_manifest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _closed_port() -> int:
    """A loopback TCP port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reach(swarm: TestSwarm, node) -> dict:  # noqa: ANN001
    return (swarm.status(node) or {}).get("reachability") or {}


@pytest.mark.slow  # 25 s; where the network lab can be built, the default suite has a node
# behind NAT told it cannot be dialed and a public one confirmed (test_netlab.py)
def test_a_node_announcing_an_undialable_address_is_told_and_a_dialable_one_is_confirmed(
    swarm: TestSwarm,
) -> None:
    manifest = small_manifest(swarm.workdir / "two.toml", stages=2, layers=2)
    swarm.bootstrap(manifest)
    open_node = swarm.join("open", "--stage", "0")
    swarm.serving(open_node)
    hidden = swarm.join(
        "hidden", "--stage", "1", "--announce-maddrs", f"/ip4/127.0.0.1/tcp/{_closed_port()}"
    )
    swarm.serving(hidden)
    hidden_reach = poll(
        lambda: (r := _reach(swarm, hidden)).get("state") == "unreachable" and r,
        90,
        "the hidden node to learn it cannot be dialed",
    )
    assert hidden_reach["failed"] and not hidden_reach["dialed_by"]
    # asked: the open node and the bootstrap; neither could dial it
    assert "NOT reachable: 2 peer(s) could not dial this node" in swarm.log(hidden)
    open_reach = poll(
        lambda: (r := _reach(swarm, open_node)).get("state") == "reachable" and r,
        90,
        "the open node to be dialed back",
    )
    assert open_reach["dialed_by"] and open_reach["addrs"]
    assert "peer(s) dialed this node back" in swarm.log(open_node)
