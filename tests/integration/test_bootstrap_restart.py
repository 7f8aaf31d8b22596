"""Real daemons on 127.0.0.1: the bootstrap dies and comes back at its address, and a
newcomer joins through it.

A bootstrap that came back alone had a DHT of its own: the newcomer read an empty
directory and started its stage from the manifest's initial weights beside the swarm's
trained replica (two runs under one name). The bootstrap now remembers some active
peers of its run (`bootstrap-peers.json`) and meets them when it starts again."""

from __future__ import annotations

import socket

import pytest

from tests.integration.harness import poll, small_manifest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_restarted_bootstrap_meets_the_swarm_so_a_newcomer_joins_it(swarm, tmp_path):
    manifest = small_manifest(tmp_path / "two.toml", stages=2, layers=2)
    boot = swarm.bootstrap(manifest, "--host-maddrs", f"/ip4/127.0.0.1/tcp/{_free_port()}")
    head, last = swarm.join("head", "--stage", "0"), swarm.join("last", "--stage", "1")
    for node in (head, last):
        swarm.serving(node)
    remembered = swarm.workdir / "bootstrap" / "bootstrap-peers.json"
    poll(remembered.exists, 60, "the bootstrap remembering the run's peers")
    swarm.kill(boot)
    boot.proc.wait(timeout=30)
    # back with its identity at another address: the nodes' --initial-peers no longer
    # reach it, so only what it remembered can join it to their DHT
    swarm.children.remove(boot)
    argv = ["bootstrap", "--manifest", manifest, "--data-dir", str(swarm.workdir / "bootstrap")]
    argv += ["--host-maddrs", f"/ip4/127.0.0.1/tcp/{_free_port()}"]
    boot = swarm.spawn("bootstrap", argv, append=True)
    poll(lambda: swarm.log(boot).count("agora-node join --initial-peers") == 2, 60, "its join line")
    line = [x for x in swarm.log(boot).splitlines() if "agora-node join --initial-peers" in x][-1]
    newcomer = swarm.join(
        "newcomer", "--stage", "0", initial_peers=line.split("--initial-peers")[1].split()
    )
    swarm.serving(newcomer)
    log = swarm.log(newcomer)
    assert "loaded stage 0 state from" in log, log[-3000:]
    assert "first replica of stage 0" not in log
