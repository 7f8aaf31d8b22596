"""Per-collective state shared by a member's client side and its RPC handlers.

One `RoundState` per (round, phase) this member takes part in, kept by a
`RoundBook` for a few rounds after it ends so that slower members can still fetch
results. For every span it records:

- the contributions pushed to this member (only for the span it owns at attempt 0),
  decoded and validated on arrival;
- `final`: the agreed value of the span (its frame bytes and the attempt that
  vouched for it), once known;
- `min_attempt`: raised when the owner of a later attempt asks this member for its
  contribution. From then on a result from an earlier attempt is refused, and this
  member's own reduce of the span (if it was the owner) is abandoned. This promise
  is what lets a backup re-reduce a span without two different values surviving.
  A running member makes it only once it would move on by itself; one asked before it
  ran keeps it (`deferred`) only then too.

All mutations happen on the event loop thread, so check-and-set is atomic.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from torch import Tensor

from agora_node.comms.collective.plan import GroupPlan
from agora_node.comms.collective.proofs import Proof

LINGER_ROUNDS = 2  # a state is dropped this many rounds after its own
AHEAD_ROUNDS = 2  # promises for unregistered collectives at most this many rounds ahead
MAX_PENDING = 1024  # promises for unregistered collectives kept at most
MAX_PENDING_PER_ASKER = 32
"""Of them, from one peer: a backup asks once per span and attempt it re-reduces, so one
stranger cannot fill the table and leave an honest backup's promise unkept."""


class UnknownRoundError(LookupError):
    """A message about a round and phase this member has not registered (yet)."""


class Signal:
    """Broadcast 'something changed' to coroutines waiting on a predicate."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """True once predicate() holds; False if `timeout` seconds pass first."""
        deadline = time.monotonic() + max(0.0, timeout)
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._event.wait(), left)
            except TimeoutError:
                return predicate()
        return True


@dataclass
class Contribution:
    weight: float
    value: Tensor
    frame: bytes
    proof: Proof | None = None
    """Its sender's signed entry (proofs.py); None where parts go unsigned."""


@dataclass
class Final:
    frame: bytes
    attempt: int
    value: Tensor
    members: bytes = b""
    """Bitmask over the plan's members whose parts the reducer aggregated (verify.py)."""
    proofs: bytes = b""
    """Their signed entries, in plan order (proofs.py; b"" unsigned)."""
    receipt: bytes = b""
    """The span witness's signed receipt for the parts it held (proofs.sign_receipt)."""


@dataclass
class SpanState:
    parts: dict[str, Contribution] = field(default_factory=dict)
    refused: set[str] = field(default_factory=set)
    """Members whose contribution was invalid: nothing more is expected from them."""
    final: Final | None = None
    min_attempt: int = 0
    witness_parts: dict[str, Contribution] = field(default_factory=dict)
    """Parts pushed to this member as the span's witness (verify.py)."""
    witness_refused: set[str] = field(default_factory=set)
    """Members whose copy for this member as the witness was invalid."""
    given_up: int = -1
    """The last attempt this member gave up on for this span (its owner failed or was late;
    handlers.on_query promises a later one only then, or after `RoundState.opens`)."""
    checking: bool = False
    """The attempt-0 owner's result is in hand and being checked with the witness: this
    member will adopt it or fall back, never move on, so it promises no later attempt
    meanwhile (a witness answering the check late would otherwise get the checked result
    refused as stale and its own unchecked one adopted)."""
    deferred: int = 0
    """An attempt promised before this member ran the collective (its backup asked while
    this member had not registered or started): kept only once this member would move on
    to it by itself (`RoundState.settle`); for its own span, only if no other owner accepts
    this member's parts (backup.Backup._keep_deferred_promise). Applied at once, a witness
    asking early could take its span over with an unchecked attempt-1 result."""


@dataclass
class CollectiveStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    accepted: int = 0
    rejected: Counter = field(default_factory=Counter)
    """Contributions or results refused, by reason (malformed, late, wrong group...)."""
    failed_peers: set[str] = field(default_factory=set)
    repaired_spans: int = 0
    fallback_spans: int = 0
    clip_radii: list[float] = field(default_factory=list)
    outliers: set[str] = field(default_factory=set)
    """Members whose contribution this member refused as a reducer for its norm."""
    direction_outliers: set[str] = field(default_factory=set)
    """Members whose contribution this member refused as a reducer for its direction."""
    replayed: set[str] = field(default_factory=set)
    """Members whose delta part repeated one they sent in an earlier round (replay.py)."""
    mismatched: set[str] = field(default_factory=set)
    """Owners whose result for their span failed the witness check (not adopted)."""
    mismatch_witnesses: set[str] = field(default_factory=set)
    """Witnesses of those spans, when another member than this one: either may have lied."""
    equivocated: set[str] = field(default_factory=set)
    """Members that signed one part for a span's owner and another for its witness
    (proofs.py): the failed check is theirs, not the owner's or the witness's."""
    ignored: set[str] = field(default_factory=set)
    """Members whose parts this member, as a reducer, dropped (`AllReduce(ignore=...)`)."""
    checked_spans: int = 0
    """Results adopted after their witness confirmed them."""
    unchecked_spans: int = 0
    """Results adopted without a check (their witness did not answer)."""
    late_spans: int = 0
    """Other owners' spans adopted from a later attempt: the first owner was late or gone."""

    def reject(self, reason: str) -> None:
        self.rejected[reason] += 1


@dataclass
class Witnessed:
    """A witness's reduction of its span over the parts a check names (`final`), or, when
    it lacks some of them, who sent those (`missing`)."""

    final: Final | None
    missing: tuple[str, ...] = ()


class WitnessBusy(RuntimeError):
    """The asker had this witness compute as many reductions as it may
    (checking.MASKS_PER_ASKER): its further checks are refused. Honest members ask one."""


class RoundState:
    """What this member knows about one collective."""

    def __init__(self, plan: GroupPlan, me: str) -> None:
        self.plan, self.me = plan, me
        self.my_index = plan.index(me)
        self.spans = [SpanState() for _ in plan.spans]
        self.stats = CollectiveStats()
        self.changed = Signal()
        self.my_weight: float | None = None
        self.my_frames: list[bytes] | None = None
        self.my_values: list[Tensor] | None = None
        self.my_proofs: list[Proof | None] | None = None
        self.reducing_done = False
        self.witness: Callable[[bytes, float, str], Awaitable[Witnessed | None]] | None = None
        """(parts named, wait, asker) -> this member's reduction as the span's witness;
        set by this member's AllReduce when it runs with verification."""
        self.checks_asked: Counter[str] = Counter()
        """Witness checks each member asked of this one (handlers.on_check caps them)."""
        self.opens: Callable[[int], float] | None = None
        """attempt -> the monotonic time after which this member would itself have moved on
        to that attempt (its deadline for the one before); set by its running AllReduce."""

    # ---- this member's own contribution -----------------------------------------
    def set_contribution(
        self,
        weight: float,
        frames: list[bytes],
        values: list[Tensor],
        proofs: list[Proof | None] | None = None,
    ) -> None:
        self.my_weight, self.my_frames, self.my_values = weight, frames, values
        self.my_proofs = proofs
        self.changed.fire()

    def own_part(self, span: int) -> Contribution | None:
        if self.my_frames is None or self.my_values is None or self.my_weight is None:
            return None
        proof = self.my_proofs[span] if self.my_proofs is not None else None
        return Contribution(self.my_weight, self.my_values[span], self.my_frames[span], proof)

    # ---- transitions ----------------------------------------------------------------
    def add_part(self, sender: str, contribution: Contribution) -> str | None:
        """Store a pushed contribution to my span; returns a rejection reason or None."""
        span = self.spans[self.my_index]
        if span.final is not None or span.min_attempt > 0 or self.reducing_done:
            return "late"
        if sender in span.parts:
            return "duplicate"
        span.parts[sender] = contribution
        self.stats.accepted += 1
        self.changed.fire()
        return None

    def refuse(self, sender: str, reason: str, span: int | None = None) -> None:
        """Count an invalid part; nothing more is expected from `sender` (for `span`'s
        witness copy if given, else for the own span)."""
        self.stats.reject(reason)
        if span is None:
            self.spans[self.my_index].refused.add(sender)
        else:
            self.spans[span].witness_refused.add(sender)
        self.changed.fire()

    def witness_span(self) -> int | None:
        """The span this member is the witness of (its backup owner at attempt 1)."""
        return (self.my_index - 1) % self.plan.size if self.plan.size >= 2 else None

    def add_witness_part(self, span: int, sender: str, contribution: Contribution) -> str | None:
        state = self.spans[span]
        if sender in state.witness_parts:
            return "duplicate"
        state.witness_parts[sender] = contribution
        self.changed.fire()
        return None

    def try_finalize(self, span: int, final: Final) -> bool:
        """Adopt a value for `span` unless one is known or a later attempt was promised."""
        self.settle(span)
        state = self.spans[span]
        if state.final is not None or final.attempt < state.min_attempt:
            return False
        state.final = final
        self.changed.fire()
        return True

    def promise(self, span: int, attempt: int) -> None:
        """Refuse results of attempts before `attempt` for this span from now on."""
        state = self.spans[span]
        if attempt > state.min_attempt:
            state.min_attempt = attempt
            self.changed.fire()

    def defer(self, span: int, attempt: int) -> None:
        """A promise asked before this member runs: kept once it would move on by itself."""
        state = self.spans[span]
        if attempt > max(state.min_attempt, state.deferred):
            state.deferred = attempt

    def settle(self, span: int) -> None:
        """Keep the deferred promise for `span` once this member would move on to it itself."""
        state = self.spans[span]
        if state.deferred > state.min_attempt and self.may_promise(span, state.deferred):
            self.promise(span, state.deferred)

    def detach(self) -> None:
        """Drop the callbacks its all-reduce set: the two point at each other, holding the
        round's vectors until Python's rare full collection."""
        self.witness = self.opens = None

    def give_up(self, span: int, attempt: int) -> None:
        """This member moved past `attempt` of `span` without a result from it."""
        state = self.spans[span]
        if attempt > state.given_up:
            state.given_up = attempt
            self.settle(span)
            self.changed.fire()

    def may_promise(self, span: int, attempt: int) -> bool:
        """Would this member move on to `attempt` of `span` by now itself? A backup asking
        for a promise earlier may be a witness grabbing the span before its owner's result
        could be checked (results of later attempts are not)."""
        if self.spans[span].checking:
            return False
        if self.spans[span].given_up >= attempt - 1:
            return True
        return self.opens is not None and time.monotonic() >= self.opens(attempt)

    def final(self, span: int) -> Final | None:
        return self.spans[span].final


class RoundBook:
    """The states of recent collectives of this member, looked up by RPC handlers.

    Bounded: states are dropped LINGER_ROUNDS rounds after their own; promises for
    collectives not registered yet are kept only for rounds near the latest registered
    one, MAX_PENDING at most, and deferred at registration (SpanState.deferred) only when
    the peer that asked is the span's owner at the promised attempt (a stranger's promise
    is dropped)."""

    def __init__(self, me: str) -> None:
        self.me = me
        self.states: dict[tuple[int, str], RoundState] = {}
        self.registered = Signal()
        self.unknown_rejections = Counter()
        # promises made before this member registered the group (it was a round late):
        # (round, phase, group id) -> {(span, asker): attempt}, checked and applied at
        # registration
        self.pending: dict[tuple[int, str, bytes], dict[tuple[int, str], int]] = {}
        self.latest: int | None = None
        """The latest round registered."""
        self.current: Callable[[], int] | None = None
        """The round this member is in now (its outer loop's), when known: a member that
        mixed alone or caught up registered nothing near it, yet its peers' messages about
        it are expected."""

    def register(self, plan: GroupPlan) -> RoundState:
        key = (plan.round, plan.phase)
        existing = self.states.get(key)
        if existing is not None and existing.plan.group_id == plan.group_id:
            return existing
        if existing is not None:  # replaced by another group
            existing.detach()
        state = RoundState(plan, self.me)
        pending = self.pending.pop((*key, plan.group_id), {})
        for (span, asker), attempt in pending.items():
            legit = 0 <= span < plan.size and 0 < attempt < plan.size
            if legit and asker == plan.owner(span, attempt) and asker != self.me:
                state.defer(span, attempt)
            else:
                self.unknown_rejections["promise from a non-owner"] += 1
        self.states[key] = state
        self.latest = plan.round if self.latest is None else max(self.latest, plan.round)
        for old in [k for k in self.states if k[0] < plan.round - LINGER_ROUNDS]:
            self.states.pop(old).detach()
        self._prune_pending()
        self.registered.fire()
        return state

    def has_member(self, peer: str) -> bool:
        """Whether `peer` is a member of a collective this member still keeps (another's)."""
        return peer != self.me and any(peer in s.plan.members for s in self.states.values())

    def _prune_pending(self) -> None:
        if self.latest is None:
            return
        lo, hi = self.latest - LINGER_ROUNDS, self.latest + AHEAD_ROUNDS
        for old in [k for k in self.pending if not lo <= k[0] <= hi]:
            del self.pending[old]

    def near(self, round_no: int) -> bool:
        """Whether `round_no` is within LINGER_ROUNDS behind and AHEAD_ROUNDS ahead of the
        latest round registered or the member's current round (any round before either
        is known)."""
        refs = [self.latest, self.current() if self.current is not None else None]
        refs = [r for r in refs if r is not None]
        return not refs or any(r - LINGER_ROUNDS <= round_no <= r + AHEAD_ROUNDS for r in refs)

    def promise_unregistered(
        self, round_no: int, phase: str, group_id: bytes, span: int, attempt: int, asker: str
    ) -> bool:
        """Remember a promise for a collective this member has not registered yet (False:
        refused, the round is far from ours or the table is full)."""
        if not self.near(round_no):
            self.unknown_rejections["promise for a distant round"] += 1
            return False
        spans = self.pending.get((round_no, phase, group_id))
        if spans is None or (span, asker) not in spans:
            held = [a for v in self.pending.values() for _, a in v]
            if len(held) >= MAX_PENDING:
                self.unknown_rejections["promise table full"] += 1
                return False
            if held.count(asker) >= MAX_PENDING_PER_ASKER:
                self.unknown_rejections["too many promises for one peer"] += 1
                return False
        spans = self.pending.setdefault((round_no, phase, group_id), {})
        spans[(span, asker)] = max(attempt, spans.get((span, asker), 0))
        return True

    async def lookup(self, round_no: int, phase: str, group_id: bytes, wait: float) -> RoundState:
        """The state a message is about, waiting up to `wait` s for it to be registered.

        Raises LookupError with a short reason (the caller answers REJECTED), UnknownRoundError
        when nothing is registered for the round and phase.
        """
        key = (round_no, phase)
        if key not in self.states and not self.near(round_no):
            # nobody honest waits for a round this member will not register soon
            self.unknown_rejections["distant round"] += 1
            raise UnknownRoundError("distant round")
        await self.registered.wait_for(lambda: key in self.states, wait)
        state = self.states.get(key)
        if state is None:
            self.unknown_rejections["unknown round"] += 1
            raise UnknownRoundError("unknown round")
        if state.plan.group_id != group_id:
            state.stats.reject("group mismatch")
            raise LookupError("group mismatch")
        return state
