"""Which state a joiner may adopt: what a strict majority of the stage's live replicas attest.

Each replica signs, in its directory record, the round of its outer anchor and
two digests: the anchor's, and the anchor's with the outer momentum
(`anchor_round`, `anchor_digest`, `outer_digest`). Replicas that finished the
same round with the same group hold equal anchors, so honest replicas attest
the same triple. A joiner adopts an anchor only when a strict majority of the
stage's live replicas (every ACTIVE record but its own, attesting or not, and the
WARMING ones that attest an anchor) attest its (round, digest); the momentum only
when a strict majority also attest the joint digest, else it starts from zero
momentum. One peer's claims
(inner_step, queue, anything) decide nothing.

Pure functions, tested without a network.
"""

from __future__ import annotations

import string
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from agora_node.protocol.records import NodeRecord, NodeState
from agora_node.protocol.state_blob import DIGEST_CHARS

_HEX = frozenset(string.hexdigits.lower())


@dataclass(frozen=True)
class Attestation:
    round: int
    anchor: str
    """Digest of the anchor (OuterState.digest())."""
    outer: str = ""
    """Digest of anchor and momentum (OuterState.digest(with_momentum=True))."""


@dataclass(frozen=True)
class SourcePlan:
    replicas: int
    """Live replicas of the stage (the denominator of the majority)."""
    majority: Attestation | None
    """The (round, anchor digest) a strict majority attests, or None."""
    votes: int
    sources: tuple[str, ...]
    """Peers that attest the majority, in the order to try them."""
    outer_votes: dict[str, int]
    """Among the majority's attesters: how many attest each joint digest."""

    def momentum_attested(self, outer_digest: str | None) -> bool:
        """Whether a strict majority of all live replicas attest this joint digest."""
        return bool(outer_digest) and 2 * self.outer_votes.get(outer_digest, 0) > self.replicas


def attestation_of(record: NodeRecord) -> Attestation | None:
    """The record's attestation if it has a well-formed one (else it attests nothing)."""
    digest, outer = record.anchor_digest, record.outer_digest
    if not _is_digest(digest) or (outer and not _is_digest(outer)):
        return None
    if isinstance(record.anchor_round, bool) or record.anchor_round < 0:
        return None
    return Attestation(record.anchor_round, digest, outer)


def _is_digest(value: object) -> bool:
    return isinstance(value, str) and len(value) == DIGEST_CHARS and set(value) <= _HEX


def live_replicas(records: Iterable[NodeRecord], stage: int, me: str) -> list[NodeRecord]:
    """The records that count: this stage's ACTIVE replicas other than `me`, and its
    WARMING ones that attest an anchor (one without is a node still loading its state,
    which neither backs nor blocks a majority), one per peer id."""
    by_peer: dict[str, NodeRecord] = {}
    for r in records:
        counts = r.state == NodeState.ACTIVE or (
            r.state == NodeState.WARMING and bool(r.anchor_digest)
        )
        if r.stage == stage and r.peer_id != me and counts:
            by_peer.setdefault(r.peer_id, r)
    return list(by_peer.values())


def plan_sources(replicas: Sequence[NodeRecord], exclude: Iterable[str] = ()) -> SourcePlan:
    """The strict-majority attestation among `replicas` and who may send it.

    Sources are the attesters of the majority minus `exclude` (peers already
    rejected), least loaded first (`queue`), then fastest (`throughput`), then by
    peer id: a hostile peer can put itself first by claiming to be idle and fast,
    which costs the joiner a transfer, never the state (the joiner then asks who took
    least time first, state_search._Search.spent)."""
    n = len(replicas)
    attested = {r.peer_id: a for r in replicas if (a := attestation_of(r)) is not None}
    counts = Counter((a.round, a.anchor) for a in attested.values())
    majority, votes = None, 0
    for (round_no, digest), count in counts.items():
        if 2 * count > n:
            majority, votes = Attestation(round_no, digest), count
    if majority is None:
        return SourcePlan(n, None, 0, (), {})
    backers = [
        r
        for r in replicas
        if (a := attested.get(r.peer_id)) is not None
        and (a.round, a.anchor) == (majority.round, majority.anchor)
    ]
    outer_votes = Counter(attested[r.peer_id].outer for r in backers if attested[r.peer_id].outer)
    skip = set(exclude)
    order = sorted(
        (r for r in backers if r.peer_id not in skip),
        key=lambda r: (r.queue, -r.throughput, r.peer_id),
    )
    return SourcePlan(n, majority, votes, tuple(r.peer_id for r in order), dict(outer_votes))


MIN_VOTES_OVER_CHECKPOINT = 2
"""Replicas that must attest a newer round before a node leaves its own checkpoint for it,
unless they were its partners when it saved it."""


AWAY_S = 900.0
"""How long a node must have been away (since its checkpoint was saved) before one partner's
word may replace it: a restart after a crash resumes its own."""


def prefer_replicas(
    plan: SourcePlan,
    checkpoint_round: int | None,
    partners: Collection[str] = (),
    away_s: float = 0.0,
) -> bool:
    """Fetch from replicas rather than resume the own checkpoint? Only when a strict
    majority attests a round newer than the checkpoint's (or there is no checkpoint),
    and that majority is more than one replica, or its one replica was among this
    node's `partners` (the stage's other replicas when the checkpoint was saved) and the
    node was away more than AWAY_S (`away_s`, since the save). The
    only other live replica of a stage of two may be a stranger, whose word alone must
    not replace a state this node wrote itself (one attesting `checkpoint_round + 1` had
    its self-consistent weights adopted); but a partner of before is who trained on while
    this node was away, and resuming the old state instead, then mixing it with the
    partner's, dragged the partner back toward it."""
    if plan.majority is None:
        return False
    if checkpoint_round is None:
        return True
    known = bool(plan.sources) and set(plan.sources) <= set(partners) and away_s > AWAY_S
    enough = plan.votes >= MIN_VOTES_OVER_CHECKPOINT or known
    return plan.majority.round > checkpoint_round and enough


class Verdict:
    ADOPT = "adopt"
    STALE = "stale"
    """The source moved to a newer round than the attestations we read: read them again
    (the last such state is kept meanwhile, state_search._Held)."""
    REJECT = "reject"
    """It sent what must not be adopted: never asked again in this search."""
    UNAVAILABLE = "unavailable"
    """It could not send (gone, busy, too slow): asked again on the next pass."""


def check(plan: SourcePlan, round_no: int, anchor_digest: str) -> str:
    """What to do with a decoded state whose recomputed anchor digest is `anchor_digest`."""
    majority = plan.majority
    if majority is None:
        return Verdict.REJECT
    if round_no == majority.round and anchor_digest == majority.anchor:
        return Verdict.ADOPT
    if round_no > majority.round:
        return Verdict.STALE
    return Verdict.REJECT
