"""Routing: which next-stage replica gets a micro-batch (SWARM-like), as pure state.

A sender keeps a `Router` per next stage. It picks the candidate with the least
expected completion time: the round trip of the link to it, once, plus (in flight
from us + queue it announced + 1) x the time one micro-batch takes there beyond that
round trip. The round trip is what membership's probes measured (`rtt_of`; unknown
counts as 0); the time per micro-batch is measured (EMA of observed latencies, less
the round trip) when we have measurements, else derived from the throughput it
announced. The round trip is not multiplied by the queue: micro-batches queued at a
peer wait for its compute, not for the link, so a far, fast replica beats a near,
slow one once a few micro-batches are in flight (a single latency EMA charged the
round trip once per micro-batch ahead). A peer we know nothing about gets an
optimistic time so that it is probed, the way SWARM puts new peers at the top of
its heap.

Failures ban a peer for a while: `busy` for a short fixed back-off (it is alive,
only full), `timeout`, `error` and `rejected` for a ban that doubles with each
consecutive failure up to a cap; one success clears it.

The clock is passed in (`now`, seconds, any monotonic origin) and ties are
broken by an injected `random.Random`, so the policy is tested without a
network or sleeps. This module must not import hivemind.

Announced numbers come from strangers: records are range-checked when read
(records.verify_record), and this module still treats a non-finite or negative
throughput as unknown and caps the queue, so no value makes a peer look
infinitely fast. The per-peer table is bounded (`RouterConfig.max_peers`):
peers that left the directory and have nothing in flight are forgotten first.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from enum import StrEnum

from agora_node.protocol.records import MAX_QUEUE, NodeRecord, NodeState

PeerId = str

_TIE = 1e-9  # relative tolerance under which two expected times count as equal
MIN_SERVICE_SHARE = 0.25
"""A measured micro-batch time less the round trip is taken as at least this share of
it. A probe's round trip can exceed a request's when the probe met a busy loop; and a
peer that answers probes late on purpose looks far and fast, so this bounds what it
gains: at most 1 / MIN_SERVICE_SHARE times the micro-batches in flight an honest peer of
its measured latency would get, and that latency, which it cannot shorten, grows with
them."""


class FailureKind(StrEnum):
    BUSY = "busy"
    """The peer answered that it is full; it is alive, try it again soon."""
    TIMEOUT = "timeout"
    ERROR = "error"
    REJECTED = "rejected"
    """The peer refused the micro-batch (e.g. it no longer serves this stage or run)."""


@dataclass(kw_only=True)
class PeerStats:
    announced_throughput: float = 0.0
    """Tokens/s from the peer's record (0: unknown)."""
    announced_queue: int = 0
    state: str = NodeState.ACTIVE.value
    latency_ema: float | None = None
    """Seconds per micro-batch we observed, smoothed; None until the first success."""
    measured_at: float = 0.0
    """When `latency_ema` last took a sample (the sender's monotonic clock)."""
    in_flight: int = 0
    """Micro-batches we sent that have neither succeeded nor failed."""
    consecutive_failures: int = 0
    banned_until: float = 0.0
    successes: int = 0
    failures: int = 0
    last_failure: str | None = None


@dataclass(kw_only=True, frozen=True)
class RouterConfig:
    tokens_per_item: int
    """Tokens in one micro-batch (micro_batch x seq_len): turns announced tokens/s into s/item."""
    ema_alpha: float = 0.3
    """Weight of a new latency sample."""
    busy_backoff_s: float = 0.5
    ban_s: float = 2.0
    """Ban after the first timeout/error/rejection; doubles per consecutive failure."""
    max_ban_s: float = 60.0
    probe_factor: float = 0.5
    """A peer with no data and nothing in flight is estimated at this fraction of the
    best known time, so that it is probed."""
    remeasure_s: float = 20.0
    """A peer whose last sample is older than this, with nothing in flight, is probed
    again as if unknown, and its next sample replaces the old ones: a replica whose first
    micro-batch was slow (a cold start beside a busy machine) was never chosen again, so
    never measured again (a QA run: one of three replicas of a stage trained 1 micro-batch
    in 4 minutes)."""
    max_peers: int = 1024
    """Peers the router keeps statistics for; beyond, the least recently announced ones
    with nothing in flight are forgotten."""

    def __post_init__(self) -> None:
        if self.tokens_per_item <= 0:
            raise ValueError(f"tokens_per_item must be positive, got {self.tokens_per_item}")
        if not 0 < self.ema_alpha <= 1:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")
        if not 0 < self.probe_factor <= 1:
            raise ValueError(f"probe_factor must be in (0, 1], got {self.probe_factor}")
        if self.max_peers <= 0:
            raise ValueError(f"max_peers must be positive, got {self.max_peers}")


class Router:
    """Per-peer statistics and the choice of the next-stage peer for one sender."""

    def __init__(
        self,
        config: RouterConfig,
        rng: random.Random | None = None,
        rtt_of: Callable[[PeerId], float | None] | None = None,
    ) -> None:
        self.config = config
        self._rng = rng or random.Random()
        self._rtt_of = rtt_of
        self._peers: dict[PeerId, PeerStats] = {}

    def _stats(self, peer: PeerId) -> PeerStats:
        stats = self._peers.get(peer)
        if stats is None:
            stats = self._peers[peer] = PeerStats()
            self._bound(keep=peer)
        return stats

    def _bound(self, keep: PeerId | None = None, announced: set[PeerId] = frozenset()) -> None:
        """Forget peers beyond `max_peers`, oldest first: those no longer announced, then
        announced ones; one with work in flight (or `keep`) only when nothing else is left."""
        excess = len(self._peers) - self.config.max_peers
        if excess <= 0:
            return

        def order(peer: PeerId) -> int:
            if self._peers[peer].in_flight > 0:
                return 2
            return 1 if peer in announced else 0

        candidates = sorted(
            (p for p in self._peers if p != keep), key=order
        )  # stable: oldest first
        for peer in candidates[:excess]:
            del self._peers[peer]

    # ---- inputs --------------------------------------------------------------------
    def update_announced(self, records: Iterable[NodeRecord]) -> None:
        """Take throughput, queue and state from the peers' latest directory records."""
        announced: set[PeerId] = set()
        for record in records:
            if len(announced) >= self.config.max_peers:
                break  # the directory bounds what it keeps; this bounds what we take
            announced.add(record.peer_id)
            stats = self._peers.pop(record.peer_id, None) or PeerStats()
            self._peers[record.peer_id] = stats  # most recently announced last
            throughput = record.throughput
            finite = isinstance(throughput, int | float) and math.isfinite(throughput)
            stats.announced_throughput = max(0.0, float(throughput)) if finite else 0.0
            stats.announced_queue = min(max(0, int(record.queue)), MAX_QUEUE)
            stats.state = record.state
        self._bound(announced=announced)

    def on_sent(self, peer: PeerId, now: float) -> None:
        self._stats(peer).in_flight += 1

    def on_success(self, peer: PeerId, latency_s: float, now: float) -> None:
        stats = self._stats(peer)
        stats.in_flight = max(0, stats.in_flight - 1)
        a = self.config.ema_alpha
        latency_s = max(0.0, latency_s) if math.isfinite(latency_s) else self.config.max_ban_s
        stale = self._stale(stats, now)
        stats.latency_ema = (
            latency_s
            if stats.latency_ema is None or stale
            else a * latency_s + (1 - a) * stats.latency_ema
        )
        stats.measured_at = now
        stats.successes += 1
        stats.consecutive_failures = 0
        stats.banned_until = 0.0

    def on_failure(self, peer: PeerId, now: float, kind: FailureKind | str) -> None:
        kind = FailureKind(kind)
        stats = self._stats(peer)
        stats.in_flight = max(0, stats.in_flight - 1)
        stats.failures += 1
        stats.last_failure = kind.value
        if kind is FailureKind.BUSY:
            # Alive but full: a short pause, and not a step towards a long ban.
            ban = self.config.busy_backoff_s
        else:
            stats.consecutive_failures += 1
            doubling = min(stats.consecutive_failures - 1, 30)  # 2**30 s is past any cap
            ban = min(self.config.ban_s * 2**doubling, self.config.max_ban_s)
        stats.banned_until = max(stats.banned_until, now + ban)

    # ---- the choice ------------------------------------------------------------------
    def rtt(self, peer: PeerId) -> float:
        """The measured round trip to `peer` (seconds), 0 when unknown or implausible."""
        rtt = self._rtt_of(peer) if self._rtt_of is not None else None
        if not isinstance(rtt, int | float) or not math.isfinite(rtt) or rtt < 0:
            return 0.0
        return float(rtt)

    def item_time(self, peer: PeerId) -> float | None:
        """Seconds one micro-batch takes at `peer` beyond the link's round trip: measured,
        else announced, else None."""
        stats = self._peers.get(peer)
        if stats is not None and stats.latency_ema is not None:
            return max(stats.latency_ema - self.rtt(peer), MIN_SERVICE_SHARE * stats.latency_ema)
        if stats is not None and stats.announced_throughput > 0:
            return self.config.tokens_per_item / stats.announced_throughput
        return None

    def _stale(self, stats: PeerStats, now: float | None) -> bool:
        """Whether the peer's measured latency is too old to go by (`remeasure_s`)."""
        return (
            now is not None
            and stats.latency_ema is not None
            and now - stats.measured_at > self.config.remeasure_s
        )

    def expected_time(
        self, peer: PeerId, *, default: float = 1.0, now: float | None = None
    ) -> float:
        """Expected completion time of one more micro-batch sent to `peer` now: its round
        trip once, plus the micro-batches ahead of it there and itself at `item_time` each.

        `default` is the per-item time assumed for a peer we know nothing about
        (choose() passes the best known one), or whose measurement is stale at `now`
        (`remeasure_s`) with nothing in flight.
        """
        stats = self._peers.get(peer) or PeerStats()
        per_item = self.item_time(peer)
        if stats.in_flight == 0 and self._stale(stats, now):
            per_item = None  # probed again, as a peer we know nothing about
        if per_item is None:
            # Optimistic until one probe is out: it gets tried soon, but not flooded
            # before we learn whether it answers at all.
            per_item = default * (self.config.probe_factor if stats.in_flight == 0 else 1.0)
        return self.rtt(peer) + (stats.in_flight + stats.announced_queue + 1) * per_item

    def usable(self, peer: PeerId, now: float) -> bool:
        stats = self._peers.get(peer)
        if stats is None:
            return True
        # Joining nodes have no weights yet; leaving nodes take no new work.
        return stats.banned_until <= now and stats.state not in (
            NodeState.JOINING,
            NodeState.LEAVING,
        )

    def choose(
        self, candidates: Iterable[PeerId], now: float, exclude: Iterable[PeerId] = ()
    ) -> PeerId | None:
        """The usable candidate with the least expected completion time; None if none is usable."""
        skip = set(exclude)
        usable = [p for p in dict.fromkeys(candidates) if p not in skip and self.usable(p, now)]
        if not usable:
            return None
        known = [t for p in usable if (t := self.item_time(p)) is not None]
        default = min(known, default=1.0)  # with nothing known, all peers look alike
        times = {p: self.expected_time(p, default=default, now=now) for p in usable}
        best = min(times.values())
        tied = [p for p, t in times.items() if t <= best * (1 + _TIE)]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)

    # ---- status ------------------------------------------------------------------------
    def snapshot(self, now: float | None = None) -> dict[PeerId, dict]:
        """Per-peer statistics for the status page (plain JSON-able values)."""
        out = {}
        for peer, stats in self._peers.items():
            row = asdict(stats)
            if now is not None:
                row["banned_for_s"] = max(0.0, stats.banned_until - now)
            out[peer] = row
        return out
