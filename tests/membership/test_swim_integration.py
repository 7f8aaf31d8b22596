"""Five real hivemind peers on 127.0.0.1, each running MembershipService in its
own process (python tests/membership/run_peer.py)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agora_node.comms.membership.settings import MembershipSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

REPO = Path(__file__).resolve().parents[2]
# fast settings: probe every 0.5 s; suspicion of 4..24 s for 5 members
SETTINGS = {
    "probe_interval_s": 0.5,
    "probe_timeout_s": 0.25,
    "indirect_timeout_s": 0.4,
    "suspicion_mult": 8.0,
    "gossip_interval_s": 0.25,
    "reconnect_interval_s": 2.0,
}
BOUND_S = MembershipSettings(**SETTINGS).detection_bound_s(5)
SHORTEST_SUSPICION_S = MembershipSettings(**SETTINGS).suspicion_bounds(5)[0]
FREEZE_S = 2.5  # less than the shortest suspicion (4 s); long enough to be suspected


class Peer:
    """One run_peer process; a thread turns its stdout JSON lines into state."""

    def __init__(self, index: int, tmp: Path, seeds: list[str]) -> None:
        cmd = [
            sys.executable, str(REPO / "tests" / "membership" / "run_peer.py"),
            "--identity", str(tmp / f"peer{index}.key"),
            "--settings-json", json.dumps(SETTINGS),
            "--report-s", "0.2",
        ]  # fmt: skip
        for seed in seeds:
            cmd += ["--seed", seed]
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        self.log = open(tmp / f"peer{index}.log", "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True, start_new_session=True,
        )  # fmt: skip
        self.ready = threading.Event()
        self.peer_id = ""
        self.maddrs: list[str] = []
        self.view: dict[str, str] = {}
        self.counters: dict[str, int] = {}
        self.history: list[tuple[float, str, str]] = []  # (monotonic time, peer, status)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record["event"] == "ready":
                self.peer_id, self.maddrs = record["peer_id"], record["maddrs"]
                self.ready.set()
            elif record["event"] == "member":
                self.history.append((time.monotonic(), record["peer_id"], record["status"]))
            elif record["event"] == "view":
                self.view, self.counters = record["members"], record["counters"]

    def command(self, **cmd: str) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)  # the whole group: python and its p2pd

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.log.close()


def wait_for(condition, timeout: float, what: str) -> None:
    """Poll `condition` every 50 ms until it holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)  # the poll interval


def hold(seconds: float) -> None:
    """Let `seconds` pass: a fault's duration, or the window an absence is checked over."""
    until = time.monotonic() + seconds
    wait_for(lambda: time.monotonic() >= until, seconds + 1, "time to pass")


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("swim")
    peers: list[Peer] = []
    try:
        peers.append(Peer(0, tmp, []))
        wait_for(peers[0].ready.is_set, 60, "the first peer to start")
        peers += [Peer(i, tmp, peers[0].maddrs) for i in range(1, 5)]
        wait_for(lambda: all(p.ready.is_set() for p in peers), 60, "all peers to start")

        def converged() -> bool:
            return all(
                sorted(p.view.values()) == ["ALIVE"] * 4 for p in peers
            )  # each sees the 4 others

        wait_for(converged, 30, "all peers to see each other alive")
        yield peers
    finally:
        for peer in peers:
            peer.close()


def test_forged_message_is_dropped(swarm: list[Peer]) -> None:
    sender, target = swarm[2], swarm[1]
    before = target.counters.get("dropped_bad_signature", 0)
    sender.command(cmd="forge", to=target.peer_id)
    wait_for(
        lambda: target.counters.get("dropped_bad_signature", 0) > before,
        15,
        "the forged message to be dropped",
    )
    assert target.view.get(sender.peer_id) == "ALIVE"


def test_frozen_peer_is_not_declared_dead(swarm: list[Peer]) -> None:
    frozen = swarm[3]
    others = [p for p in swarm if p is not frozen and p.proc.poll() is None]
    frozen.signal(signal.SIGSTOP)
    hold(FREEZE_S)
    frozen.signal(signal.SIGCONT)
    wait_for(
        lambda: all(p.view.get(frozen.peer_id) == "ALIVE" for p in others),
        20,
        "the frozen peer to be alive again",
    )
    hold(SHORTEST_SUSPICION_S + 1)  # any death would have come by now
    suspected = [
        p for p in others if (frozen.peer_id, "SUSPECT") in {(i, s) for _, i, s in p.history}
    ]
    assert suspected, "the freeze went unnoticed: the test proves nothing"
    for peer in others:
        assert "DEAD" not in [s for _, pid, s in peer.history if pid == frozen.peer_id], (
            peer.peer_id
        )
        assert peer.view.get(frozen.peer_id) == "ALIVE"


def test_killed_peer_is_declared_dead_by_every_survivor(swarm: list[Peer]) -> None:
    victim = swarm[4]
    survivors = [p for p in swarm if p is not victim and p.proc.poll() is None]
    killed = time.monotonic()
    victim.signal(signal.SIGKILL)

    def dead_at(peer: Peer) -> float | None:
        times = [
            t for t, pid, s in peer.history if pid == victim.peer_id and s == "DEAD" and t > killed
        ]
        return times[0] if times else None

    wait_for(
        lambda: all(dead_at(p) is not None for p in survivors),
        BOUND_S + 5,
        "every survivor to mark it dead",
    )
    detection = [dead_at(p) - killed for p in survivors]
    print(f"detection after SIGKILL: {[round(d, 2) for d in detection]} s (bound {BOUND_S:.1f} s)")
    assert max(detection) <= BOUND_S
    for peer in survivors:  # and nobody else died on the way
        assert {pid for _, pid, s in peer.history if s == "DEAD"} == {victim.peer_id}
