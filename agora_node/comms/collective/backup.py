"""The backup side of a span, as a mixin of `AllReduce`: a member that becomes the span's
owner at a later attempt re-reduces it (step 3 of allreduce.py's protocol), and an owner
asked for a promise before it ran decides whether to keep it.

It uses the AllReduce's state, plan, stats, transport, deadlines and helpers (`_call`,
`_header`, `_left`, `_attempt_deadline`, `_reduce_deadline`, `_decode_final`,
`_aggregate_final`, and checking.py's `_matching_own_reduction`).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace

from agora_node.comms.collective.checking import answered
from agora_node.comms.collective.state import Contribution, Final
from agora_node.comms.collective.wire import Code


class Backup:
    """Re-reducing a span as its backup, and the promises that rely on (see the module
    docstring); only AllReduce uses it."""

    async def _rereduce(self, j: int, attempt: int) -> None:
        """Become the owner of span j at `attempt` (see the module docstring)."""
        self.state.promise(j, attempt)
        # leave half a base for aggregating and for the others to fetch, but never rush peers
        base = self.deadlines.base
        wait = max(base, self._left(self._attempt_deadline(attempt)) - base / 2)
        others = [m for m in self.plan.members if m != self.state.me]
        # a member may take a quarter base to register and another to encode its part
        ask = self._header(j, attempt, wait=base / 4)
        replies = await asyncio.gather(
            *(self._call(m, self.transport.query(m, ask), wait) for m in others)
        )
        finals, contributions, senders = [], [], []
        own = self.state.own_part(j)
        if own is not None:
            contributions.append(own)
            senders.append(self.state.me)
        for member, reply in zip(others, replies, strict=True):
            if reply is None or reply.code not in (Code.FINAL, Code.CONTRIBUTION):
                continue
            self.stats.bytes_received += len(reply.payload)
            decoded = await self._decode_final(reply, j)
            if decoded is None:
                continue
            if reply.code is Code.FINAL:  # of an earlier attempt, whatever it claims
                finals.append(replace(decoded, attempt=min(decoded.attempt, attempt - 1)))
            elif reply.weight >= 0:
                contributions.append(Contribution(reply.weight, decoded.value, reply.payload))
                senders.append(member)
        if self.verify and attempt == 1 and finals:  # as the witness: only a value that matches
            wait = max(0.0, self._left(self._attempt_deadline(attempt)) - base / 2)
            finals = await self._matching_own_reduction(finals, wait)
        if finals:  # someone already holds the span's value: re-issue exactly that
            best = most_held(finals)
            final = Final(best.frame, attempt, best.value, best.members, best.proofs)
        elif contributions:
            final = await self._aggregate_final(j, contributions, attempt, senders)
        else:
            return
        if self.state.try_finalize(j, final):
            self.stats.repaired_spans += 1

    async def _keep_deferred_promise(self) -> None:
        """The own span's backup asked for a promise before this member ran. An honest one
        asks only once its deadline for this span passed, when every other member's own
        reduce has ended too: then none accepts this member's parts, and the promise is
        kept (the group went on without this member). If one accepts, its owner was still
        waiting on this member, the backup asked early (a witness taking the span over),
        and the promise is dropped."""
        me, span = self.state.my_index, self.state.spans[self.state.my_index]
        pushes = self._to_owners

        def taken() -> bool:
            return any(
                (reply := answered(t)) is not None and reply.code is Code.ACCEPTED for t in pushes
            )

        def heard() -> bool:
            return taken() or all(t.done() for t in pushes)

        await self.state.changed.wait_for(heard, self._left(self._reduce_deadline()))
        if taken():
            self.stats.reject("promise asked early")
            span.deferred = 0
        else:
            self.state.promise(me, span.deferred)


def most_held(finals: list[Final]) -> Final:
    """The value most of the members asked hold, then the latest attempt among those. Under
    crash failures they all hold one value; choosing by the attempt alone let one member
    answering a made-up final with a high attempt decide a span past its witness."""
    holders = Counter(f.frame for f in finals)
    return max(finals, key=lambda f: (holders[f.frame], f.attempt))
