"""The event sink of one daemon, and its Prometheus metrics on a private registry.

Every `Metrics` owns its own `CollectorRegistry` (never prometheus_client's
global one), so several daemons or tests in one process do not collide.

Two kinds of numbers live here:
- events, counted once as they happen, here and nowhere else: the pipeline
  reports micro-batch outcomes and latencies, payload bytes, injected and
  completed tokens (`count_microbatch`, `add_bytes`, `count_injected`,
  `count_completed`), the daemon rejected records, the handlers' guards refused
  requests (`count_refused`). Each event moves the
  Prometheus counter and the tally the status JSON reads (`microbatch_counts`,
  `bytes_by_peer`, `completed_tokens_per_s`, ...), so the two cannot disagree;
- levels and the counters other objects already keep (the outer loop's round
  totals, SWIM's message counters), copied from the status snapshot just before
  each scrape (`update_from_snapshot`), so /metrics shows the JSON's numbers.

Label cardinality stays bounded: reasons are capped at `MAX_REASONS` distinct
values, and per-peer byte counts are kept out of prometheus (they go to the
JSON status through `bytes_by_peer`, itself capped at `MAX_PEERS`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
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
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agora_node.comms.routing import FailureKind
from agora_node.node.rates import RateWindow
from agora_node.node.suspects import Reason

STATES = ("joining", "warming", "active", "leaving")
MICROBATCH_RESULTS = ("ok", "dropped", "rejected")
HOP_FAILURES = (*(kind.value for kind in FailureKind), "refused")
"""How a request to a next-stage replica fails: its answers (busy, rejected), none (timeout,
error), or one this node refused (malformed, non-finite, an outlier: the peer is flagged)."""
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
        self._codes: set[str] = set()
        self._peers: dict[str, list[int]] = {}  # peer -> [sent, received]
        # Own tallies, because reading a Counter back needs prometheus_client internals.
        self._outcomes = dict.fromkeys(MICROBATCH_RESULTS, 0)
        self._rejected_codes: dict[str, int] = {}
        self._hop_failures = dict.fromkeys(HOP_FAILURES, 0)
        self._refused: dict[str, dict[str, int]] = {}
        self.injected_tokens = 0
        """Tokens this node (a head) put into the pipeline."""
        self.completed_tokens = 0
        """Tokens of this head's micro-batches that came back with their gradient."""
        self._completed = RateWindow()
        self._build_counters()
        self._build_levels()
        self._kept = _KeptCounters()
        self.registry.register(self._kept)

    def _build_counters(self) -> None:
        r = self.registry
        self.records_rejected = Counter(
            "agora_records_rejected",
            "Directory records ignored (bad signature, wrong run, malformed).",
            ["reason"],
            registry=r,
        )
        self.unlisted_refused = Counter(
            "agora_unlisted_refused",
            "Inputs refused because their peer is not on this node's --allow-keys list, by kind "
            "(record, round_entry, stream, rpc, membership, admission).",
            ["what"],
            registry=r,
        )
        self.requests_refused = Counter(
            "agora_requests_refused",
            "Requests refused or cut by a handler's guard (admission, deadlines, size), "
            "by protocol and reason.",
            ["protocol", "reason"],
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
        self.microbatches_rejected = Counter(
            "agora_microbatches_rejected",
            "Micro-batches this node refused, by wire error code.",
            ["code"],
            registry=r,
        )
        self.hop_failures = Counter(
            "agora_hop_failures",
            "Requests to a next-stage replica that failed, by kind (the micro-batch then went "
            "to another replica, or was dropped): a flaky replica shows here first.",
            ["kind"],
            registry=r,
        )
        for kind in HOP_FAILURES:
            self.hop_failures.labels(kind=kind)
        self.bytes_sent = Counter(
            "agora_bytes_sent", "Pipeline payload bytes sent to peers.", registry=r
        )
        self.bytes_received = Counter(
            "agora_bytes_received", "Pipeline payload bytes received from peers.", registry=r
        )
        self.microbatch_latency = Histogram(
            "agora_microbatch_latency_seconds",
            "From receiving a micro-batch (at stage 0: injecting it) to its gradient "
            "being ready to return: this node's part of the round trip and everything downstream.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.injected = Counter(
            "agora_injected_tokens", "Tokens this head put into the pipeline.", registry=r
        )
        self.completed = Counter(
            "agora_completed_tokens",
            "Tokens of this head's micro-batches that came back with their gradient.",
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
        self.compute_rate = gauge(
            "compute_rate_tokens_per_s",
            "Tokens per compute-second of this node's stage (each micro-batch once), last minute.",
        )
        self.utilization = gauge(
            "utilization_ratio", "Fraction of wall time this node computed, last minute."
        )
        self.completed_rate = gauge(
            "completed_tokens_per_s",
            "Tokens/s of this head's micro-batches that came back with their gradient, "
            "last minute (the swarm's rate is the sum over stage-0 nodes).",
        )
        self.queue_length = gauge("queue_length", "Micro-batches waiting at this node.")
        self.in_flight = gauge("in_flight", "Micro-batches in flight from this node.")
        self.gradient_lag = gauge(
            "gradient_lag_steps",
            "Steps a gradient lands after the step its forward's weights came from (average).",
        )
        self.device_memory = gauge(
            "device_memory_bytes",
            "Accelerator memory this process holds: allocated (tensors), reserved (the "
            "allocator's), peak_allocated; absent on the CPU.",
            ("kind",),
        )
        self.max_graphs = gauge(
            "max_graphs", "Micro-batch graphs this node keeps open (beyond: recomputed)."
        )
        self.relayed_peers = gauge(
            "relayed_peers", "Peers connected to this node only through a relay circuit."
        )
        self.relayed_addrs = gauge(
            "relayed_addrs",
            "Relayed addresses this node announces (0: dialed directly or not at all).",
        )
        self.cell_members = gauge(
            "cell_members", "Members of this node's context-parallel cell (1: none, alone)."
        )
        self.peers_alive = gauge(
            "peers_alive",
            "Peers per stage in the directory, less those leaving or declared dead or gone by membership.",
            ("stage",),
        )
        self.loss = gauge("loss", "Last training loss reported to this node.")
        self.val_loss = gauge("val_loss", "Last validation loss.")

    # -- events -----------------------------------------------------------

    def count_rejected_record(self, reason: str) -> None:
        reason = _bounded(self._reasons, reason, MAX_REASONS)
        self.records_rejected.labels(reason=reason).inc()

    def count_unlisted_refused(self, what: str, count: int) -> None:
        """`what` comes from a fixed set in the code, never from a peer: no bound needed."""
        self.unlisted_refused.labels(what=what).inc(count)

    def count_refused(self, protocol: str, reason: str) -> None:
        """A guard (comms/guard.py) refused or cut a request of `protocol` for `reason`.
        Both labels come from small fixed sets (protocol names and guard.Reason)."""
        self.requests_refused.labels(protocol=protocol, reason=reason).inc()
        by_reason = self._refused.setdefault(protocol, {})
        by_reason[reason] = by_reason.get(reason, 0) + 1

    def refused_counts(self) -> dict[str, dict[str, int]]:
        """Refused requests by protocol and reason, for the status snapshot."""
        return {protocol: dict(reasons) for protocol, reasons in self._refused.items()}

    def count_microbatch(
        self, result: str, latency_s: float | None = None, code: str | None = None
    ) -> None:
        """Count one micro-batch outcome; `latency_s` is observed for completed ones,
        `code` (the wire error code) kept for rejected ones."""
        if result not in MICROBATCH_RESULTS:
            raise ValueError(f"micro-batch result must be one of {MICROBATCH_RESULTS}: {result!r}")
        self.microbatches.labels(result=result).inc()
        self._outcomes[result] += 1
        if code is not None:
            code = _bounded(self._codes, code, MAX_REASONS)
            self._rejected_codes[code] = self._rejected_codes.get(code, 0) + 1
            self.microbatches_rejected.labels(code=code).inc()
        if latency_s is not None:
            self.microbatch_latency.observe(latency_s)

    def count_hop_failure(self, kind: str) -> None:
        """A request to a next-stage replica failed (`kind`: one of HOP_FAILURES)."""
        if kind not in HOP_FAILURES:
            raise ValueError(f"hop failure kind must be one of {HOP_FAILURES}: {kind!r}")
        self.hop_failures.labels(kind=kind).inc()
        self._hop_failures[kind] += 1

    def hop_failure_counts(self) -> dict[str, int]:
        """Failed requests to next-stage replicas by kind, for the status snapshot."""
        return dict(self._hop_failures)

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

    def count_injected(self, tokens: int) -> None:
        """A head put a micro-batch of `tokens` into the pipeline."""
        self.injected.inc(tokens)
        self.injected_tokens += tokens

    def count_completed(self, tokens: int) -> None:
        """A head's micro-batch of `tokens` came back with its gradient."""
        self.completed.inc(tokens)
        self.completed_tokens += tokens
        self._completed.add(tokens)

    def completed_tokens_per_s(self) -> float:
        """This head's completed tokens per wall second over the last minute."""
        return self._completed.per_wall_second()

    def bytes_by_peer(self) -> tuple[dict[str, int], dict[str, int]]:
        """(sent, received) per peer, for the status snapshot's bytes_sent/bytes_received."""
        sent = {peer: t[0] for peer, t in self._peers.items()}
        received = {peer: t[1] for peer, t in self._peers.items()}
        return sent, received

    def microbatch_counts(self) -> dict[str, int]:
        """Totals by result (ok/dropped/rejected), for the status snapshot."""
        return dict(self._outcomes)

    def rejected_codes(self) -> dict[str, int]:
        """Rejected micro-batches by wire error code, for the status snapshot."""
        return dict(self._rejected_codes)

    # -- levels -----------------------------------------------------------

    def update_from_snapshot(self, snapshot: Mapping[str, Any]) -> None:
        """Copy the levels of a status snapshot into the gauges (called before a scrape)."""
        node = snapshot.get("node", {})
        self.node_info.info(
            {
                k: str(node.get(k, ""))
                for k in ("peer_id", "run_id", "version", "device", "precision")
            },
        )
        if node.get("state") in STATES:
            self.state.state(node["state"])
        stage = node.get("stage")
        self.stage.set(-1 if stage is None else stage)
        self.inner_step.set(node.get("inner_step", 0))
        self.outer_step.set(node.get("outer_step", 0))
        self.compute_rate.set(node.get("compute_rate", node.get("throughput", 0.0)))
        self.utilization.set(node.get("utilization", 0.0))
        self.queue_length.set(node.get("queue", 0))
        self.in_flight.set(node.get("in_flight", 0))
        self.gradient_lag.set(node.get("gradient_lag", 0.0))
        memory = node.get("memory") or {}
        for kind in ("allocated", "reserved", "peak_allocated"):
            if kind in memory:
                self.device_memory.labels(kind=kind).set(memory[kind])
        self.max_graphs.set(memory.get("max_graphs", 0))
        relay = node.get("relay") or {}
        self.relayed_peers.set(len(relay.get("relayed_peers") or ()))
        self.relayed_addrs.set(len(relay.get("addrs") or ()))
        streams = relay.get("streams") or {}
        cell = node.get("cell") or {}
        self.cell_members.set(len(cell.get("members") or ()) or 1)
        losses = node.get("last_losses") or []
        self.loss.set(losses[-1] if losses else float("nan"))
        val = node.get("val_loss")
        self.val_loss.set(float("nan") if val is None else val)
        for entry in snapshot.get("stages", []):
            alive = sum(
                1
                for p in entry.get("peers", [])
                if p.get("state") != "leaving" and p.get("swim") not in ("dead", "left")
            )
            self.peers_alive.labels(stage=str(entry["stage"])).set(alive)
        self._kept.update(
            node.get("outer") or {},
            (node.get("members") or {}).get("counters", {}),
            node.get("suspects") or {},
            {
                "relay_via_bytes": sum((streams.get("bytes_via") or {}).values()),
                "relay_forwarded_bytes": streams.get("forwarded_bytes", 0),
                "cell_kv_bytes_sent": cell.get("kv_bytes_sent", 0),
                "cell_exchange_wait_seconds": cell.get("exchange_wait_s", 0.0),
                "cell_failed_microbatches": cell.get("failed", 0),
                "recomputed_microbatches": memory.get("recomputed", 0),
                "out_of_memory_microbatches": memory.get("out_of_memory", 0),
            },
        )

    def render(self) -> bytes:
        """The prometheus text exposition of this registry."""
        self.completed_rate.set(self.completed_tokens_per_s())
        return generate_latest(self.registry)


_TOTALS = {
    "relay_via_bytes": "Bytes of this node's streams (requests and answers) that went through "
    "relays of ours to peers behind NAT.",
    "relay_forwarded_bytes": "Bytes this node passed on as a relay for other peers' streams.",
    "cell_kv_bytes_sent": "K/V frame bytes this node sent to its cell's other members.",
    "cell_exchange_wait_seconds": "Seconds this node's compute waited on its cell's K/V frames.",
    "cell_failed_microbatches": "Micro-batches this node's cell could not finish (then "
    "trained whole).",
    "recomputed_microbatches": "Backwards that recomputed their forward (more micro-batches "
    "in flight than graphs kept open).",
    "out_of_memory_microbatches": "Micro-batches refused because the device ran out of memory "
    "(each halves the graphs kept open).",
}
"""Running totals other objects keep, exported as counters (`agora_<name>_total`)."""


class _Continued:
    """Running totals whose keeper is replaced at a stage switch (a new worker, outer loop
    and cell link count from 0 again): a value below the last one seen means a new keeper,
    and what the old one had reached is carried, so the exported counter never goes down
    (Prometheus would take the drop for a restart of the node). Snapshots see the node
    between its stages (every count 0) while it loads the new one's state."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._carried: dict[str, float] = {}

    def __call__(self, values: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
        out = dict(values)
        for name in names:
            value = values.get(name, 0)
            if value < self._last.get(name, 0):
                self._carried[name] = self._carried.get(name, 0) + self._last[name]
            self._last[name] = value
            out[name] = value + self._carried.get(name, 0)
        return out


_OUTER_TOTALS = ("rounds", "bytes_sent", "bytes_received", "seconds_blocked")


class _KeptCounters:
    """Counters that other objects keep (the outer loop's totals, SWIM's counters),
    exported as the last status snapshot showed them, continued across stage switches."""

    def __init__(self) -> None:
        self._outer: Mapping[str, Any] = {}
        self._members: Mapping[str, int] = {}
        self._events: set[str] = set()
        self._suspects: Mapping[str, Any] = {}
        self._totals: Mapping[str, float] = {}
        self._continued = _Continued()

    def update(
        self,
        outer: Mapping[str, Any],
        members: Mapping[str, int],
        suspects: Mapping[str, Any] | None = None,
        totals: Mapping[str, float] | None = None,
    ) -> None:
        """`totals`: running totals by name (`_TOTALS`), as counters."""
        self._outer = self._continued(outer, _OUTER_TOTALS)
        self._members = dict(members)
        self._suspects = dict(suspects or {})
        self._totals = self._continued(totals or {}, _TOTALS)

    def collect(self) -> Iterator[Metric]:
        outer = self._outer

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"agora_{name}", doc, value=value)

        yield counter("outer_rounds", "Outer (DiLoCo) rounds completed.", outer.get("rounds", 0))
        yield counter("outer_bytes_sent", "Bytes sent in outer rounds.", outer.get("bytes_sent", 0))
        yield counter(
            "outer_bytes_received",
            "Bytes received in outer rounds.",
            outer.get("bytes_received", 0),
        )
        yield counter(
            "outer_blocked_seconds",
            "Seconds inner steps waited on outer rounds.",
            outer.get("seconds_blocked", 0.0),
        )
        for name, doc in _TOTALS.items():
            yield counter(name, doc, self._totals.get(name, 0))
        yield from self._membership()
        yield from self._flags()

    def _flags(self) -> Iterator[Metric]:
        flagged = CounterMetricFamily(
            "agora_peers_flagged",
            "Peers this node flagged (banned), by reason (docs/security.md).",
            labels=["reason"],
        )
        for reason in Reason:  # every reason from the start, so rate() works
            total = (self._suspects.get("flagged_total") or {}).get(reason.value, 0)
            flagged.add_metric([reason.value], total)
        banned = GaugeMetricFamily(
            "agora_peers_banned",
            "Peers this node ignores now (routing, rounds, state) until their ban ends.",
            value=self._suspects.get("banned_count", len(self._suspects.get("banned") or [])),
        )
        yield from (flagged, banned)

    def _membership(self) -> Iterator[Metric]:
        members = self._members
        messages = CounterMetricFamily(
            "agora_membership_messages", "SWIM messages, by direction.", labels=["direction"]
        )
        volume = CounterMetricFamily(
            "agora_membership_bytes", "SWIM message bytes, by direction.", labels=["direction"]
        )
        events = CounterMetricFamily(
            "agora_membership_events", "SWIM probes, suspicions, drops, ...", labels=["event"]
        )
        for direction in ("sent", "received"):
            messages.add_metric([direction], members.get(direction, 0))
            volume.add_metric([direction], members.get(f"{direction}_bytes", 0))
        tally: dict[str, float] = {}
        for name, value in members.items():
            if name not in ("sent", "received", "sent_bytes", "received_bytes"):
                name = _bounded(self._events, name, 2 * MAX_REASONS)
                tally[name] = tally.get(name, 0) + value
        for name, value in sorted(tally.items()):
            events.add_metric([name], value)
        yield from (messages, volume, events)
