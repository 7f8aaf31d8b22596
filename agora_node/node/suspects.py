"""Who this node caught misbehaving, and until when it ignores them: the suspects ledger.

A peer is flagged only on evidence this node saw itself (never on another peer's
word): an outer-round contribution it refused as a reducer for its norm or its
direction, or that replayed one of an earlier round, a span
result that failed the witness check, a micro-batch whose activations, gradient
or loss were not finite, or a gradient whose norm was far above the recent ones
(`NormWatch`). A flag bans the peer for `ban_s` seconds (a new flag restarts the
period). What a ban does is decided by its users (docs/security.md, "Flagging
and bans"): the router skips the peer, the reducer drops its parts, catch-up and
state transfer ignore its claims, and its id goes into this node's round entries,
where a strict majority of a round's entrants naming it leaves it out of the round
for everyone (groups.py, `excluded`).

Pure: the clock is injected; the ledger is bounded (`max_peers`, the entries that
expire first are forgotten first, outer-round evidence last), so a flood of identities
cannot grow it, nor flush the bans that round entries name.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from enum import StrEnum

DEFAULT_BAN_S = 600.0
MAX_EVIDENCE = 120


class Reason(StrEnum):
    NORM_OUTLIER = "norm_outlier"
    """Its outer contribution was refused by this node, as a reducer, for its norm."""
    DIRECTION_OUTLIER = "direction_outlier"
    """Its outer contribution was refused by this node, as a reducer, for pointing away
    from the others' (its cosine with their median at most `min_cosine`)."""
    REPLAY = "replay"
    """Its outer delta part, as this node reduced it, repeated one it sent in an earlier
    round (comms/collective/replay.py)."""
    MISMATCH = "mismatch"
    """A span result it produced (or witnessed) failed the witness check."""
    EQUIVOCATION = "equivocation"
    """It signed one outer part for a span's owner and another for the span's witness
    (comms/collective/proofs.py): two statements under its key prove it."""
    NONFINITE = "nonfinite"
    """It sent non-finite activations, gradients or loss in the pipeline."""
    CANARY = "canary"
    """Its output for a canary micro-batch departed from the strict majority of the
    stage's replicas probed with the same input (canary.py)."""
    MALFORMED = "malformed"
    """It answered a micro-batch with a reply that does not decode (its header's types,
    its frames): streams are authenticated, so the bytes are the peer's own."""
    PIPELINE_OUTLIER = "pipeline_outlier"
    """It sent activations or returned a gradient whose norm is far above the recent ones
    (`NormWatch`)."""


ROUND_EVIDENCE = (
    Reason.NORM_OUTLIER,
    Reason.DIRECTION_OUTLIER,
    Reason.REPLAY,
    Reason.MISMATCH,
    Reason.EQUIVOCATION,
)
"""What a replica saw in its own stage's outer rounds: the reasons its round entries name."""


@dataclass
class Flag:
    peer: str
    reason: Reason
    evidence: str
    since: float
    until: float
    count: int = 1


class Suspects:
    """Flags with a ban period; `is_banned` answers for the moment of the call."""

    def __init__(
        self,
        *,
        me: str = "",
        ban_s: float = DEFAULT_BAN_S,
        max_peers: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (ban_s >= 0 and math.isfinite(ban_s)):
            raise ValueError(f"ban period must be finite and >= 0, not {ban_s}")
        self.me, self.ban_s, self.max_peers, self.clock = me, ban_s, max_peers, clock
        self._flags: dict[str, Flag] = {}
        self.flagged_total: dict[str, int] = {r.value: 0 for r in Reason}
        """Flags raised since start, by reason (a peer flagged twice counts twice)."""

    def flag(self, peer: str, reason: Reason, evidence: str = "") -> bool:
        """Ban `peer` for `ban_s` from now; True if it was not banned before."""
        if not peer or peer == self.me:
            return False
        now = self.clock()
        self.flagged_total[reason.value] += 1
        old = self._flags.get(peer)
        fresh = old is None or old.until <= now
        count = 1 if fresh else old.count + 1
        since = now if fresh else old.since
        self._flags[peer] = Flag(
            peer, reason, evidence[:MAX_EVIDENCE], since, now + self.ban_s, count
        )
        self._bound(now)
        return fresh

    def pardon(self, peers: Collection[str], reason: Reason) -> None:
        """Lift the bans of `peers` whose last flag was for `reason` (the evidence turned
        out to be this node's own mistake, as a stale `NormWatch`'s)."""
        for peer in peers:
            f = self._flags.get(peer)
            if f is not None and f.reason == reason:
                del self._flags[peer]

    def is_banned(self, peer: str) -> bool:
        f = self._flags.get(peer)
        return f is not None and f.until > self.clock()

    def banned(self) -> frozenset[str]:
        now = self.clock()
        return frozenset(p for p, f in self._flags.items() if f.until > now)

    def newest_banned(self, limit: int, reasons: Collection[Reason] = tuple(Reason)) -> list[str]:
        """At most `limit` peers banned now whose last flag has one of `reasons`, the most
        recently flagged first (round entries name only outer-round evidence)."""
        now = self.clock()
        live = [f for f in self._flags.values() if f.until > now and f.reason in reasons]
        return [f.peer for f in sorted(live, key=lambda f: -f.until)[:limit]]

    def _bound(self, now: float) -> None:
        for peer in [p for p, f in self._flags.items() if f.until <= now]:
            del self._flags[peer]
        while len(self._flags) > self.max_peers:
            # outer-round evidence goes last: identities are free, and sybils flagged in
            # the pipeline (one non-finite micro-batch each) flushed the round bans out
            oldest = min(self._flags.values(), key=lambda f: (f.reason in ROUND_EVIDENCE, f.until))
            del self._flags[oldest.peer]

    def status(self) -> dict:
        """For the status page: the peers banned now, and the totals by reason."""
        now = self.clock()
        self._bound(now)
        return {
            "ban_s": self.ban_s,
            "banned": [
                {
                    "peer": f.peer,
                    "reason": f.reason.value,
                    "evidence": f.evidence,
                    "flags": f.count,
                    "flagged_s_ago": round(now - f.since, 1),
                    "ban_left_s": round(f.until - now, 1),
                }
                for f in sorted(self._flags.values(), key=lambda f: f.since)
            ],
            "flagged_total": dict(self.flagged_total),
        }


class NormWatch:
    """Is a norm an outlier against the recent ones? (pipeline gradients, activations)

    Keeps the last `window` norms it accepted; a norm above `factor` x their median
    is an outlier (and is not added), once `min_samples` are known. Before that,
    nothing is an outlier: a node cannot judge from a handful of micro-batches.

    The accepted norms go stale when training moves the level while this node gets
    no traffic: early on `tiny`'s boundary activations grow about 400x in 40 steps,
    and a replica that sat idle for a few steps then refused every sender for good
    (seen in the lab's chaos run, and when a cell's helper was left alone). So the
    senders count. Of the senders of the accepted norms, those heard from (accepted
    or refused) within `active_s` are the active ones; when a strict majority of them
    (at least 2) were refused since the last accepted norm, or the only active one was
    refused `sole_refusals` times in a row, the level moved for the swarm, not for a
    liar: the watch re-bases on those refused norms (`rebased` says whom it had
    refused; they were right). Senders it never accepted, however many, and a minority
    of the active ones cannot move it. And recent means recent: when it accepted
    nothing for `max_age_s`, the watch starts over."""

    def __init__(
        self,
        *,
        factor: float = 100.0,
        window: int = 64,
        min_samples: int = 16,
        active_s: float = 60.0,
        sole_refusals: int = 4,
        max_age_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.factor, self.min_samples = factor, min_samples
        self.active_s, self.sole_refusals = active_s, sole_refusals
        self.max_age_s, self.clock = max_age_s, clock
        self._accepted_at = -math.inf
        """When the newest accepted norm came (`clock`)."""
        self._norms: deque[float] = deque(maxlen=window)
        self._judging = False
        """Set once `min_samples` norms were accepted; stays set across a re-base."""
        self._accepted_from: deque[str] = deque(maxlen=window)
        """The sender of each norm in `_norms` ("" when not given)."""
        self._heard: dict[str, float] = {}
        """When each sender of the accepted norms was last heard from (at most 2 x window
        entries: only senders of accepted norms are noted)."""
        self._refused: dict[str, float] = {}
        """Since the last accepted norm: the latest refused norm of each sender of the
        accepted norms (so at most `window` entries)."""
        self._streak = 0
        """Norms of senders of the accepted norms refused since the last accepted one."""
        self.rebased: list[str] = []
        """The senders whose refused norms the last call re-based on (empty otherwise)."""

    def outlier(self, norm: float, sender: str = "") -> bool:
        self.rebased = []
        if not math.isfinite(norm):
            return True
        now = self.clock()
        if self._judging and now - self._accepted_at > self.max_age_s:
            self._accept({}, now, keep=False)
            self._heard.clear()
            self._judging = False
        if self._judging:
            median = statistics.median(self._norms)
            if norm > self.factor * max(median, 1e-12):
                if not sender or not self._level_moved(sender, norm, now):
                    return True
                self.rebased = list(self._refused)
                self._accept(self._refused, now, keep=False)
                return False
        self._accept({sender: norm}, now)
        if sender:
            self._heard[sender] = now
            if len(self._heard) > 2 * self._norms.maxlen:
                known = set(self._accepted_from)
                self._heard = {p: t for p, t in self._heard.items() if p in known}
        self._judging = self._judging or len(self._norms) >= self.min_samples
        return False

    def _accept(self, norms: dict[str, float], now: float, *, keep: bool = True) -> None:
        """Take `norms` (sender -> norm) as accepted, after the ones kept (`keep`) or
        instead of them; refusals since the last accepted norm are forgotten."""
        if not keep:
            self._norms.clear()
            self._accepted_from.clear()
        self._norms.extend(norms.values())
        self._accepted_from.extend(norms)
        self._refused, self._streak = {}, 0
        if norms:
            self._accepted_at = now

    def _level_moved(self, sender: str, norm: float, now: float) -> bool:
        """Note a refused norm; True when the level moved for the active senders of the
        accepted norms (see the class). Only senders whose norms this watch accepted are
        noted or counted: fresh identities cannot move it, nor crowd the others out."""
        accepted = set(self._accepted_from)
        accepted.discard("")
        if sender not in accepted:
            return False
        self._heard[sender] = now
        self._refused[sender] = norm
        self._streak += 1
        active = {p for p in accepted if now - self._heard.get(p, -math.inf) <= self.active_s}
        if len(active) == 1:
            return self._streak >= self.sole_refusals
        return len(active & set(self._refused)) >= len(active) // 2 + 1
