"""Who this node caught misbehaving, and until when it ignores them: the suspects ledger.

A peer is flagged only on evidence this node saw itself (never on another peer's
word): an outer-round contribution it refused as a reducer for its norm or its
direction, or that replayed one of an earlier round, a span
result that failed the witness check, a micro-batch whose activations, gradient
or loss were not finite, or activations or a gradient whose norm was far from the
recent ones (`NormWatch`). A flag bans the peer for `ban_s` seconds (a new flag
restarts the period). What a ban does is decided by its users (docs/security.md, "Flagging
and bans"): the router skips the peer, the reducer drops its parts, catch-up and
state transfer ignore its claims, and its id goes into this node's round entries,
where a strict majority of a round's entrants naming it leaves it out of the round
for everyone (groups.py, `excluded`).

Pure: the clock is injected; the ledger is bounded (`max_peers`, 4096: the entries that
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
MAX_PEERS = 4096
"""Peers the ledger holds at most. Each flag costs a stranger an identity with a record at
a neighbouring stage and a request: with 256, as many Sybils flagged once apiece pushed a
lying replica's pipeline ban out, and the router used it again."""
STATUS_ROWS = 64
"""Banned peers the status page lists (the most recently flagged), beside their count."""


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
    """It sent activations or returned a gradient whose norm is far above or below the
    recent ones (`NormWatch`)."""


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
        max_peers: int = MAX_PEERS,
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
        if not fresh and old.reason in ROUND_EVIDENCE and reason not in ROUND_EVIDENCE:
            # outer-round evidence stands, as it was: a banned liar that sent one
            # non-finite micro-batch had its flag become `nonfinite` and dropped out of the
            # round entries that leave it out of rounds (or, as a `pipeline_outlier`, was
            # pardoned); and a pipeline flag, maybe this node's own mistake, does not
            # lengthen a round-evidence ban either
            old.count += 1
            return False
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
        return self.reason_of(peer) is not None

    def reason_of(self, peer: str) -> Reason | None:
        """Why `peer` is banned now (its last flag's reason), or None if it is not."""
        f = self._flags.get(peer)
        return f.reason if f is not None and f.until > self.clock() else None

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
        if len(self._flags) > self.max_peers:
            # outer-round evidence goes last: identities are free, and sybils flagged in
            # the pipeline (one non-finite micro-batch each) flushed the round bans out.
            # An eighth goes at once, so a flood pays one sort per max_peers / 8 flags,
            # not a scan of the ledger per flag.
            keep = self.max_peers - max(1, self.max_peers // 8)
            order = sorted(
                self._flags.values(), key=lambda f: (f.reason in ROUND_EVIDENCE, f.until)
            )
            for f in order[: len(order) - keep]:
                del self._flags[f.peer]

    def status(self) -> dict:
        """For the status page: the peers banned now, and the totals by reason."""
        now = self.clock()
        self._bound(now)
        newest = sorted(self._flags.values(), key=lambda f: f.since)[-STATUS_ROWS:]
        return {
            "ban_s": self.ban_s,
            "banned_count": len(self._flags),
            "banned": [
                {
                    "peer": f.peer,
                    "reason": f.reason.value,
                    "evidence": f.evidence,
                    "flags": f.count,
                    "flagged_s_ago": round(now - f.since, 1),
                    "ban_left_s": round(f.until - now, 1),
                }
                for f in newest
            ],
            "flagged_total": dict(self.flagged_total),
        }


GAP_WEIGHT = 0.25
"""How much of each new gap between a sender's norms goes into its usual gap."""


class NormWatch:
    """Is a norm an outlier against the recent ones? (pipeline gradients, activations)

    The level is the median, over the senders of the last `window` norms it took, of
    each sender's median norm: one vote per sender, however often it sends, and at most
    `per_sender` of the window's norms are one sender's (a fast sender cannot push the
    others' norms out). A norm outside [level / `factor`, `factor` x level] is an outlier,
    once `min_samples` norms were taken; before that, nothing is: a node cannot judge from
    a handful of micro-batches. Too small counts as well as too large: a stranger that
    sent tiny norms faster than the honest senders walked an upper-only bound down until
    it refused (and flagged) every honest sender. A norm that is not an outlier is taken,
    but it counts toward the level only within sqrt(`factor`) of it, and the median over
    senders is taken in log scale (an even count gives the geometric mean of the middle
    two): so where a stranger faces a single honest sender, it can move the level at
    most sqrt(`factor`) away from the honest one's norms, which stay within the bound,
    instead of walking it off by repeating norms near the bound.

    The norms taken go stale when training moves the level while this node gets no
    traffic: early on `tiny`'s boundary activations grow about 400x in 40 steps, and a
    replica that sat idle for a few steps then refused every sender for good (seen in
    the lab's chaos run, and when a cell's helper was left alone). So the senders count.
    Of the senders of the window's norms, those heard from (taken or refused) lately are
    the active ones: within `active_gaps` of the sender's usual gap between norms (a
    moving average), at least `active_min_s` and at most `active_s`. A replica that went
    quiet (a laptop asleep, a link down) stops counting within seconds when it sent
    often, where a fixed 60 s had its frozen level refuse the one still sending for a
    minute and more (the sender backs off); a slow sender keeps its vote between norms.
    When a strict majority of the active ones (at least 2) had their latest norm off the
    level (refused, or taken but too far to count), or the only active one was off
    `sole_refusals` times in a row, and the norms off agree (one side of the level,
    within sqrt(`factor`) of each other), the level moved for the swarm, not for a liar:
    the watch re-bases on those norms (`rebased` says whom it had refused; they were
    right). A sender's norm counted clears only its own, so a liar whose norms
    count cannot hold off a re-base. Senders never in the window, however many, and a
    minority of the active ones cannot move it. And recent means recent: when it took
    nothing for `max_age_s`, the watch starts over; when no sender of the window's norms
    was heard from for `active_s`, a new sender's norm becomes the level (judged on)."""

    def __init__(
        self,
        *,
        factor: float = 100.0,
        window: int = 64,
        per_sender: int = 16,
        min_samples: int = 16,
        active_s: float = 60.0,
        active_min_s: float = 10.0,
        active_gaps: float = 8.0,
        sole_refusals: int = 4,
        max_age_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.factor, self.per_sender, self.min_samples = factor, per_sender, min_samples
        self.active_s, self.sole_refusals = active_s, sole_refusals
        self.active_min_s, self.active_gaps = active_min_s, active_gaps
        self.max_age_s, self.clock = max_age_s, clock
        self._accepted_at = -math.inf
        """When the newest norm was taken (`clock`)."""
        self._norms: deque[tuple[str, float]] = deque(maxlen=window)
        """The norms that count toward the level, with their senders ("" when not given)."""
        self._taken = 0
        """Norms taken since the start (or the last start-over)."""
        self._judging = False
        """Set once `min_samples` norms were taken; stays set across a re-base."""
        self._heard: dict[str, tuple[float, float]] = {}
        """When each sender of the window's norms was last heard from, and its usual gap
        between norms (a moving average; inf until it sent twice). At most 2 x window
        entries: only senders of norms taken are noted."""
        self._off: dict[str, tuple[float, int, bool]] = {}
        """The senders of the window's norms whose latest norm was off the level: that
        norm, how many in a row were off that way, and whether it was refused (else taken,
        but too far to count toward the level)."""
        self.rebased: list[str] = []
        """The senders whose refused norms the last call re-based on (empty otherwise)."""

    def level(self) -> float:
        """The median over senders of each one's median norm in the window (log scale)."""
        by_sender: dict[str, list[float]] = {}
        for sender, norm in self._norms:
            by_sender.setdefault(sender, []).append(norm)
        logs = [math.log(max(statistics.median(n), 1e-12)) for n in by_sender.values()]
        return math.exp(statistics.median(logs))

    def outlier(self, norm: float, sender: str = "") -> bool:
        self.rebased = []
        if not math.isfinite(norm):
            return True
        now = self.clock()
        if self._judging and now - self._accepted_at > self.max_age_s:
            self._rebase({}, now)
            self._heard.clear()
            self._taken, self._judging = 0, False
        known = bool(sender) and any(s == sender for s, _ in self._norms)
        if self._judging and sender and not known and self._deserted(now):
            self._rebase({sender: norm}, now)  # judged from the next norm on
            self._hear(sender, now)
            return False
        if known:  # once per norm (a second gap of 0 would halve its usual gap)
            self._hear(sender, now)
        counts = True
        if self._judging:
            level, near = self.level(), math.sqrt(self.factor)
            inside = level / self.factor <= norm <= self.factor * level
            counts = level / near <= norm <= near * level
            if not counts and sender:
                moved = self._level_moved(sender, norm, now, level, refused=not inside)
                if moved is not None:
                    self.rebased = [p for p in moved if self._off[p][2]]  # refused ones
                    self._rebase(moved, now)
                    return False
            if not inside:
                return True
        self._accepted_at = now
        if counts:
            self._off.pop(sender, None)
            self._add(sender, norm)
            self._taken += 1
        if sender and not known:  # a sender's first norm taken
            self._hear(sender, now)
            if len(self._heard) > 2 * self._norms.maxlen:
                window = {s for s, _ in self._norms}
                self._heard = {p: h for p, h in self._heard.items() if p in window}
        self._judging = self._judging or self._taken >= self.min_samples
        return False

    def _add(self, sender: str, norm: float) -> None:
        """Append `norm` to the window; a sender with `per_sender` norms there loses its
        oldest instead of pushing out the window's oldest."""
        mine = [i for i, (s, _) in enumerate(self._norms) if s == sender]
        if len(mine) >= self.per_sender:
            del self._norms[mine[0]]
        self._norms.append((sender, norm))

    def _hear(self, sender: str, now: float) -> None:
        """Note a norm from `sender` at `now`, and fold the gap since its last one into its
        usual gap (a sender can only shorten or lengthen its own)."""
        last, gap = self._heard.get(sender, (None, math.inf))
        if last is not None:
            since = max(now - last, 0.0)
            gap = since if math.isinf(gap) else gap + GAP_WEIGHT * (since - gap)
        self._heard[sender] = (now, gap)

    def _active(self, sender: str, now: float) -> bool:
        """Heard from lately: within `active_gaps` usual gaps, clamped to
        [`active_min_s`, `active_s`] (`active_s` until it sent twice)."""
        last, gap = self._heard.get(sender, (-math.inf, math.inf))
        lately = min(self.active_s, max(self.active_min_s, self.active_gaps * gap))
        return now - last <= lately

    def _deserted(self, now: float) -> bool:
        """No sender of the window's norms was heard from for `active_s`: the level is of
        traffic that stopped, and a new sender's norm becomes it. The only replica of the
        stage before left, and the node that moved there from scratch was refused for
        `max_age_s` (its norms never joined the window, so nothing could re-base on them)
        and flagged at every micro-batch: the stage's training stopped meanwhile. A full
        `active_s` of silence, not a sender's usual gaps: a stranger's first norm after a
        pause as short as a blocking round set the level, and honest norms were refused."""
        senders = {s for s, _ in self._norms}
        if not senders or "" in senders:
            return False
        return all(now - self._heard.get(p, (-math.inf, 0.0))[0] > self.active_s for p in senders)

    def _rebase(self, norms: dict[str, float], now: float) -> None:
        """Take `norms` (sender -> norm) instead of the window's; refusals are forgotten."""
        self._norms.clear()
        for sender, norm in norms.items():
            self._add(sender, norm)
        self._off = {}
        if norms:
            self._accepted_at = now

    def _level_moved(
        self, sender: str, norm: float, now: float, level: float, *, refused: bool
    ) -> dict[str, float] | None:
        """Note a norm off the level: refused (outside the bound) or only far (taken, not
        counted); when the level moved for the active senders of the window's norms (see
        the class), their latest such norms (sender -> norm) to re-base on, else None.
        Far norms count as well as refused ones: honest norms that all jumped more than
        sqrt(factor) froze the level, until the faster-growing sender's passed the bound
        and it was refused and flagged. Only senders of the window's norms are noted or
        counted: fresh identities cannot move it, nor crowd the others out. And the norms
        re-based on must agree: all on one side of the level, within sqrt(factor) of each
        other (senders that moved together); else a stranger facing one honest sender
        held the level 10x off, so that the honest norms fell just outside the counting
        band, and re-based the watch on its own huge norm beside them."""
        known = {s for s, _ in self._norms} - {""}
        if sender not in known:
            return None
        _, before, was_refused = self._off.get(sender, (norm, 0, refused))
        in_a_row = before + 1 if was_refused == refused else 1
        self._off = {p: o for p, o in self._off.items() if p in known}
        self._off[sender] = (norm, in_a_row, refused)
        active = {p for p in known if self._active(p, now)}
        off = {p: self._off[p][0] for p in active if p in self._off}
        if len(active) == 1:
            moved = in_a_row >= self.sole_refusals
        else:
            moved = len(off) >= len(active) // 2 + 1
        values = list(off.values())
        agree = (all(v > level for v in values) or all(v < level for v in values)) and max(
            values, default=0.0
        ) <= math.sqrt(self.factor) * min(values, default=0.0)
        return off if moved and agree else None
