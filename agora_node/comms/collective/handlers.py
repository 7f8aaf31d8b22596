"""The answering side of a collective, independent of the transport.

Handlers only look things up, validate, and store; decoding a contribution (the one
heavy step) runs in a worker thread so the event loop keeps serving. A contribution
is validated once, on arrival: wrong group or round, a sender who is not a member,
a non-finite or negative weight, or a frame that does not decode strictly to the
span's float32 values is refused and counted in the collective's stats; the round
goes on without it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

from torch import Tensor

from agora_node.comms.collective.payload import decode_span, max_frame_bytes
from agora_node.comms.collective.plan import GroupPlan
from agora_node.comms.collective.proofs import (
    Proof,
    Verify,
    check_part,
    pack_proofs,
    sign_receipt,
)
from agora_node.comms.collective.state import (
    Contribution,
    Final,
    RoundBook,
    RoundState,
    UnknownRoundError,
    WitnessBusy,
)
from agora_node.comms.collective.verify import (
    NONCE_BYTES,
    mask_members,
    members_mask,
    sketch_bytes,
)
from agora_node.comms.collective.wire import Code, Header, Reply, rejected
from agora_node.compression import CodecError

MAX_WAIT = 120.0  # a request never holds a handler longer than this, whatever it asks
MAX_WAITING_PER_PEER = 16
"""Requests one peer may have waiting for a round this member has not registered: an
honest member late by a round has a few per phase (push, fetch, check, query), a
stranger could otherwise hold every stream slot for MAX_WAIT (and only near rounds wait:
RoundBook.lookup)."""
MAX_WAITING = 64
"""Requests of all peers waiting for unregistered rounds at once: the collective's guard
admits 256 streams, so requests about registered rounds always keep most of them (fresh
keys cost nothing: the per-peer cap alone would let 16 of them hold every slot)."""
MEMBER_REFUSALS = ("not my span", "bad weight", "late", "duplicate")
"""Refusals of a push from a member of the group (anything else: the sender is not one)."""


NOT_LISTED = "not listed"
"""Refusal of every request from a peer a private swarm's allow list does not name."""


MAX_CHECKS_PER_MEMBER = 4
"""Witness checks one member may ask of this one per collective."""


class Responder:
    def __init__(
        self,
        book: RoundBook,
        *,
        admit: Callable[[str], bool] | None = None,
        verify: Verify | None = None,
        sign: Callable[[bytes], bytes] | None = None,
        known: Callable[[str], bool] | None = None,
    ) -> None:
        self.book = book
        self.admit = admit
        """A private swarm's allow list (counts what it refuses); None: an open swarm."""
        self.known = known
        """Peers with a record at this stage lately (None: anyone, in tests): only they may
        wait for a round this member has not registered, or leave a promise for it. Four
        fresh keys held all 64 waits, and honest members' early pushes were refused."""
        self.verify = verify
        """Checks a part's signature by its sender (proofs.py); None: parts go unsigned
        (in-process tests and simulations)."""
        self.sign = sign
        """Signs this member's inventory receipts as a witness (proofs.sign_receipt)."""
        self._waiting: Counter[str] = Counter()
        """Requests of each peer waiting for their round to be registered."""

    async def _state(self, sender: str, header: Header) -> RoundState:
        if self.admit is not None and not self.admit(sender):
            raise LookupError(NOT_LISTED)  # before any lookup: nothing is registered for it
        if (header.round, header.phase) in self.book.states:
            state = await self.book.lookup(header.round, header.phase, header.group_id, 0.0)
        elif self.known is not None and not self.known(sender):
            self.book.unknown_rejections["no record"] += 1
            raise LookupError("no record at this stage, and the round is not registered")
        elif (
            self._waiting[sender] >= MAX_WAITING_PER_PEER
            or sum(self._waiting.values()) >= MAX_WAITING
        ):
            self.book.unknown_rejections["too many waits"] += 1
            raise LookupError("too many requests waiting for unregistered rounds")
        else:  # waits for the round to be registered: a slot held, so a few per peer
            self._waiting[sender] += 1
            try:
                state = await self.book.lookup(
                    header.round, header.phase, header.group_id, min(header.wait, MAX_WAIT)
                )
            finally:
                self._waiting[sender] -= 1
                if not self._waiting[sender]:
                    del self._waiting[sender]
        if sender not in state.plan.members or sender == state.me:
            state.stats.reject("not a member")
            raise LookupError("not a member")
        if not 0 <= header.span < state.plan.size:
            state.stats.reject("bad span")
            raise LookupError("bad span")
        return state

    async def admit_push(self, sender: str, header: Header, total: int) -> Reply | None:
        """Whether a push of `total` bytes may be read at all: None, or the refusal.

        Transports call this on a push's first chunk, before buffering the rest, so a
        non-member (or a member pushing the wrong span, too late or too much) costs one
        chunk, not a full copy of the span."""
        try:
            state = await self._state(sender, header)
        except LookupError as exc:
            return rejected(str(exc))
        return await self._refused(state, sender, header, total)

    async def _refused(
        self, state: RoundState, sender: str, header: Header, total: int
    ) -> Reply | None:
        """`_push_refusal`, with the witness's receipt when the span owner sends its own
        copy again (it asks for one that way)."""
        refusal = self._push_refusal(state, sender, header, total)
        if refusal is not None and refusal.reason == "duplicate" and header.attempt == 1:
            return await self._owners_copy_receipt(state, sender, header.span, refusal)
        return refusal

    def _push_refusal(
        self, state: RoundState, sender: str, header: Header, total: int
    ) -> Reply | None:
        stats = state.stats
        witness = _for_witness(state, header)
        own = header.span == state.my_index and header.attempt == 0
        if not (own or witness):
            stats.reject("not my span")
            return rejected("not my span")
        refused_span = header.span if witness else None
        if not math.isfinite(header.weight) or header.weight < 0:
            state.refuse(sender, "bad weight", refused_span)
            return rejected("bad weight")
        span = state.spans[header.span]
        # a witness takes copies until the collective ends: checks wait for the parts they name
        late = not witness and (
            span.final is not None or span.min_attempt > 0 or state.reducing_done
        )
        if late:
            stats.reject("late")
            return rejected("late")
        if total > max_frame_bytes(state.plan.span_numel(header.span)):
            state.refuse(sender, "oversized", refused_span)
            return rejected("oversized")
        # before its frame is read: each copy of a held part cost a buffer, a hash, an
        # Ed25519 check and a decode (transports refuse one being read already)
        if sender in (span.witness_parts if witness else span.parts):
            stats.reject("duplicate")
            return rejected("duplicate")
        return None

    async def on_push(self, sender: str, header: Header, payload: bytes) -> Reply:
        try:
            state = await self._state(sender, header)
        except LookupError as exc:
            return rejected(str(exc))
        stats = state.stats
        stats.bytes_received += len(payload) + len(header.signature)
        refusal = await self._refused(state, sender, header, len(payload))
        if refusal is not None:
            return refusal
        refused_span = header.span if header.attempt == 1 else None
        numel = state.plan.span_numel(header.span)
        try:
            proof, value = await asyncio.to_thread(
                _read_part, self.verify, sender, state.plan, header, payload, numel
            )
        except _BadSignature:
            state.refuse(sender, "bad signature", refused_span)
            return rejected("bad signature")
        except CodecError as exc:
            state.refuse(sender, "malformed", refused_span)
            return rejected(f"malformed: {exc}")
        contribution = Contribution(header.weight, value, payload, proof)
        if header.attempt == 1:  # admitted above as a copy for the span's witness
            reason = state.add_witness_part(header.span, sender, contribution)
        else:
            reason = state.add_part(sender, contribution)
        if reason is not None:
            stats.reject(reason)
        reply = Reply(Code.ACCEPTED) if reason is None else rejected(reason)
        if header.attempt == 1 and reason in (None, "duplicate"):
            reply = await self._owners_copy_receipt(state, sender, header.span, reply)
        return reply

    async def _owners_copy_receipt(
        self, state: RoundState, sender: str, span: int, reply: Reply
    ) -> Reply:
        """As the witness, the span owner's own copy held: say so, signed. The owner's
        result carries it if an inventory then leaves the part out, so a witness that does
        that and answers checks "missing" is blamed alone (checking._blame)."""
        if self.sign is None or sender != state.plan.owner(span, 0):
            return reply
        mask = members_mask(state.plan.members, [sender])
        receipt = await asyncio.to_thread(sign_receipt, self.sign, state.plan.group_id, span, mask)
        state.stats.bytes_sent += len(receipt)
        return replace(reply, receipt=receipt)

    async def on_fetch(self, sender: str, header: Header) -> Reply:
        try:
            state = await self._state(sender, header)
        except LookupError as exc:
            return rejected(str(exc))
        span = header.span
        ready = await state.changed.wait_for(
            lambda: state.final(span) is not None, min(header.wait, MAX_WAIT)
        )
        final = state.final(span)
        # not a result of a later attempt than asked: one this owner adopted from a backup
        # would be checked as its own (and it is not), so the asker fetches it from there
        if not ready or final is None or final.attempt > header.attempt:
            return Reply(Code.NOT_READY)
        return _final_reply(state, final)

    async def on_check(
        self, sender: str, header: Header, nonce: bytes, members: bytes = b""
    ) -> Reply:
        """A member asks this witness for a sketch of its reduction of a span over the
        parts of `members` (verify.py)."""
        try:
            state = await self._state(sender, header)
        except LookupError as exc:
            return rejected(str(exc))
        if state.witness_span() != header.span:
            state.stats.reject("not the witness")
            return rejected("not the witness")
        if sender == state.plan.owner(header.span, 0):  # it has its own value: nothing to check
            state.stats.reject("bad check")
            return rejected("bad check")
        if len(nonce) != NONCE_BYTES or mask_members(state.plan.members, members) is None:
            return rejected("bad check")
        # each check is a sketch of the span (and a new mask a reduction): a member checks
        # the one span result it fetched, perhaps again after a backup's
        if state.checks_asked[sender] >= MAX_CHECKS_PER_MEMBER:
            state.stats.reject("too many checks")
            return rejected("too many checks")
        state.checks_asked[sender] += 1
        wait = min(header.wait, MAX_WAIT)
        await state.changed.wait_for(lambda: state.witness is not None, wait)
        if state.witness is None:  # this member is not running the collective (yet)
            return Reply(Code.NOT_READY)
        try:
            witnessed = await state.witness(members, wait, sender)
        except WitnessBusy as exc:
            return rejected(f"witness busy: {exc}")
        if witnessed is None:  # not a set of parts a result may name
            return rejected("bad check")
        if witnessed.final is None:  # it lacks parts the result names: it cannot stand
            return Reply(Code.NOTHING, members=members_mask(state.plan.members, witnessed.missing))
        payload = await asyncio.to_thread(sketch_bytes, witnessed.final.value, nonce)
        state.stats.bytes_sent += len(payload) + len(witnessed.final.proofs)
        return Reply(Code.SKETCH, payload, proofs=witnessed.final.proofs)

    async def on_inventory(self, sender: str, header: Header, members: bytes) -> Reply:
        """A span's owner asks this witness which of the parts `members` names it holds,
        before naming them in its result: it names only those (with the same signed entry),
        so one member withholding its witness copies cannot fail every span's check."""
        try:
            state = await self._state(sender, header)
        except LookupError as exc:
            return rejected(str(exc))
        span = header.span
        named = mask_members(state.plan.members, members)
        if state.witness_span() != span or sender != state.plan.owner(span, 0) or named is None:
            state.stats.reject("bad inventory")
            return rejected("bad inventory")
        if state.checks_asked[sender] >= MAX_CHECKS_PER_MEMBER:
            state.stats.reject("too many checks")
            return rejected("too many checks")
        state.checks_asked[sender] += 1
        parts, refused = state.spans[span].witness_parts, state.spans[span].witness_refused
        others = [m for m in named if m != state.me]
        await state.changed.wait_for(
            lambda: all(m in parts or m in refused for m in others), min(header.wait, MAX_WAIT)
        )
        held = {m: parts[m] for m in others if m in parts}
        own = state.own_part(span) if state.me in named else None
        if own is not None:
            held[state.me] = own
        order = [m for m in state.plan.members if m in held]
        proofs = pack_proofs([held[m].proof for m in order])
        mask = members_mask(state.plan.members, order)
        receipt = b""
        if self.sign is not None:
            group = state.plan.group_id
            receipt = await asyncio.to_thread(sign_receipt, self.sign, group, span, mask)
        state.stats.bytes_sent += len(proofs) + len(receipt)
        return Reply(Code.HOLDS, members=mask, proofs=proofs, receipt=receipt)

    async def on_query(self, sender: str, header: Header) -> Reply:
        try:
            state = await self._state(sender, header)
        except UnknownRoundError:
            # answer as if registered: promise, so a late registration cannot reduce. The
            # book keeps who asked and applies the promise at registration only if that
            # peer is the span's backup owner at that attempt (strangers' are dropped).
            # A promise the book could not keep is not made: the asker hears so.
            kept = self.book.promise_unregistered(
                header.round, header.phase, header.group_id, header.span, header.attempt, sender
            )
            return Reply(Code.NOTHING) if kept else rejected("no promise kept")
        except LookupError as exc:
            return rejected(str(exc))
        span = header.span
        # attempts run 1..size-1 (owner() takes them modulo the size: a huge one from the
        # backup replaced its own attempt-1 deferral and forced the owner onto fall-back)
        attempt_ok = 1 <= header.attempt < state.plan.size
        if not attempt_ok or sender != state.plan.owner(span, header.attempt):
            state.stats.reject("not the backup")
            return rejected("not the backup")

        # Registered but still encoding its part (or still training): give it the query's
        # wait, so a survivor that is merely slower is not left out of the span. Running,
        # promise only once this member would move on itself (state.may_promise); one that
        # has not started defers the promise as an unregistered one does (state.defer).
        def ready() -> bool:
            if state.final(span) is not None:
                return True
            if state.opens is None:
                return False
            return state.own_part(span) is not None and state.may_promise(span, header.attempt)

        await _wait_or_opens(state, ready, header.attempt, min(header.wait, MAX_WAIT))
        final = state.final(span)
        if final is not None:
            return _final_reply(state, final)
        if state.opens is None:
            state.defer(span, header.attempt)
        elif ready():
            state.promise(span, header.attempt)
        else:
            state.stats.reject("promise asked too early")
            return rejected("too early")
        own = state.own_part(span)
        if own is None:
            return Reply(Code.NOTHING)
        state.stats.bytes_sent += len(own.frame)
        return Reply(Code.CONTRIBUTION, own.frame, weight=own.weight)


async def _wait_or_opens(
    state: RoundState, ready: Callable[[], bool], attempt: int, wait: float
) -> None:
    """Wait up to `wait` s for `ready()`; for a running member, at least until `attempt`
    opens (`RoundState.opens`, which no event announces), MAX_WAIT at most. An honest
    backup asks early only when the owner failed for it, and then the member either gets
    the owner's result or would move on by itself by then: answering either way keeps the
    group consistent, where refusing left the backup to reduce without its part."""
    start = time.monotonic()
    end = start + wait
    while not ready():
        now = time.monotonic()
        opens = state.opens(attempt) if state.opens is not None else None
        if opens is not None:
            end = max(end, min(opens + 0.001, start + MAX_WAIT))
        if now >= end:
            return
        left = end - now
        if opens is not None and opens > now:
            left = min(left, opens - now + 0.001)
        await state.changed.wait_for(ready, left)


class _BadSignature(Exception):
    pass


def _read_part(
    verify: Verify | None,
    sender: str,
    plan: GroupPlan,
    header: Header,
    frame: bytes,
    numel: int,
) -> tuple[Proof | None, Tensor]:
    """A pushed part's signature checked (`verify` None: unsigned), then its frame decoded:
    one trip to a worker thread for both."""
    proof = None
    if verify is not None:
        span, weight, sig = header.span, header.weight, header.signature
        proof = check_part(verify, sender, plan.group_id, span, weight, frame, sig)
        if proof is None:
            raise _BadSignature
    return proof, decode_span(frame, numel, block=plan.block)


def _final_reply(state: RoundState, final: Final) -> Reply:
    state.stats.bytes_sent += len(final.frame) + len(final.proofs) + len(final.receipt)
    return Reply(
        Code.FINAL,
        final.frame,
        attempt=final.attempt,
        members=final.members,
        proofs=final.proofs,
        receipt=final.receipt,
    )


def _for_witness(state: RoundState, header: Header) -> bool:
    """Is this push a copy for this member as the span's witness?"""
    return header.attempt == 1 and state.witness_span() == header.span
