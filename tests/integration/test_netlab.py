"""Real daemons in a network lab (tests/netlab.py): each in its own network namespace,
one behind a masquerading NAT router. The NATed node can dial out, so it joins and
serves; nobody can dial it, and its dial-back check says so; the public node's says
it is reachable. It still trains: the streams of its upstream peer ride the
connection it opened to that peer. Nothing is left behind: processes (by pid, swarm
fixture) and namespaces (lab fixture)."""

from __future__ import annotations

import re

import pytest

from tests.integration.harness import TestSwarm, poll, wait_for_line
from tests.netlab import NetLab

pytestmark = [pytest.mark.integration, pytest.mark.netlab, pytest.mark.timeout(240)]


def _listen(host) -> list[str]:  # noqa: ANN001
    return ["--host-maddrs", f"/ip4/{host.ip}/tcp/0"]


def test_a_node_behind_nat_joins_and_is_told_it_cannot_be_dialed(
    lab: NetLab, swarm: TestSwarm
) -> None:
    from tests.integration.harness import small_manifest

    manifest = small_manifest(swarm.workdir / "two.toml", stages=2, layers=2)
    boot, public, home = lab.public("boot"), lab.public("a"), lab.behind_nat("home")
    swarm.bootstrap(manifest, *_listen(boot), prefix=tuple(lab.exec_prefix(boot)))
    assert all(boot.ip in addr for addr in swarm.initial_peers)
    a = swarm.join("a", "--stage", "0", *_listen(public), prefix=tuple(lab.exec_prefix(public)))
    swarm.serving(a)
    h = swarm.join("home", "--stage", "1", *_listen(home), prefix=tuple(lab.exec_prefix(home)))
    swarm.serving(h)  # it dialed out through its NAT: joined, fetched, serves
    line = wait_for_line(h, "NOT reachable", 90)
    assert f"/ip4/{home.ip}/tcp/" in line
    assert "peer(s) dialed this node back" in wait_for_line(a, "reachable: ", 90)
    # micro-batches from stage 0 reach the NATed stage 1 and come back done
    poll(lambda: _done(swarm.log(h)) >= 20, 90, "the NATed node to train 20 micro-batches")


def _done(log: str) -> int:
    counts = [int(n) for n in re.findall(r"\| ok (\d+) dropped", log)]
    return max(counts, default=0)
