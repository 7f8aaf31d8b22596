"""A reduce-scatter / all-gather that survives members dying and ends equal everywhere.

Protocol for one member of a group of n (plan.py gives the spans and owner chains):

1. Encode the contribution once, cut it into n span frames, push frame j to the
   owner of span j (attempt 0). Each push has its own deadline.
2. Reduce the own span: wait until every member not known to have failed has
   pushed, or the reduce deadline; aggregate what arrived (weights renormalize
   over it); encode the result; that frame is the span's *final* at attempt 0.
3. Gather: fetch every other span's final from its owner (a long-poll). If the owner
   fails (error, timeout, or a result that does not decode), move to attempt 1: the
   next member in the chain owns the span. A backup owner *re-reduces*: it promises
   (state.py) and asks every member for the span; any member already holding a
   final returns it and the backup re-issues that same value; otherwise members
   return their own contribution and the backup aggregates those. A running member
   promises only once it would move on by itself (it gave up on the attempt before,
   or its own deadline for it passed; state.may_promise): an earlier query is held
   until then. Others fetch the span from the backup. This repeats down the chain.
4. If every owner of a span failed, the member keeps its own values for that span
   (with error feedback, its part as sent: the encoder keeps what the part left out)
   and reports the round as inconsistent.

With `verify` (verify.py), each member also pushes its part of span j to the span's
witness, its attempt-1 owner, and that copy goes first: the part goes to the owner
once the witness has answered (or after half the reduce deadline), so a member that
dies in the middle of its pushes cannot leave an owner holding a part the witness
lacks, whose result no survivor could then check. Before naming its parts, an owner
asks its witness which of them it holds (an inventory) and names only those, with the
same signed entry (proofs.py): a member that sent the witness no copy, or another
part, is left out of the span instead of failing its check. A result fetched from the
attempt-0 owner is adopted only if it matches the witness's reduction of the parts
the result names (the witness compares directly, everyone else through a sketch
under a nonce of its own). On a mismatch the member keeps its own values for that span (step 4): it
cannot tell whether the owner or the witness lies, and handing the span to the
witness would let a lying witness take it over. A lying member thus costs at most
the mixing of two spans (inconsistent, repaired by the next anchor mix), never
poisons one. The parts' signed entries, which results and sketches carry, tell a
member who sent two different parts from a lying owner or witness (checking.py).
A witness re-reducing a dead owner's span re-issues a value some
member already holds only if it matches its own reduction. Results of later
attempts, and results whose witness does not answer, are adopted unchecked
(counted).

Why survivors agree: a value for a span is only created by an owner that got no
final from any member it asked, and every member it asked promised to refuse
values of earlier attempts. So under crash failures, with live members answering
within the deadlines, at most one value per span survives among live members, and
all of them hold the same decoded frame bytes. A member that misses its own
deadlines (frozen, partitioned) may end differently; the next round's anchor mix
pulls it back. So may a member that started late (a backup asked it before it ran):
its promise is deferred (state.SpanState.deferred), so that a witness asking early
cannot take a span over, and a late owner whose part another late member took keeps
its own result while the others adopt the backup's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from agora_node.comms.collective.aggregate import AggregationSpec, aggregate
from agora_node.comms.collective.backup import Backup
from agora_node.comms.collective.checking import NETWORK_SLACK, Checking
from agora_node.comms.collective.deadlines import Deadlines
from agora_node.comms.collective.payload import (
    PartEncoder,
    WireFormat,
    decode_span,
    encode_result,
)
from agora_node.comms.collective.proofs import (
    Signing,
    pack_proofs,
    sign_part,
)
from agora_node.comms.collective.replay import ReplayMemory
from agora_node.comms.collective.state import (
    CollectiveStats,
    Contribution,
    Final,
    RoundState,
)
from agora_node.comms.collective.verify import (
    members_mask,
)
from agora_node.comms.collective.wire import Code, Header, Reply, Transport
from agora_node.compression import CodecError

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    value: Tensor
    """The mixed flat vector (identical on every member that completed consistently)."""
    stats: CollectiveStats
    seconds: float
    consistent: bool
    members: tuple[str, ...]
    own_spans: tuple[tuple[int, int], ...] = ()
    """[lo, hi) of the spans every owner failed: `value` holds this member's own part there,
    its exact values, or with error feedback the part as it sent it (decoded), so what the
    encoder kept back of it stays unsent."""


class AllReduce(Checking, Backup):
    """One member's run of one collective; create, then `await run(...)` once. Re-reducing
    as a span's backup is backup.py's; with `verify`, the checks are checking.py's."""

    def __init__(
        self,
        state: RoundState,
        transport: Transport,
        *,
        fmt: WireFormat,
        encoder: PartEncoder,
        aggregation: AggregationSpec,
        deadlines: Deadlines,
        verify: bool = False,
        tolerance: float = 0.05,
        ignore: frozenset[str] = frozenset(),
        replays: ReplayMemory | None = None,
        signing: Signing | None = None,
    ) -> None:
        self.verify, self.tolerance = verify and state.plan.size >= 2, tolerance
        self.ignore = ignore
        """Members whose parts this member drops as the reducer of its span (peers it
        banned); the result names the parts it used, so its witness agrees."""
        self.replays = replays
        """Senders' earlier parts (replay.py): a part repeating one is flagged, not refused."""
        self.signing = signing
        """Signs this member's parts and checks the entries a failed check compares
        (proofs.py); None: unsigned, and a failed check blames owner and witness alike."""
        self._witnessed: dict[bytes, asyncio.Future] = {}
        """As the witness: the reductions checks asked for, by the parts named."""
        self._masks_by: Counter[str] = Counter()
        """As the witness: new reductions each asker caused (checking.MASKS_PER_ASKER)."""
        self.state, self.transport = state, transport
        self.plan, self.stats = state.plan, state.stats
        self.fmt, self.encoder = fmt, encoder
        self.aggregation, self.deadlines = aggregation, deadlines
        self.t0 = time.monotonic()
        self.fallback: dict[int, Tensor] = {}
        self.flat = torch.zeros(0)
        self._to_owners: list[asyncio.Task] = []
        """Pushes of this member's parts to the spans' owners."""
        self._own_copy: asyncio.Task | None = None
        """The push of its own span's copy to its witness (checking._copy_receipt)."""

    # ---- the whole run ----------------------------------------------------------------
    async def run(self, flat: Tensor, weight: float) -> Outcome:
        self.t0 = time.monotonic()
        self.flat = flat.detach().reshape(-1).float()
        weight = float(weight) + 0.0  # -0.0 would be signed as such but sent as 0.0
        frames, values, proofs = await asyncio.to_thread(self._encode, self.flat, weight)
        self.state.set_contribution(weight, frames, values, proofs)
        for j, (lo, hi) in enumerate(self.plan.spans):
            if hi == lo:  # nothing to move: every member knows the empty span
                self.state.try_finalize(j, Final(b"", 0, torch.zeros(0)))
        me = self.state.my_index
        pushes = []
        for j in range(self.plan.size):
            if self.state.final(j) is not None:
                continue
            copy = None
            if self.verify and self.plan.owner(j, 1) != self.state.me:
                copy = asyncio.create_task(self._push(j, frames[j], witness=True))
                if j == me:
                    self._own_copy = copy
                pushes.append(copy)
            if j != me:
                self._to_owners.append(asyncio.create_task(self._push(j, frames[j], after=copy)))
        pushes += self._to_owners
        # plain values, not self: the state outlives this object by a few rounds
        t0, deadlines, plan, fmt = self.t0, self.deadlines, self.plan, self.fmt
        self.state.opens = lambda a: t0 + deadlines.attempt_end(a - 1, plan.numel, plan.size, fmt)
        if self.verify:
            self.state.witness = self._witness_value
        self.state.changed.fire()
        reduce_task = asyncio.create_task(self._reduce_own())
        try:
            await asyncio.gather(*(self._resolve(j, reduce_task) for j in range(self.plan.size)))
        finally:
            for task in (*pushes, reduce_task):
                task.cancel()
        # the whole mixed vector, stage-sized: joined on a thread, not the event loop
        value = await asyncio.to_thread(
            torch.cat, [self._span_value(j) for j in range(self.plan.size)]
        )
        self.stats.late_spans = sum(
            1
            for j in range(self.plan.size)
            if self.plan.owner(j, 0) != self.state.me
            and (final := self.state.final(j)) is not None
            and final.attempt > 0
        )
        return Outcome(
            value=value,
            stats=self.stats,
            seconds=time.monotonic() - self.t0,
            consistent=not self.fallback,
            members=self.plan.members,
            own_spans=tuple(self.plan.spans[j] for j in sorted(self.fallback)),
        )

    def _encode(self, flat: Tensor, weight: float) -> tuple[list[bytes], list[Tensor], list]:
        frames = self.encoder.encode(flat, self.plan.spans)
        values = [
            decode_span(f, self.plan.span_numel(j)) if f else torch.zeros(0)
            for j, f in enumerate(frames)
        ]
        signing, group = self.signing, self.plan.group_id
        proofs = [
            sign_part(signing, group, j, weight, f) if signing is not None else None
            for j, f in enumerate(frames)
        ]
        return frames, values, proofs

    def _span_value(self, j: int) -> Tensor:
        final = self.state.final(j)
        return final.value if final is not None else self.fallback[j]

    def _left(self, deadline: float) -> float:
        return deadline - (time.monotonic() - self.t0)

    def _header(
        self,
        span: int,
        attempt: int = 0,
        weight: float = 0.0,
        wait: float = 0.0,
        signature: bytes = b"",
    ) -> Header:
        p = self.plan
        return Header(
            p.round, p.phase, p.group_id, span, attempt, weight, max(0.0, wait), signature
        )

    async def _call(self, peer: str, coro, timeout: float, record: bool = True) -> Reply | None:
        """One request under a deadline; None on any failure (recorded for the peer unless
        `record` is False)."""
        try:
            return await asyncio.wait_for(coro, max(0.01, timeout))
        except TimeoutError:
            if record:
                self.stats.failed_peers.add(peer)
        except Exception as exc:  # a transport error: the peer is gone or broken
            log.debug("call to %s failed: %r", peer[-8:], exc)
            if record:
                self.stats.failed_peers.add(peer)
        self.state.changed.fire()  # waiters on "all live members delivered" re-check
        return None

    # ---- 1. push -------------------------------------------------------------------
    async def _push(
        self,
        span: int,
        frame: bytes,
        witness: bool = False,
        after: asyncio.Task | None = None,
        wait: float | None = None,
        record: bool = True,
        budget: float | None = None,
    ) -> Reply | None:
        """Push this member's part of `span` to its owner (or, `witness`, to its witness),
        asking the owner to wait `wait` s (default: until the reduce deadline); `record`:
        a failed push marks the owner failed; `budget`: give up on the answer after that
        many seconds, however long the wait asked."""
        if after is not None:
            # The witness's copy first: if this member dies in the middle of its pushes, an
            # owner then holds its part only if the span's witness does too, so the owner's
            # result, which names the part, stays checkable. A witness that does not answer
            # delays the part by at most half the reduce deadline (it is not cancelled).
            await asyncio.wait({after}, timeout=max(0.0, self._left(self._reduce_deadline() / 2)))
        attempt = 1 if witness else 0
        owner = self.plan.owner(span, attempt)
        if wait is None:
            wait = self._left(self._reduce_deadline())
        own = self.state.own_part(span)
        signature = own.proof.signature if own is not None and own.proof is not None else b""
        header = self._header(span, attempt, self.state.my_weight or 0.0, wait, signature)
        self.stats.bytes_sent += len(frame) + len(signature)
        limit = wait + NETWORK_SLACK if budget is None else min(wait + NETWORK_SLACK, budget)
        reply = await self._call(owner, self.transport.push(owner, header, frame), limit, record)
        if reply is not None and reply.code is Code.REJECTED:
            self.stats.reject(f"ours refused: {reply.reason.split(':')[0]}")
        self.state.changed.fire()  # _keep_deferred_promise waits on the pushes
        return reply

    # ---- 2. reduce own span -----------------------------------------------------------
    def _reduce_deadline(self) -> float:
        return self.deadlines.reduce(self.plan.numel, self.plan.size, self.fmt)

    def _attempt_deadline(self, attempt: int) -> float:
        return self.deadlines.attempt_end(attempt, self.plan.numel, self.plan.size, self.fmt)

    async def _reduce_own(self) -> None:
        me, span = self.state.my_index, self.state.spans[self.state.my_index]
        if span.final is not None:
            return
        others = [m for m in self.plan.members if m != self.state.me]

        def delivered() -> bool:
            heard = span.parts.keys() | span.refused | self.stats.failed_peers | self.ignore
            pending = [m for m in others if m not in heard]
            return not pending or span.min_attempt > 0

        await self.state.changed.wait_for(delivered, self._left(self._reduce_deadline()))
        self.state.reducing_done = True
        if span.deferred > span.min_attempt:
            await self._keep_deferred_promise()
        if span.min_attempt > 0:  # a backup took the span over: it is no longer ours
            return
        own = self.state.own_part(me)
        parts = {m: c for m, c in span.parts.items() if m not in self.ignore}
        for member in self.ignore.intersection(others):
            self.stats.reject("banned sender")
            self.stats.ignored.add(member)
        receipt = b""
        if self.verify:
            parts, receipt = await self._held_by_witness(parts)
            if span.min_attempt > 0:
                return
        senders = ([self.state.me] if own is not None else []) + list(parts)
        contributions = ([own] if own is not None else []) + list(parts.values())
        final = await self._aggregate_final(me, contributions, attempt=0, senders=senders)
        self.state.try_finalize(me, replace(final, receipt=receipt))

    async def _aggregate_final(
        self,
        span: int,
        contributions: list[Contribution],
        attempt: int,
        senders: list[str],
        *,
        count: bool = True,
    ) -> Final:
        """Reduce span `span` over `contributions` (one per sender, in `senders`)."""
        # in member order, not arrival order: float sums depend on their order
        order = sorted(range(len(senders)), key=senders.__getitem__)
        contributions = [contributions[i] for i in order]
        senders = [senders[i] for i in order]

        def work() -> Final:
            agg = aggregate(
                [c.value for c in contributions],
                [c.weight for c in contributions],
                self.aggregation,
            )
            frame = encode_result(agg.value, self.fmt)
            value = decode_span(frame, agg.value.numel())
            mask = members_mask(self.plan.members, senders)
            by_sender = dict(zip(senders, contributions, strict=True))
            proofs = pack_proofs([by_sender[m].proof for m in self.plan.members if m in by_sender])
            final = Final(frame, attempt, value, mask, proofs)
            self._note_replays(span, contributions, senders)
            if not count:  # the witness's reduction: its owner counts
                return final
            if agg.clip_radius is not None:
                self.stats.clip_radii.append(agg.clip_radius)
            for i in agg.refused:
                self.stats.reject("norm out of range")
                self.stats.outliers.add(senders[i])
            for i in agg.misdirected:
                self.stats.reject("direction away from the others")
                self.stats.direction_outliers.add(senders[i])
            return final

        return await asyncio.to_thread(work)

    def _note_replays(
        self, span: int, contributions: list[Contribution], senders: list[str]
    ) -> None:
        """Note senders whose part repeats one they sent in an earlier round (on a worker
        thread: ReplayMemory locks)."""
        if self.replays is None:
            return
        lo = self.plan.spans[span][0]
        for sender, c in zip(senders, contributions, strict=True):
            if sender != self.state.me and self.replays.check(sender, self.plan.round, lo, c.value):
                self.stats.replayed.add(sender)

    # ---- 3. gather, escalating down the owner chain ---------------------------------
    async def _resolve(self, j: int, reduce_task: asyncio.Task) -> None:
        span, attempt = self.state.spans[j], 0
        while span.final is None and j not in self.fallback:
            attempt = max(attempt, span.min_attempt)
            if attempt >= self.plan.size:
                self._fall_back(j)
                return
            owner = self.plan.owner(j, attempt)
            if owner == self.state.me and attempt == 0:
                await asyncio.wait({reduce_task})  # its failure is logged below, not raised
                if not reduce_task.cancelled() and reduce_task.exception() is not None:
                    log.error("reducing own span failed", exc_info=reduce_task.exception())
            elif owner == self.state.me:
                await self._rereduce(j, attempt)
            else:
                await self._fetch(j, owner, attempt)
            if span.final is None and j not in self.fallback:
                self.state.give_up(j, attempt)
            attempt += 1

    async def _fetch(self, j: int, owner: str, attempt: int) -> None:
        if owner in self.stats.failed_peers:
            return
        wait = self._left(self._attempt_deadline(attempt))
        call = self._call(
            owner,
            self.transport.fetch(owner, self._header(j, attempt, wait=wait)),
            wait + NETWORK_SLACK,
        )
        reply = await self._unless_superseded(j, attempt, call)
        if reply is None or reply.code is not Code.FINAL:
            return
        self.stats.bytes_received += len(reply.payload) + len(reply.proofs) + len(reply.receipt)
        final = await self._decode_final(reply, j)
        if final is None:
            return
        # the attempt is the one asked of this owner, not what it claims: a claimed later
        # attempt would pass a promise made to that attempt's (other) owner
        final = replace(final, attempt=min(final.attempt, attempt))
        span = self.state.spans[j]
        span.checking = self.verify and attempt == 0
        try:
            if span.checking and not await self._matches_witness(j, final, owner):
                self._fall_back(j)  # neither the owner's value nor a takeover by the witness
                return
            if not self.state.try_finalize(j, final):
                self.stats.reject("stale result")
        finally:
            span.checking = False
            self.state.changed.fire()

    async def _unless_superseded(self, j: int, attempt: int, call) -> Reply | None:
        """Run a fetch, abandoning it if a later attempt is promised meanwhile."""
        task = asyncio.ensure_future(call)
        span = self.state.spans[j]
        superseded = asyncio.ensure_future(
            self.state.changed.wait_for(lambda: span.min_attempt > attempt, 1e9)
        )
        try:
            await asyncio.wait({task, superseded}, return_when=asyncio.FIRST_COMPLETED)
            return task.result() if task.done() else None
        finally:
            task.cancel()
            superseded.cancel()

    async def _decode_final(self, reply: Reply, j: int) -> Final | None:
        try:
            value = await asyncio.to_thread(
                functools.partial(decode_span, block=self.plan.block),
                reply.payload,
                self.plan.span_numel(j),
            )
        except CodecError:
            self.stats.reject("malformed result")
            return None
        return Final(
            reply.payload, reply.attempt, value, reply.members, reply.proofs, reply.receipt
        )

    # ---- 4. last resort ----------------------------------------------------------------
    def _fall_back(self, j: int) -> None:
        lo, hi = self.plan.spans[j]
        # with error feedback, the part as sent (decoded): the encoder keeps what the part
        # left out, which the exact values would apply twice; without, the exact values
        sent = self.state.my_values if self.fmt.error_feedback else None
        self.fallback[j] = (sent[j] if sent is not None else self.flat[lo:hi]).clone()
        self.stats.fallback_spans += 1
        log.warning(
            "span %d of %s round %d: every owner failed, using own part",
            j,
            self.plan.phase,
            self.plan.round,
        )
