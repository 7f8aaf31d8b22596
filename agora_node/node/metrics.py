"""Prometheus metrics of one daemon, on a private registry.

Every `Metrics` owns its own `CollectorRegistry` (never prometheus_client's
global one), so several daemons or tests in one process do not collide.

Two kinds of numbers live here:
- events the daemon counts as they happen (`count_rejected_record`,
  `count_microbatch`, `add_bytes`), and
- levels copied from the status snapshot just before each scrape
  (`update_from_snapshot`), so /metrics and /api/v1/status never disagree.

Label cardinality stays bounded: reasons are capped at `MAX_REASONS` distinct
values, and per-peer byte counts are kept out of prometheus (they go to the
JSON status through `bytes_by_peer`, itself capped at `MAX_PEERS`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Enum,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)

STATES = ("joining", "warming", "active", "leaving")
MICROBATCH_RESULTS = ("ok", "dropped", "rejected")
MAX_REASONS = 16
MAX_PEERS = 64
OTHER = "other"
# Micro-batch round trips span ~10 ms on loopback to tens of seconds on slow links.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def _bounded(seen: set[str], value: str, cap: int) -> str:
    """`value` while fewer than `cap` distinct values were seen, else OTHER."""
    if value in seen or len(seen) < cap:
        seen.add(value)
        return value
    return OTHER


class Metrics:
    """The `agora_*` metrics of one daemon."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._reasons: set[str] = set()
        self._peers: dict[str, list[int]] = {}  # peer -> [sent, received]
        # Own tallies, because reading a Counter back needs prometheus_client internals.
        self._outcomes = dict.fromkeys(MICROBATCH_RESULTS, 0)
        self._build_counters()
        self._build_levels()

    def _build_counters(self) -> None:
        r = self.registry
        self.records_rejected = Counter(
            "agora_records_rejected",
            "Directory records ignored (bad signature, wrong run, malformed).",
            ["reason"],
            registry=r,
        )
        self.microbatches = Counter(
            "agora_microbatches",
            "Micro-batches handled by this node, by outcome.",
            ["result"],
            registry=r,
        )
        for result in MICROBATCH_RESULTS:  # export zeros so rate() works from the start
            self.microbatches.labels(result=result)
        self.bytes_sent = Counter("agora_bytes_sent", "Payload bytes sent to peers.", registry=r)
        self.bytes_received = Counter(
            "agora_bytes_received", "Payload bytes received from peers.", registry=r
        )
        self.microbatch_latency = Histogram(
            "agora_microbatch_latency_seconds",
            "Round trip of a micro-batch from send to returned gradient.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def _build_levels(self) -> None:
        r = self.registry
        self.node_info = Info("agora_node", "Identity of this node.", registry=r)
        self.state = Enum("agora_state", "Lifecycle state.", states=list(STATES), registry=r)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(f"agora_{name}", doc, list(labels), registry=r)

        self.stage = gauge("stage", "Pipeline stage served (-1 before one is chosen).")
        self.inner_step = gauge("inner_step", "Inner optimizer steps taken.")
        self.outer_step = gauge("outer_step", "Outer (DiLoCo) steps taken.")
        self.throughput = gauge("throughput_tokens_per_s", "Tokens per second, EMA.")
        self.queue_length = gauge("queue_length", "Micro-batches waiting at this node.")
        self.in_flight = gauge("in_flight", "Micro-batches in flight from this node.")
        self.peers_alive = gauge("peers_alive", "Non-leaving peers seen per stage.", ("stage",))
        self.loss = gauge("loss", "Last training loss reported to this node.")
        self.val_loss = gauge("val_loss", "Last validation loss.")

    # -- events -----------------------------------------------------------

    def count_rejected_record(self, reason: str) -> None:
        reason = _bounded(self._reasons, reason, MAX_REASONS)
        self.records_rejected.labels(reason=reason).inc()

    def count_microbatch(self, result: str, latency_s: float | None = None) -> None:
        """Count one micro-batch outcome; `latency_s` is observed for completed ones."""
        if result not in MICROBATCH_RESULTS:
            raise ValueError(f"micro-batch result must be one of {MICROBATCH_RESULTS}: {result!r}")
        self.microbatches.labels(result=result).inc()
        self._outcomes[result] += 1
        if latency_s is not None:
            self.microbatch_latency.observe(latency_s)

    def add_bytes(self, peer: str, sent: int = 0, received: int = 0) -> None:
        """Count payload bytes exchanged with `peer` (totals in prometheus, per peer in JSON)."""
        if sent:
            self.bytes_sent.inc(sent)
        if received:
            self.bytes_received.inc(received)
        if peer not in self._peers and len(self._peers) >= MAX_PEERS:
            peer = OTHER
        tally = self._peers.setdefault(peer, [0, 0])
        tally[0] += sent
        tally[1] += received

    def bytes_by_peer(self) -> tuple[dict[str, int], dict[str, int]]:
        """(sent, received) per peer, for the status snapshot's bytes_sent/bytes_received."""
        sent = {peer: t[0] for peer, t in self._peers.items()}
        received = {peer: t[1] for peer, t in self._peers.items()}
        return sent, received

    def microbatch_counts(self) -> dict[str, int]:
        """Totals by result (ok/dropped/rejected), for the status snapshot."""
        return dict(self._outcomes)

    # -- levels -----------------------------------------------------------

    def update_from_snapshot(self, snapshot: Mapping[str, Any]) -> None:
        """Copy the levels of a status snapshot into the gauges (called before a scrape)."""
        node = snapshot.get("node", {})
        self.node_info.info(
            {k: str(node.get(k, "")) for k in ("peer_id", "run_id", "version")},
        )
        if node.get("state") in STATES:
            self.state.state(node["state"])
        stage = node.get("stage")
        self.stage.set(-1 if stage is None else stage)
        self.inner_step.set(node.get("inner_step", 0))
        self.outer_step.set(node.get("outer_step", 0))
        self.throughput.set(node.get("throughput", 0.0))
        self.queue_length.set(node.get("queue", 0))
        self.in_flight.set(node.get("in_flight", 0))
        losses = node.get("last_losses") or []
        self.loss.set(losses[-1] if losses else float("nan"))
        val = node.get("val_loss")
        self.val_loss.set(float("nan") if val is None else val)
        for entry in snapshot.get("stages", []):
            alive = sum(1 for p in entry.get("peers", []) if p.get("state") != "leaving")
            self.peers_alive.labels(stage=str(entry["stage"])).set(alive)

    def render(self) -> bytes:
        """The prometheus text exposition of this registry."""
        return generate_latest(self.registry)
