"""When a stage replica takes its outer steps: the one owner of the outer-round schedule.

`OuterLoop` (outer.py) knows how to run one round; this module decides when.
Replicas of a stage stay in step without a coordinator:

1. a round ends for every replica as soon as enough of the others have done
   their H inner steps and opened the round's matchmaking that joining makes a
   majority of the stage (one other in a stage of up to three, groups.py,
   `round_should_end`): the others join with the steps they have, weighted by
   their tokens;
2. a replica whose round number fell behind the rounds its stage's active
   replicas announce jumps to the highest round a strict majority of them
   announce (`target_round`): one replica claiming a huge round moves nobody;
3. a replica whose latest anchor a strict majority of its stage's replicas do not hold,
   while they all hold one other (it mixed apart from them: partitioned, or closing a
   round's participant list on another view), takes theirs as a joiner does (`outvoted`,
   `resync`), instead of mixing alone until a later round's group brings them together;
   only where every group is the whole stage (gossip's smaller groups differ by design);
4. the blocking part of a round (pseudo-gradient mix, Nesterov step, new
   weights) runs while the stage worker is frozen: inner steps wait, forwards
   and backwards go on, and the weights are read and written on the worker
   thread only. With `overlap` (manifest `outer.overlap`) the worker is frozen
   only at the round's end, to read the weights and set them to the outer step
   of this replica's own pseudo-gradient (an eager step), and, once the mixes
   are done, to write the mixed round's anchor plus the inner progress made
   since (overlap.py); the next round waits for this one to land.

The two decisions are pure functions, tested without a network.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from agora_node.comms.state_transfer import StateTransferError
from agora_node.node.attestation import Attestation
from agora_node.node.loops import to_completion
from agora_node.node.outer import OuterLoop
from agora_node.node.overlap import OverlappedWeights
from agora_node.node.worker import StageWorker
from agora_node.protocol import state_blob
from agora_node.protocol.records import MAX_STEP, NodeRecord

log = logging.getLogger(__name__)

MAX_BLOBS_LENT = 2
"""Copies of the state that transfers to joiners may hold at once (lend_blob)."""

KEPT_DIGESTS = 10


MAX_SOLE_JUMP = 1000
"""Rounds one other replica's word moves this one at a time (at a round a minute, days of
a swarm's progress), one such jump per round this replica ended."""

MAX_ROUND = MAX_STEP - 1_000_000
"""No jump goes past this: a round near the records' limit (MAX_STEP) left this replica's
own records out of range, refused by every reader, and it dropped out of the stage."""


def announced(replica_rounds: Iterable[int]) -> list[int]:
    """The well-formed rounds of `replica_rounds` (non-negative integers), highest first."""
    return sorted(
        (r for r in replica_rounds if isinstance(r, int) and not isinstance(r, bool) and r >= 0),
        reverse=True,
    )


SOLE_NEAR = 2
"""Rounds one other replica's word moves this one at any time (`OuterRounds._catch_up`)."""


def target_round(own: int, replica_rounds: Iterable[int]) -> int:
    """The round to be in: the highest round that a strict majority of this stage's other
    active replicas announce (each announces its own round; r counts for every round <= r),
    never lower than the own one (a lagging replica catches up, nobody goes back).

    One replica's claim alone decides nothing: with m others, the answer is the
    (m // 2 + 1)-th largest announced round, so a minority of liars announcing huge rounds
    cannot drag honest replicas forward. Values that are not non-negative integers are
    ignored. With one other replica its word is all there is (two cannot outvote one),
    but it moves this one at most `MAX_SOLE_JUMP` rounds at a time: that replica may be
    a stranger, and one announcing a round near the records' limit (MAX_STEP) took this
    replica there, after which its own records were out of range, refused by every
    reader, and it dropped out of the stage for good."""
    rounds = announced(replica_rounds)
    if not rounds:
        return own
    if len(rounds) == 1:
        return max(own, min(rounds[0], own + MAX_SOLE_JUMP, MAX_ROUND))
    # two host-less records announcing 2**40 were the majority of a stage of two replicas
    # and took both there: the records of peers that no probe answered count as behind
    # (the caller's replica_rounds), and no round goes near the records' limit
    return max(own, min(rounds[len(rounds) // 2], MAX_ROUND))


ASK_EVERY = 3
"""The DHT is asked whether another replica opened the round at every third poll (1.5 s
at the default 0.5 s): the round's own steps are counted at every poll, but each ask is
a DHT read of the stage's matchmaking key by every replica of the stage, all the time
(at two a second per replica, about half of a 4-node swarm's DHT reads and writes by
count, beside the directory's five every 3 s), and joining a round opened elsewhere a
second later still makes its 5 s window. A replica alone in its stage never asks."""


def round_should_end(steps_done: int, every: int, opened_elsewhere: bool) -> bool:
    """End the round after `every` inner steps, or once another replica opened it and
    this one has at least one step to contribute."""
    return steps_done >= every or (steps_done > 0 and opened_elsewhere)


def anchor_agreement(
    own: dict[int, str], others: dict[int, dict[str, str]]
) -> dict[str, dict[str, list[str]]]:
    """Per round this replica kept a digest of: which other replicas attested the same
    anchor after it ("agree") and which another ("differ"). Replicas of a stage that
    mixed their anchors hold the same one; a lasting "differ" means they drifted apart."""
    out = {}
    for round_no, digest in sorted(own.items()):
        seen = others.get(round_no, {})
        out[str(round_no)] = {
            "agree": sorted(p for p, d in seen.items() if d == digest),
            "differ": sorted(p for p, d in seen.items() if d != digest),
        }
    return out


NEAR_ROUNDS = 2
"""Others' anchors are kept for rounds this close to this replica's own (`_kept`)."""


def outvoted(own: dict[int, str], others: dict[int, dict[str, str]], replicas: int) -> int | None:
    """The latest round this replica kept an anchor digest of, if other replicas that are a
    strict majority of the stage's `replicas` (this one counted) all attest one other
    anchor for it; else None. Only the latest round counts: an older disagreement was
    mixed away since, or is judged again at this one."""
    if not own:
        return None
    round_no = max(own)
    counts: dict[str, int] = {}
    for digest in others.get(round_no, {}).values():
        if digest != own[round_no]:
            counts[digest] = counts.get(digest, 0) + 1
    best = max(counts.values(), default=0)
    return round_no if 2 * best > max(replicas, 1) else None


def _sha256(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


class OuterRounds:
    """Runs `outer`'s rounds every H inner steps of `worker`; see the module docstring.

    replica_rounds(): the outer rounds the stage's other active replicas announce.
    replica_count(): how many live replicas the stage has (this one included).
    replica_ids(): their peer ids, when known (membership): then a round closes early
    only once each of them has joined, not on a count that strangers' entries can fill.
    """

    def __init__(
        self,
        outer: OuterLoop,
        worker: StageWorker,
        *,
        inner_steps: int,
        replica_rounds: Callable[[], list[int]],
        replica_count: Callable[[], int],
        replica_ids: Callable[[], list[str]] | None = None,
        poll_s: float = 0.5,
        overlap: bool = False,
        resync: Callable[[], Awaitable[Any]] | None = None,
        on_attested: Callable[[], None] = lambda: None,
    ) -> None:
        """`resync`: adopt the state a strict majority of the stage's replicas attest and
        return it (state_search.resync_state: a LoadedState, or None when none was adopted).
        `on_attested`: called when the attestation changes (a round ended), for the node
        to publish its record now: a joiner compares what a replica sends with what its
        record attests, and one lagging a refresh behind made fast rounds unjoinable."""
        self.replica_ids, self.overlap, self.resync = replica_ids, overlap, resync
        self.on_attested = on_attested
        self._resynced: set[int] = set()
        """Rounds this replica took the majority's state for (once each)."""
        self._landing: asyncio.Task | None = None
        """With overlap: the round whose mixes are still under way (at most one)."""
        self._ending: asyncio.Future | None = None
        """With overlap: the eager step that starts `_landing` (shielded from the loop)."""
        self._abandon = asyncio.Event()
        """Set by `abandon`: rounds under way are undone and the loop starts no more."""
        self.outer, self.worker, self.every = outer, worker, inner_steps
        self.replica_rounds, self.replica_count, self.poll_s = (
            replica_rounds,
            replica_count,
            poll_s,
        )
        self.anchor_digests: dict[int, str] = {}
        """Digest of each recent anchor this replica attested, by the round that made it
        (OuterState.anchor_round): the stage's replicas compare equal."""
        self.replica_anchors: dict[int, dict[str, str]] = {}
        """What the other replicas' records attested for those rounds: {round: {peer: digest}}."""
        self._sole_jump_at: int | None = None
        """Rounds ended (OuterLoop.totals) at the last far jump on one replica's word."""
        """The round the last catch-up on one other replica's word went to (`_catch_up`)."""
        self._lock = asyncio.Lock()
        self._epoch = 0
        """Bumped whenever the outer state changes (a round ended)."""
        self._attested: tuple[tuple[int, int], Attestation] | None = None
        self._blob: tuple[Attestation, bytes, str] | None = None
        self._blobs_made = 0
        self._lent: Counter[int] = Counter()
        """Transfers in progress, by the blob they send (its number in the order made)."""

    @property
    def round(self) -> int:
        return self.outer.state.round

    @contextlib.asynccontextmanager
    async def consistent(self) -> AsyncIterator[None]:
        """No round ends inside: weights and outer state read here are from one moment."""
        async with self._lock:
            yield

    def state_dict(self) -> dict[str, Any]:
        return self.outer.state_dict()

    # ---- attestation and state transfer (docs/security.md, "State transfer") -----------
    @property
    def attested(self) -> Attestation | None:
        """The latest attestation computed (what the directory record announces)."""
        return self._attested[1] if self._attested is not None else None

    async def attest(self) -> Attestation:
        """(round, anchor digest, anchor+momentum digest) of the outer state now."""
        async with self._lock:
            return await self._attest_locked()

    async def _attest_locked(self) -> Attestation:
        state = self.outer.state
        key = (self._epoch, state.anchor_round)
        if self._attested is None or self._attested[0] != key:
            anchor, outer = await asyncio.to_thread(
                state_blob.digests, state.anchor, state.momentum
            )
            self._attested = (key, Attestation(state.anchor_round, anchor, outer or ""))
            self.anchor_digests[state.anchor_round] = anchor
            for old in sorted(self.anchor_digests)[:-KEPT_DIGESTS]:
                del self.anchor_digests[old]
            self.on_attested()
        return self._attested[1]

    def _state_changed(self) -> None:
        """The outer state moved (a round, a resync, a restart): the next attest computes a
        new attestation, and the blob of the old state is dropped."""
        self._epoch += 1
        self._blob = None

    async def restart_from_weights(self) -> None:
        """Anchor := the worker's weights, momentum := 0 (a cell helper whose cell is gone):
        a new outer state, attested and announced as after a round (the record and the
        state a joiner is sent changed together; the blob of the old anchor is dropped).
        Where a strict majority of the stage attests another anchor for that round, the
        next poll finds this replica outvoted and it takes theirs (`_resync_if_outvoted`)."""
        async with self._lock:
            await self.worker.call(self.outer.reset_to_weights)
            self._state_changed()
        await self.attest()

    async def transfer_blob(self) -> tuple[Attestation, bytes, str]:
        """The anchor state for a joiner, serialized once per outer state (one at a time,
        cached until the next round): concurrent joiners cost one copy, not the worker.
        Returns the attestation, the blob and its sha256. A new copy is not made while
        transfers still send two older ones (`lend_blob`): StateTransferError (busy)."""
        async with self._lock:
            attested = await self._attest_locked()
            if self._blob is None or self._blob[0] != attested:
                self._blob = None  # free the old copy before making the new one
                if len(self._lent) >= MAX_BLOBS_LENT:
                    raise StateTransferError(
                        f"busy: transfers still send {len(self._lent)} older copies of this "
                        "stage's state; ask again later"
                    )
                state = self.outer.state
                blob = await asyncio.to_thread(
                    state_blob.encode, attested.round, state.anchor, state.momentum
                )
                self._blob = (attested, blob, await asyncio.to_thread(_sha256, blob))
                self._blobs_made += 1
            return self._blob

    @contextlib.asynccontextmanager
    async def lend_blob(self) -> AsyncIterator[tuple[Attestation, bytes, str]]:
        """`transfer_blob`'s answer, counted as sent until the transfer ends: slow joiners
        across rounds hold at most MAX_BLOBS_LENT copies of the state between them (four in
        four rounds held four before), and a running transfer is never cut for a newer one
        (a stranger asking once a round would have cut every slow joiner's)."""
        attested, blob, sha = await self.transfer_blob()
        made = self._blobs_made  # (no await since: the number of the blob just returned)
        self._lent[made] += 1
        try:
            yield attested, blob, sha
        finally:
            self._lent[made] -= 1
            if not self._lent[made]:
                del self._lent[made]

    async def run(self, stop: asyncio.Event) -> None:
        start_step, start_tokens = self.worker.optimizer.steps, self.worker.stats.trained_tokens
        while not stop.is_set() and not self._abandon.is_set():
            await self._landed()
            self._catch_up()
            await self.attest()  # what the record announces (cached unless the state changed)
            polls = 0
            while not stop.is_set():
                if await self._resync_if_outvoted():  # this round starts from theirs
                    start_step = self.worker.optimizer.steps
                    start_tokens = self.worker.stats.trained_tokens
                done = self.worker.optimizer.steps - start_step
                # Alone in its stage, nobody else can open this replica's round.
                ask = done > 0 and polls % ASK_EVERY == 0 and self.replica_count() > 1
                polls += done > 0
                opened = ask and await self.outer.opened_elsewhere(self._expect())
                if round_should_end(done, self.every, opened):
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.poll_s)
            if stop.is_set() or self._abandon.is_set():
                return
            await self._landed()  # the previous round's anchor first (overlap)
            if self._catch_up():  # the stage moved on while we trained: join its round
                continue  # instead of a round its replicas have left (our steps count there)
            await self.outer.begin_round(expect=self._expect())
            if self.overlap:  # shielded: a cancel cannot leave the eager step without a landing
                self._ending = asyncio.ensure_future(self._overlap(start_tokens))
                end_tokens = await asyncio.shield(self._ending)
            else:
                async with self.worker.frozen() as weights:
                    end_tokens = self.worker.stats.trained_tokens  # steps are held from here
                    await self._end_round(self._round_tokens(start_tokens, end_tokens), weights)
            # (steps read after the round: adopting an anchor starts a fresh optimizer)
            start_step, start_tokens = self.worker.optimizer.steps, end_tokens
            if not self.overlap:
                await self.attest()  # notes the new anchor's digest (anchor_digests)

    @staticmethod
    def _round_tokens(start: int, end: int) -> int:
        """A round's tokens, counted while its inner steps are held: what finishes later
        lands in the next round's steps and counts there. A drop of gradients counted in
        an earlier round can take back more than this round trained: none, then."""
        return max(0, end - start)

    async def _end_round(self, tokens: int, weights: Any) -> None:
        async with self._lock:
            await self._finish_round(tokens, weights)

    async def _finish_round(self, tokens: int, weights: Any) -> None:
        blocked = (lambda: weights.blocked_s) if self.overlap else None
        try:
            await self.outer.end_round(tokens=tokens, weights=weights, blocked_s=blocked)
        finally:  # also when cancelled once the step committed: the state moved on
            self._state_changed()

    async def _overlap(self, start_tokens: int) -> int:
        """Freeze the worker to read the round's end and set the eager step, then start the
        landing, which owns the rounds' lock from here until it lands or is undone: no
        checkpoint or state copy pairs the eager weights with the old anchor. Returns the
        trained tokens at the round's end."""
        await self._lock.acquire()
        try:
            started = time.monotonic()
            state = self.outer.state
            async with self.worker.frozen() as weights:
                end_tokens = self.worker.stats.trained_tokens  # steps are held from here
                at_end = await weights.read()
                start = await asyncio.to_thread(state.preview_from, at_end)
                await weights.write(start)
            blocked = time.monotonic() - started
            overlapped = OverlappedWeights(self.worker, at_end, start, blocked)
        except BaseException:
            self._lock.release()
            raise
        tokens = self._round_tokens(start_tokens, end_tokens)
        self._landing = asyncio.create_task(self._land(tokens, overlapped))
        return end_tokens

    async def _land(self, tokens: int, weights: OverlappedWeights) -> None:
        """An overlapped round's mixes and its anchor's landing, holding the lock `_overlap`
        took. Only `abandon` stops it (nothing else cancels it: `_landed` shields it):
        before the outer step commits, the mixes are cancelled and the eager step undone;
        once the step is committing (`OuterLoop.committing`) the round lands."""
        round_no = self.outer.state.round
        inner = asyncio.create_task(self._finish_round(tokens, weights))
        abandoned = asyncio.create_task(self._abandon.wait())
        try:
            await asyncio.wait({inner, abandoned}, return_when=asyncio.FIRST_COMPLETED)
            if not inner.done() and not self.outer.committing:
                inner.cancel()
            await asyncio.wait({inner})
            if inner.cancelled() or inner.exception() is not None:
                if self.outer.state.round == round_no:  # no step taken: undo the eager one
                    await weights.restore()
                if not inner.cancelled():
                    inner.result()  # the round's failure is the run loop's
                return
        finally:
            abandoned.cancel()
            self._lock.release()
        await self.attest()

    async def _landed(self) -> None:
        """Wait for an overlapped round to finish; its failure is this loop's failure. A
        cancel of the loop does not reach the landing (only `abandon` stops it)."""
        if self._landing is not None:
            await asyncio.shield(self._landing)
            self._landing = None

    def _expect(self) -> int | set[str]:
        if self.replica_ids is not None:
            ids = set(self.replica_ids()) | {self.outer.me}
            if len(ids) >= self.replica_count():
                return ids
        return self.replica_count()

    async def _resync_if_outvoted(self) -> bool:
        """Take the stage's majority state when this replica's anchor is outvoted (module
        docstring, 3); whether it did."""
        replicas = self.replica_count()
        size = self.outer.config.group_size
        if self.resync is None or (size and replicas // size > 1):  # gossip: several groups
            return False
        known = set(self.replica_ids()) if self.replica_ids is not None else None
        attested = {  # only the stage's standing replicas vote (not banned peers, not helpers)
            r: {p: d for p, d in seen.items() if known is None or p in known}
            for r, seen in self.replica_anchors.items()
        }
        round_no = outvoted(self.anchor_digests, attested, replicas)
        if round_no is None or round_no in self._resynced:
            return False
        self._resynced.add(round_no)
        others = attested.get(round_no, {})
        log.warning(
            "outer round %d: %d of the stage's %d replicas hold another anchor than this "
            "one's (it mixed apart from them): taking theirs",
            round_no,
            sum(d != self.anchor_digests[round_no] for d in others.values()),
            replicas,
        )
        await self._landed()
        async with self._lock:
            loaded = await self.resync()
            if loaded is None or loaded.outer is None:
                log.warning("outer round %d: no attested state adopted; mixing on", round_no)
                return False
            try:  # on a thread, and whole: a cancel (a leave) waits for it under the lock
                load = asyncio.to_thread(
                    self.outer.load_state_dict, loaded.outer, warming=loaded.warming
                )
                await to_completion(load)
            finally:
                self._state_changed()
        await self.attest()
        return True

    def _catch_up(self) -> bool:
        """Jump to the round the stage's replicas are in; whether the round changed. A jump
        of more than SOLE_NEAR rounds on one other replica's word alone happens once per
        round this one ended (counted, so near jumps in between open no way: a stranger
        alternating near and far rounds went 10,000 rounds in 20 reads): the round loop
        asks again at once after a jump, so a stranger announcing a far round took it there
        a million rounds a second, ending no round on the way. A near one is never held
        back (a replica that lagged a round behind its only partner, then another, re-joins
        it at once). A majority's word moves it at once, however far (a joiner from init
        meets its stage in one jump), never near the records' limit."""
        rounds = announced(self.replica_rounds())
        target = target_round(self.round, rounds)
        if target <= self.round:
            return False
        if len(rounds) == 1 and target - self.round > SOLE_NEAR:  # far, on one word
            ended = self.outer.totals["rounds"]
            if ended == self._sole_jump_at:
                return False  # no round ended since the last one (near jumps between count not)
            self._sole_jump_at = ended
        log.info("outer round %d -> %d to meet this stage's replicas", self.round, target)
        self.outer.state.round = target
        return True

    def note_replica_anchors(self, records: Iterable[NodeRecord]) -> None:
        """Remember the anchors other replicas attest for rounds this one kept a digest of
        (their records show only their latest round, so earlier ones are kept here)."""
        for r in records:
            if r.peer_id != self.outer.me and r.anchor_digest and self._kept(r.anchor_round):
                self.replica_anchors.setdefault(r.anchor_round, {})[r.peer_id] = r.anchor_digest
        for old in [r for r in self.replica_anchors if not self._kept(r)]:
            del self.replica_anchors[old]

    def _kept(self, round_no: int) -> bool:
        """Whether others' anchors of `round_no` are worth keeping: a round this replica kept
        a digest of, or one near its own (an anchor it has yet to make: a replica that mixed
        apart from the others learns what they hold even if they moved on before it got
        there). A stranger's far-off round number is never kept."""
        return round_no in self.anchor_digests or abs(round_no - self.round) <= NEAR_ROUNDS

    def status(self) -> dict[str, Any]:
        status = self.outer.status()
        status["anchor_digests"] = {str(r): d for r, d in self.anchor_digests.items()}
        agreement = anchor_agreement(self.anchor_digests, self.replica_anchors)
        status["agreement"] = agreement
        # The anchor a round produced is attested as the next round's (the counter moved on).
        status["recent_rounds"] = [
            {**r, "anchor_agreement": agreement.get(str(r["round"] + 1))}
            for r in status.get("recent_rounds", [])
        ]
        return status

    def abandon(self) -> None:
        """Stop an overlapped round under way, and any the loop still starts (a drain
        abandons rounds, as the run loop's): its mixes end and its eager step is undone."""
        self._abandon.set()

    async def close(self) -> None:
        """Abandon what is under way and wait for it to be undone or to land; a cancel of
        this wait does not reach it (asyncio.wait)."""
        self.abandon()
        for task in (self._ending, self._landing):
            if task is not None:
                await asyncio.wait({task})
                if not task.cancelled():
                    task.exception()  # retrieved: the loop reported it, or nobody awaits it
        await self.outer.close()
