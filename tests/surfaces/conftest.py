"""Fixtures for the operator-surface tests: a fake daemon snapshot and a live status server."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest

from agora_node.node.metrics import Metrics
from agora_node.node.status_server import History, StatusServer

SELF_ID = "12D3KooWSelfPeerAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
OTHER_ID = "12D3KooWOtherPeerBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB"
RELAYED_ADDR = (
    "/ip4/203.0.113.9/tcp/4001/p2p/12D3KooWRelayPeerCCCCCCCCCCCCCCCCCCCCCCCZz99Yy88"
    f"/p2p-circuit/p2p/{SELF_ID}"
)


def make_snapshot(state: str = "active") -> dict[str, Any]:
    """A snapshot shaped exactly as the daemon produces it (see status_server's docstring)."""
    now = time.time()
    history = History(maxlen=4)
    for i in range(6):  # more than maxlen: the ring must keep only the newest
        history.add("loss", 4.0 - 0.1 * i, at=now - 6 + i)
    history.add("throughput", 1200.0, at=now)

    def peer(peer_id: str, is_self: bool, peer_state: str = "active") -> dict[str, Any]:
        return {
            "peer_id": peer_id,
            "state": peer_state,
            "throughput": 1234.5,
            "queue": 2,
            "outer_step": 3,
            "version": "0.1.0",
            "updated_at": now - 4,
            "is_self": is_self,
            "utilization": 0.42,
            "inner_step": 120,
            "tokens_seen": 65536,
            "pinned": False,
            "swim": "self" if is_self else "alive",
            "rtt_ms": None if is_self else 42.5,
            "rounds_together": 0 if is_self else 2,
            "bytes_sent": 1000,
            "bytes_received": 2000,
            "flags": {},
            "anchor_agrees": None,
        }

    return {
        "snapshot_at": now,
        "node": {
            "peer_id": SELF_ID,
            "run_id": "3f2a1b0c9d8e7f6a",
            "version": "0.1.0",
            "stage": 1,
            "num_stages": 3,
            "device": "cuda:1",
            "precision": "bf16",
            "reachability": {
                "state": "unreachable",
                "addrs": ["/ip4/192.168.1.20/tcp/31337"],
                "dialed_by": [],
                "failed": {"Ab12Cd34": "all dials failed"},
                "checked_at": now - 30,
            },
            "relay": {
                "addrs": [RELAYED_ADDR],
                "relays": ["Zz99Yy88"],
                "since": now - 20,
                "relayed_peers": [OTHER_ID[-8:]],
                "bytes_sent": 1000,
                "bytes_received": 2000,
            },
            "cell": {
                "size": 2,
                "role": "leader",
                "members": [SELF_ID, OTHER_ID],
                "ready": True,
                "microbatches": 40,
                "failed": 1,
                "helped": 0,
                "kv_bytes_sent": 1968,
                "kv_bytes_per_token": 49.2,
                "exchange_wait_s": 3.5,
                "refused": {},
                "frames_resent": 0,
                "answers_resent": 0,
            },
            "state": state,
            "started_at": now - 312,
            "inner_step": 120,
            "outer_step": 3,
            "tokens_seen": 65536,
            "throughput": 1234.5,
            "queue": 2,
            "in_flight": 1,
            "gradient_lag": 0.42,
            "microbatches": {"ok": 40, "dropped": 1, "rejected": 0},
            "bytes_sent": {OTHER_ID: 1000},
            "bytes_received": {OTHER_ID: 2000},
            "last_losses": [3.9, 3.812],
            "val_loss": 3.901,
            "outer": {
                "outer_round": 3,
                "rounds": 2,
                "bytes_sent": 5000,
                "seconds_blocked": 1.5,
                "recent_rounds": [
                    {
                        "round": r,
                        "at": now - 60 + 20 * r,
                        "participants": 2,
                        "group": [SELF_ID, OTHER_ID],
                        "anchor_mixed": r == 1,
                        "consistent": True,
                        "bytes_sent": 2500,
                        "bytes_received": 2500,
                        "seconds_blocked": 0.75,
                        "failed_peers": [],
                        "outliers": [],
                        "mismatched": [],
                        "anchor_agreement": {"agree": [OTHER_ID], "differ": []},
                    }
                    for r in (1, 2)
                ],
            },
            "members": {
                "events": [
                    {"at": now - 50, "peer_id": OTHER_ID, "event": "joined", "stage": 0},
                    {"at": now - 5, "peer_id": "12D3KooWLeaver", "event": "left", "stage": 1},
                ]
            },
            "stage_changes": [{"at": now - 300, "from": None, "to": 1, "reason": "least capacity"}],
            "waiting_on": "stage 2 (no replica downstream)",
            "time_split": {"compute": 0.4, "downstream": 0.5, "idle": 0.1, "outer": 0.03},
        },
        "stages": [
            {"stage": 0, "peers": [peer(OTHER_ID, False)]},
            {"stage": 1, "peers": [peer(SELF_ID, True), peer("12D3KooWLeaver", False, "leaving")]},
            {"stage": 2, "peers": []},
        ],
        "config": {"stage": "auto", "status_port": 0, "manifest": "tiny"},
        "history": history.as_dict(),
    }


class FakeDaemon:
    """Stands in for the daemon: holds a precomputed snapshot, as the real one does."""

    def __init__(self, state: str = "active") -> None:
        self.current = make_snapshot(state)

    def snapshot(self) -> dict[str, Any]:
        return copy.deepcopy(self.current)


@pytest.fixture
def daemon() -> FakeDaemon:
    return FakeDaemon()


@pytest.fixture
async def status_server(daemon: FakeDaemon):
    server = StatusServer(daemon, Metrics(), port=0)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
