"""Who mixes with whom, and who reduces which span: pure functions of a shared view.

Every participant of a round computes the same groups and the same span plan from
the same list of peer ids, so nothing has to be negotiated on the wire:

- `partition` orders the round's participants by hash(seed, peer id) and deals
  them into groups of at least `group_size` (0: one group of everyone), a new
  random grouping every round so information spreads across the stage;
- `GroupPlan` cuts the flat parameter vector into one block-aligned span per
  member (block-aligned so a span is a whole number of quantization blocks) and
  fixes the chain of owners of each span: attempt 0 is the member at the span's
  index, attempt a the a-th member after it. A backup owner only acts when every
  owner before it failed (see allreduce.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

PHASES = ("anchor", "delta", "factor")
"""A round's mixes: anchors, pseudo-gradients (or their first factors, node/lowrank.py),
and the second factors of a low-rank round."""


def hash_order(peers: Sequence[str], seed: bytes) -> list[str]:
    """Peers sorted by sha256(seed || peer id): a fresh, unpredictable-by-name order per seed."""
    return sorted(set(peers), key=lambda p: hashlib.sha256(seed + p.encode()).digest())


def partition(peers: Sequence[str], group_size: int, seed: bytes) -> list[tuple[str, ...]]:
    """Deal the participants into groups whose sizes differ by at most one.

    group_size 0 means everyone in one group; otherwise there are N // group_size
    groups (at least one), so a group never falls below group_size unless the
    whole round does.
    """
    order = hash_order(peers, seed)
    if not order:
        return []
    count = 1 if group_size <= 0 else max(1, len(order) // group_size)
    return [tuple(order[i::count]) for i in range(count)]


def round_seed(run_id: str, stage: int, round_no: int, phase: str, peers: Sequence[str]) -> bytes:
    """Grouping seed: mixes in the participant list so nobody can aim for a partner in advance."""
    body = "\n".join([run_id, str(stage), str(round_no), phase, *sorted(set(peers))])
    return hashlib.sha256(body.encode()).digest()


def group_of(groups: Sequence[tuple[str, ...]], peer: str) -> tuple[str, ...]:
    for group in groups:
        if peer in group:
            return group
    return (peer,)


def span_bounds(numel: int, parts: int, block: int) -> tuple[tuple[int, int], ...]:
    """`parts` contiguous spans covering [0, numel), each starting on a block boundary."""
    nblocks = -(-numel // block)
    cuts = [min(numel, round(i * nblocks / parts) * block) for i in range(parts + 1)]
    cuts[-1] = numel
    return tuple((cuts[i], cuts[i + 1]) for i in range(parts))


@dataclass(frozen=True)
class GroupPlan:
    """One collective: a round, a phase, its ordered members and their spans."""

    round: int
    phase: str
    members: tuple[str, ...]
    numel: int
    block: int
    namespace: str = ""
    """Run and stage this collective belongs to; part of the group id."""
    spans: tuple[tuple[int, int], ...] = field(init=False)
    group_id: bytes = field(init=False)

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, not {self.phase!r}")
        if len(set(self.members)) != len(self.members) or not self.members:
            raise ValueError("members must be distinct and non-empty")
        object.__setattr__(self, "spans", span_bounds(self.numel, len(self.members), self.block))
        body = "\n".join(
            [self.namespace, str(self.round), self.phase, str(self.numel), str(self.block)]
            + list(self.members)
        )
        object.__setattr__(self, "group_id", hashlib.sha256(body.encode()).digest()[:16])

    @property
    def size(self) -> int:
        return len(self.members)

    def index(self, peer: str) -> int:
        return self.members.index(peer)

    def owner(self, span: int, attempt: int) -> str:
        """The member responsible for `span` at `attempt` (0: the span's own member)."""
        return self.members[(span + attempt) % self.size]

    def span_numel(self, span: int) -> int:
        lo, hi = self.spans[span]
        return hi - lo
