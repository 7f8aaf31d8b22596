"""The checking side of a verified collective (verify.py, proofs.py), as a mixin of
`AllReduce`: what a span's owner asks its witness before naming parts (an inventory),
the witness's own reduction of the parts a result names, a member's check of a fetched
result against it, and whom a failed check blames.

It uses the AllReduce's state, plan, stats, transport, deadlines, signing and helpers
(`_call`, `_push`, `_header`, `_left`, `_attempt_deadline`, `_aggregate_final`).
"""

from __future__ import annotations

import asyncio
import logging
import os

from agora_node.comms.collective.proofs import attribute, held_alike, read_receipt, read_receipts
from agora_node.comms.collective.state import Contribution, Final, WitnessBusy, Witnessed
from agora_node.comms.collective.verify import (
    NONCE_BYTES,
    mask_members,
    members_mask,
    parse_sketch,
    sketch,
    sketches_match,
    values_match,
)
from agora_node.comms.collective.wire import Code, Reply

log = logging.getLogger(__name__)
NETWORK_SLACK = 2.0  # a call may outlive the wait it asked for by this much before we give up

MASKS_PER_ASKER = 2
"""Reductions one member may have this witness compute per collective, one per new set of
parts its checks name (an honest member checks the one result it fetched: one). Each is a
span-sized tensor kept until the collective is dropped, so a witness holds at most two
per member, plus one per result it re-issues as the backup (one per member at most); the
span's owner never checks its own span and may ask none."""


def answered(push: asyncio.Task | None) -> Reply | None:
    """The answer a finished push got (None: none, or not finished)."""
    if push is None or not push.done() or push.cancelled():
        return None
    return push.result()


class Checking:
    """Verification for AllReduce (see the module docstring); only AllReduce uses it."""

    async def _held_by_witness(
        self, parts: dict[str, Contribution]
    ) -> tuple[dict[str, Contribution], bytes]:
        """The parts the span's witness holds too, with the same signed entry (an inventory,
        handlers.on_inventory): the result names only those, so it stays checkable when a
        member sent this owner a part and the witness none, or another one (that member is
        flagged for equivocation). A witness that does not answer, or answers with an entry
        that does not verify, leaves the parts as they are: its check will tell. Also
        returned: the witness's signed receipt for what it holds (b"" none), which the
        result carries (`_blame`). A witness lacking this owner's own part gets it once
        more, and is asked again for a receipt that lists it."""
        j, me = self.state.my_index, self.state.me
        witness = self.plan.owner(j, 1)
        reply = await self._inventory(j, [me, *parts])
        held = mask_members(self.plan.members, reply.members) if reply is not None else None
        if reply is None or held is None or not set(held) <= {me, *parts}:
            return parts, await self._copy_receipt()
        own, again = self.state.own_part(j), None
        if me not in held and own is not None:  # its copy was lost: once more, before naming it
            budget = self._before_fetches_end()
            again = await self._push(
                j, own.frame, witness=True, wait=budget, record=False, budget=budget
            )
            if again is not None and (
                again.code is Code.ACCEPTED or again.reason.startswith("duplicate")
            ):
                second = await self._inventory(j, [me, *parts])
                named = mask_members(self.plan.members, second.members) if second else None
                if second is not None and named is not None and set(held) | {me} <= set(named):
                    reply, held = second, named
            if me not in held:  # published all the same: the check decides (docs/security.md)
                self.stats.reject("witness lacks the owner's part")
        receipt, keep, two_parts = b"", set(held), set()
        if self.signing is not None:
            verify, group = self.signing.verify, self.plan.group_id
            ours = {m: c.proof for m, c in parts.items()}
            read = await asyncio.to_thread(held_alike, verify, group, j, held, reply.proofs, ours)
            if read is None:
                self.stats.reject("forged inventory")
                return parts, await self._copy_receipt()
            keep, two_parts = read
            signed = await asyncio.to_thread(read_receipt, verify, witness, group, j, reply.receipt)
            receipt = reply.receipt if signed == reply.members else b""
            if two_parts:
                self.stats.reject("equivocation")
                self.stats.equivocated.update(two_parts)
        for _ in parts.keys() - keep - two_parts:
            self.stats.reject("part its witness lacks")
        if not receipt or me not in held:  # no signed word yet that the witness holds ours
            receipt += await self._copy_receipt(again)
        return {m: c for m, c in parts.items() if m in keep}, receipt

    async def _copy_receipt(self, resent: Reply | None = None) -> bytes:
        """The witness's signed receipt for this owner's own copy (handlers.on_push), b""
        if it gives none: what the result carries when no valid inventory receipt lists
        the owner's part. Taken from the answer to the copy sent again (`resent`), else to
        the first copy, waited for if not answered yet; with none, the copy is sent once
        more (a "duplicate" answer signs one too). A quarter base each at most, within the
        time before the members' fetches end."""
        me, j = self.state.me, self.state.my_index
        own = self.state.own_part(j)
        if self.signing is None or own is None:
            return b""
        witness, reply = self.plan.owner(j, 1), resent
        if (reply is None or not reply.receipt) and self._own_copy is not None:
            if (wait := self._witness_wait()) > 0:
                await asyncio.wait({self._own_copy}, timeout=wait)
            reply = answered(self._own_copy) or reply
        wait = self._witness_wait()
        if (
            (reply is None or not reply.receipt)
            and wait > 0
            and witness not in self.stats.failed_peers
        ):
            reply = await self._push(
                j, own.frame, witness=True, wait=wait, record=False, budget=wait
            )
        copy = reply.receipt if reply is not None else b""
        verify, group = self.signing.verify, self.plan.group_id
        mask = await asyncio.to_thread(read_receipt, verify, witness, group, j, copy)
        return copy if mask == members_mask(self.plan.members, [me]) else b""

    def _before_fetches_end(self) -> float:
        """Seconds an owner may still spend with its witness before publishing: a frozen
        witness must not hold its result past the members' attempt-0 fetches."""
        return self._left(self._attempt_deadline(0)) - self.deadlines.base / 2

    def _witness_wait(self) -> float:
        """How long one more exchange with the witness may take: a quarter base, within the
        time before the members' fetches end (<= 0: none left)."""
        return min(self.deadlines.base / 4, self._before_fetches_end())

    async def _inventory(self, j: int, named: list[str]) -> Reply | None:
        """Ask span j's witness which of the parts of `named` it holds (HOLDS, or None)."""
        witness = self.plan.owner(j, 1)
        budget = self._before_fetches_end()
        wait = max(0.0, self._witness_wait())
        mask = members_mask(self.plan.members, named)
        call = self.transport.inventory(witness, self._header(j, wait=wait), mask)
        # not recorded as a failure: the witness's own span is still fetched from it
        reply = await self._call(witness, call, min(wait + NETWORK_SLACK, budget), record=False)
        if reply is None:
            return None
        self.stats.bytes_received += len(reply.proofs) + len(reply.receipt)
        return reply if reply.code is Code.HOLDS else None

    async def _witness_value(
        self, mask: bytes, wait: float, asker: str | None = None
    ) -> Witnessed | None:
        """This member's reduction, as the witness, of its span over the parts `mask` names
        (None if the mask is not a majority including the owner; `missing` if a named part
        has not arrived after `wait` s). Each asker waits on its own, so one asking with a
        short wait decides nothing for the others; a complete reduction is cached per mask
        (every honest member asks about the same one), and `asker` (None: this member) may
        have at most MASKS_PER_ASKER new ones computed, or WitnessBusy."""
        j = self.state.witness_span()
        named = mask_members(self.plan.members, mask)
        owner = self.plan.owner(j, 0) if j is not None else None
        if j is None or named is None or owner not in named:
            return None
        if len(named) < self.plan.size // 2 + 1:
            return None
        span, me = self.state.spans[j], self.state.me

        def missing() -> tuple[str, ...]:
            lacking = tuple(m for m in named if m != me and m not in span.witness_parts)
            own = me in named and self.state.own_part(j) is None
            return lacking + ((me,) if own else ())

        await self.state.changed.wait_for(lambda: not missing(), wait)
        if lacking := missing():
            return Witnessed(None, lacking)
        task = self._witnessed.get(mask)
        if task is None:
            if asker is not None:
                if self._masks_by[asker] >= MASKS_PER_ASKER:
                    raise WitnessBusy(f"{MASKS_PER_ASKER} sets of parts checked already")
                self._masks_by[asker] += 1
            task = asyncio.ensure_future(self._reduce_witnessed(j, named))
            self._witnessed[mask] = task
        return await asyncio.shield(task)

    async def _reduce_witnessed(self, j: int, named: list[str]) -> Witnessed:
        """The reduction `_witness_value` caches: every part `named` has arrived."""
        span, me = self.state.spans[j], self.state.me
        own = self.state.own_part(j) if me in named else None
        others = [m for m in named if m != me]
        senders = ([me] if own is not None else []) + others
        contributions = ([own] if own is not None else []) + [span.witness_parts[m] for m in others]
        return Witnessed(await self._aggregate_final(j, contributions, 0, senders, count=False))

    async def _matching_own_reduction(self, finals: list[Final], wait: float) -> list[Final]:
        """As the witness taking its span over: the results members hold that match this
        member's own reduction of the parts each names (only those may be re-issued)."""
        checked = []
        for f in finals:
            expected = await self._witness_value(f.members, wait)
            mine = expected.final if expected is not None else None
            if mine is not None and await asyncio.to_thread(
                values_match, f.value, mine.value, self.tolerance
            ):
                checked.append(f)
        return checked

    async def _matches_witness(self, j: int, final: Final, owner: str) -> bool:
        """Is the attempt-0 owner's result for span j what its witness computes over the
        parts the owner names? (verify.py; True unchecked if the witness does not answer.)
        If not, flag whom the signed entries point at (`_blame`)."""
        witness = self.plan.owner(j, 1)
        wait = max(0.0, self._left(self._attempt_deadline(0)))
        named = mask_members(self.plan.members, final.members)
        if named is not None and owner in named and len(named) < self.plan.size // 2 + 1:
            # Not adopted, and no one blamed: an honest owner names only the parts that
            # reached it in time, and with slow links (a relay, say) a member's part can be
            # late. Flagging it made two replicas ban each other for good in the lab.
            self.stats.reject("result names a minority")
            return False
        if named is None or owner not in named:  # a result must name its owner's part
            self._flag_mismatch(j, owner, None)
            return False
        if witness == self.state.me:
            witnessed = await self._witness_value(final.members, wait)
            assert witnessed is not None  # the mask was checked above
            theirs = witnessed.final
            ok = theirs is not None and await asyncio.to_thread(
                values_match, final.value, theirs.value, self.tolerance
            )
            proofs, missing = (theirs.proofs if theirs else b""), list(witnessed.missing)
        else:
            nonce = os.urandom(NONCE_BYTES)
            header = self._header(j, 0, wait=wait)
            call = self.transport.check(witness, header, nonce, final.members)
            reply = await self._call(witness, call, wait + NETWORK_SLACK)
            if reply is None or reply.code not in (Code.SKETCH, Code.NOTHING):
                self.stats.unchecked_spans += 1
                return True
            self.stats.bytes_received += len(reply.payload) + len(reply.proofs)
            sketched = parse_sketch(reply.payload) if reply.code is Code.SKETCH else None
            ok = sketched is not None and sketches_match(
                await asyncio.to_thread(sketch, final.value, nonce), sketched, self.tolerance
            )
            proofs, missing = reply.proofs, []
            if reply.code is Code.NOTHING:
                missing = mask_members(self.plan.members, reply.members) or [owner]
        if ok:
            self.stats.checked_spans += 1
            return True
        await self._blame(j, final, owner, named, proofs, missing)
        return False

    async def _blame(
        self, j: int, final: Final, owner: str, named: list[str], proofs: bytes, missing: list[str]
    ) -> None:
        """A result failed its witness check: flag who lied, as far as the signed entries of
        the parts (proofs.py) tell. The span is not adopted either way."""
        witness = self.plan.owner(j, 1)
        if missing and self.signing is not None and witness != self.state.me:
            verify, group = self.signing.verify, self.plan.group_id
            mask_len = len(members_mask(self.plan.members, []))
            signed = await asyncio.to_thread(
                read_receipts, verify, witness, group, j, final.receipt, mask_len
            )
            held = mask_members(self.plan.members, signed) if signed is not None else None
            if held is not None and set(missing) <= set(held):
                # it signed that it held these parts, and parts are never dropped: it lies
                self.stats.reject("witness denies its receipt")
                self.stats.mismatch_witnesses.add(witness)
                log.warning(
                    "span %d of %s round %d: witness %s says it lacks parts it signed for",
                    j,
                    self.plan.phase,
                    self.plan.round,
                    witness[-8:],
                )
                return
        if missing and owner not in missing and set(missing) <= set(named):
            # The witness lacks another member's part: that member may have sent it to the
            # owner alone (or its copy was lost), or the witness lies. Nobody is flagged.
            self.stats.reject("witness lacks a part")
            return
        if self.signing is not None and not missing:
            verdict = await asyncio.to_thread(
                attribute, self.signing.verify, self.plan.group_id, j, named, final.proofs, proofs
            )
            if verdict.equivocators:
                self.stats.reject("equivocation")
                self.stats.equivocated.update(verdict.equivocators)
                log.warning(
                    "span %d of %s round %d: %s signed two parts",
                    j,
                    self.plan.phase,
                    self.plan.round,
                    ", ".join(m[-8:] for m in sorted(verdict.equivocators)),
                )
                return
            if not verdict.reducer_unknown:  # a forged entry: whoever presented it
                self._flag_mismatch(
                    j,
                    owner if verdict.owner_forged else None,
                    witness if verdict.witness_forged else None,
                )
                return
        self._flag_mismatch(j, owner, witness)

    def _flag_mismatch(self, j: int, owner: str | None, witness: str | None) -> None:
        self.stats.reject("result mismatch")
        if owner is not None:
            self.stats.mismatched.add(owner)
            self.stats.failed_peers.add(owner)
        if witness is not None and witness != self.state.me:
            self.stats.mismatch_witnesses.add(witness)
        log.warning(
            "span %d of %s round %d: the result of %s does not match its witness's",
            j,
            self.plan.phase,
            self.plan.round,
            self.plan.owner(j, 0)[-8:],
        )
