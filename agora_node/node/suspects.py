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
expire first are forgotten first), so a flood of identities cannot grow it.
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


ROUND_EVIDENCE = (Reason.NORM_OUTLIER, Reason.DIRECTION_OUTLIER, Reason.REPLAY, Reason.MISMATCH)
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
            del self._flags[min(self._flags.values(), key=lambda f: f.until).peer]

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
    (seen in the lab's chaos run). So the senders count: when the norms refused since
    the last accepted one come from a strict majority (at least 2) of the senders of
    the accepted norms, the level moved for the swarm, not for a liar, and the watch
    re-bases on those refused norms (`rebased` says whom it had refused; they were
    right). A minority of those senders, or senders it never accepted, cannot move it;
    except the sole sender of the accepted norms, refused `min_samples` times in a
    row: refusing it for good would stall this node, and a sole sender decides what
    this node computes on anyway. And recent means recent: when the newest accepted
    norm is older than `max_age_s`, the watch starts over (for senders that all came
    after the ones it knew)."""

    def __init__(
        self,
        *,
        factor: float = 100.0,
        window: int = 64,
        min_samples: int = 16,
        max_age_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.factor, self.min_samples = factor, min_samples
        self.max_age_s, self.clock = max_age_s, clock
        self._accepted_at = -math.inf
        """When the newest accepted norm came (`clock`)."""
        self._norms: deque[float] = deque(maxlen=window)
        self._judging = False
        """Set once `min_samples` norms were accepted; stays set across a re-base."""
        self._accepted_from: deque[str] = deque(maxlen=window)
        """The sender of each norm in `_norms` ("" when not given)."""
        self._refused: dict[str, float] = {}
        """Since the last accepted norm: the latest refused norm of each sender of the
        accepted norms (so at most `window` entries)."""
        self._streak = 0
        """Norms refused since the last accepted one."""
        self.rebased: list[str] = []
        """The senders whose refused norms the last call re-based on (empty otherwise)."""

    def outlier(self, norm: float, sender: str = "") -> bool:
        self.rebased = []
        if not math.isfinite(norm):
            return True
        now = self.clock()
        if self._judging and now - self._accepted_at > self.max_age_s:
            self._norms.clear()
            self._accepted_from.clear()
            self._refused.clear()
            self._streak, self._judging = 0, False
        if self._judging:
            median = statistics.median(self._norms)
            if norm > self.factor * max(median, 1e-12):
                if not sender or not self._level_moved(sender, norm):
                    return True
                self.rebased = list(self._refused)
                self._norms.clear()
                self._norms.extend(self._refused.values())
                self._accepted_from.clear()
                self._accepted_from.extend(self._refused)
                self._refused.clear()
                self._streak, self._accepted_at = 0, now
                return False
        self._accepted_at = now
        self._norms.append(norm)
        self._accepted_from.append(sender)
        self._refused.clear()
        self._streak = 0
        self._judging = self._judging or len(self._norms) >= self.min_samples
        return False

    def _level_moved(self, sender: str, norm: float) -> bool:
        """Note a refused norm; True when the senders refused since the last accepted norm
        are a strict majority of the senders of the accepted norms (at least 2), or the
        sole one of those was refused `min_samples` times in a row. Only senders whose
        norms this watch accepted count: fresh identities, however many, cannot move it,
        and a liar's refused norms never become accepted ones."""
        accepted = set(self._accepted_from)
        accepted.discard("")
        if sender not in accepted:
            return False
        self._refused[sender] = norm  # bounded: senders of the accepted norms
        self._streak += 1
        if len(accepted) == 1:
            return self._streak >= self.min_samples
        return len(self._refused) >= len(accepted) // 2 + 1
