"""The state a joining (or outvoted) replica starts from: `load_state` adopts the outer
anchor a strict majority of the stage's live replicas attest in their signed records
(fetched from one of them, decoded strictly, digest recomputed), unless the own checkpoint
is at least as new; else the checkpoint, else the manifest's deterministic init. It returns
what it loaded. `resync_state` is the same search for a running replica (node/rounds.py).
Why a state is trusted: node/attestation.py and docs/security.md ("State transfer").
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from agora_node.comms import state_transfer
from agora_node.node import attestation
from agora_node.node.checkpoint import load_latest_checkpoint
from agora_node.node.worker import StageWorker
from agora_node.protocol import state_blob

if TYPE_CHECKING:
    from agora_node.node.service import ServiceContext

log = logging.getLogger(__name__)


@dataclass
class LoadedState:
    outer: dict[str, Any] | None
    """The outer state (anchor, momentum, round) that came with the weights, if any."""
    warming: bool
    """Copied from a replica: carry zero weight in averaging until the first round."""
    origin: dict[str, Any]
    """Where it came from (replica / checkpoint / init), with checksums and, for a
    replica, the attestation it matched and the sources rejected on the way."""


RESYNC_DEADLINE_S = 30.0
"""A running replica's search for its stage's majority state gives up after this: its outer
rounds wait meanwhile, and a later round's anchor mix may still bring it back."""
STATE_POLL_S = 1.0
"""Between directory reads while no strict majority attests a state."""
HELD_POLL_S = 0.25
"""Between directory reads while a state newer than the majority's is kept (`_Held`)."""
KEPT_AHEAD = 2
"""Rounds past the latest majority's a kept state may be for the joiner to read the records
every HELD_POLL_S (beyond, every STATE_POLL_S: a liar's far-future round is kept, but does
not make the joiner read the directory 4 times a second), and to keep it over a farther
one (`_Held.keep`)."""
SPLIT_READS = 3
"""Directory reads a node holding a checkpoint makes while no strict majority attests any
state but some replica attests a round newer than the checkpoint's (replicas caught
mid-change, their records a round apart), before it resumes the checkpoint."""
GOOD_STATE_RATE = 4 << 20
"""Bytes per second (32 Mbit/s) at which a source always gets the time its stage's state
needs, within the search's time left, however many sources are left to ask."""


@dataclass
class _Fetched:
    """A state a source sent that decoded strictly, with its recomputed anchor digest."""

    state: state_blob.AnchorState
    anchor_digest: str
    outer_digest: str | None
    """Of anchor and momentum (None: it came without momentum)."""
    source: str

    def near(self, majority: attestation.Attestation) -> bool:
        """Within KEPT_AHEAD rounds of `majority`'s."""
        return self.state.round <= majority.round + KEPT_AHEAD


class _Held:
    """Sources that sent a state of a round past the majority's (they finished a round
    while this joiner read the directory and fetched), and the last such state, kept: it is
    adopted if a strict majority comes to attest exactly its round and digest, so a stage
    whose rounds are shorter than a read and a transfer can still be joined (every state
    fetched was a round ahead of the records read before asking, and was thrown away).

    A source that sent round r is not asked again before the majority attests round r (a
    liar's far-future round costs one transfer per search). The last state fetched is kept
    (the stage's newest, the likeliest to be attested next), at most one, unless it is far
    ahead and the one kept is near (KEPT_AHEAD); so a liar's can stand in for an honest
    one until the next arrives or the majority passes it, and a source whose state the
    majority then attests with another digest is rejected. (Sources are asked in the order
    of the time they have taken, `_Search.spent`: a liar that sends junk slowly comes after
    the honest replicas that answered.)"""

    def __init__(self) -> None:
        self.state: _Fetched | None = None
        self.sent: dict[str, int] = {}
        """Source -> the round of the state it sent."""

    def keep(self, fetched: _Fetched, majority: attestation.Attestation) -> bool:
        """Note what its source sent and keep it, unless it is far ahead and the state kept
        is near: whether kept."""
        self.sent[fetched.source] = fetched.state.round
        if self.near(majority) and not fetched.near(majority):
            return False
        self.state = fetched
        return True

    def near(self, majority: attestation.Attestation | None) -> bool:
        """Whether a state is kept within KEPT_AHEAD rounds of `majority`'s."""
        return self.state is not None and majority is not None and self.state.near(majority)

    def waiting(self, majority: attestation.Attestation | None) -> set[str]:
        """Sources not to ask yet: their round is past what the majority attests."""
        at = -1 if majority is None else majority.round
        return {source for source, round_no in self.sent.items() if round_no > at}

    def settle(self, plan: attestation.SourcePlan, search: _Search) -> _Fetched | None:
        """The kept state if the majority attests exactly it now (else None); dropped when
        the majority has passed it, its source rejected when the majority attests another
        digest for its round."""
        got, majority = self.state, plan.majority
        if got is None or majority is None:
            return None
        verdict = attestation.check(plan, got.state.round, got.anchor_digest)
        if verdict == attestation.Verdict.ADOPT:
            return got
        if verdict == attestation.Verdict.REJECT:
            self.state = None
            if got.state.round == majority.round:
                reason = f"digest: round {got.state.round} {got.anchor_digest} is not attested"
                search.rejected[got.source] = reason
                log.warning("state kept from %s rejected (%s)", got.source[-8:], reason)
        return None


@dataclass
class _Search:
    """One search for a stage's attested state among its replicas."""

    deadline_s: float
    plan: attestation.SourcePlan = field(
        default_factory=lambda: attestation.SourcePlan(0, None, 0, (), {})
    )
    rejected: dict[str, str] = field(default_factory=dict)
    """Sources whose bytes must not be adopted: not asked again."""
    unavailable: dict[str, str] = field(default_factory=dict)
    """Sources that could not send (gone, busy, slow): asked on the next pass."""
    spent: dict[str, float] = field(default_factory=dict)
    """Seconds each source has taken in this search: who took least is asked first."""
    replicas: list = field(default_factory=list)


async def _from_replicas(
    ctx: ServiceContext,
    worker: StageWorker,
    search: _Search,
    checkpoint_round: int | None = None,
    partners: frozenset[str] = frozenset(),
    away_s: float = 0.0,
) -> LoadedState | None:
    """The state a strict majority of the stage's live replicas attest, adopted into
    `worker`, or None (no majority, none newer than `checkpoint_round`, every source
    refused, or the deadline)."""
    stage = worker.index
    numel = worker.trainable_numel()
    deadline = time.monotonic() + search.deadline_s
    held = _Held()
    split_reads = 0
    while True:
        records = (await ctx.fetch_records()).get(stage, [])
        search.replicas = attestation.live_replicas(records, stage, ctx.peer_id)
        if not search.replicas:
            return None
        adoptable = held.settle(attestation.plan_sources(search.replicas), search)
        # banned peers count in the majority, never asked for bytes; whether to leave the
        # own checkpoint weighs every attester not rejected, those not to ask yet too
        excluded = set(search.rejected) | ctx.suspects.banned()
        plan = attestation.plan_sources(search.replicas, exclude=excluded)
        prefer = attestation.prefer_replicas(plan, checkpoint_round, partners, away_s)
        if checkpoint_round is not None and not prefer:
            split_reads += 1
            voters = [r for r in search.replicas if r.peer_id not in excluded]
            if not _split_past(plan, voters, checkpoint_round, split_reads):
                ahead = plan.majority is not None and plan.majority.round > checkpoint_round
                if ahead:  # said, so a restart that takes its older state is not a mystery
                    log.info(
                        "resuming the own checkpoint (outer round %d): %d replica(s) attest "
                        "round %d, but one replica's word replaces a node's own state only if "
                        "it was a partner of the node's and the node was away over %.0f s",
                        checkpoint_round,
                        plan.votes,
                        plan.majority.round,
                        attestation.AWAY_S,
                    )
                return None  # no majority attests a round newer than the own checkpoint's
            await asyncio.sleep(min(STATE_POLL_S, max(0.0, deadline - time.monotonic())))
            continue
        if adoptable is not None:
            return await _adopt(worker, plan, adoptable, search)
        waiting = held.waiting(plan.majority)
        plan = attestation.plan_sources(search.replicas, exclude=excluded | waiting)
        search.plan = plan
        if plan.majority is not None and not plan.sources and not waiting:
            return None  # every attester of the majority was rejected
        # who has taken least time in this search is asked first, and no source may spend
        # more than its share of the time left, or what the state takes at GOOD_STATE_RATE
        # when that is more: a liar that claims to be idle and then trickles bytes (or
        # sends junk of a round the stage passes while it sends) would otherwise be asked
        # first every pass and hold the whole search
        sources = sorted(plan.sources, key=lambda p: search.spent.get(p, 0.0))
        for i, source in enumerate(sources):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            needs = state_blob.max_bytes(numel) / GOOD_STATE_RATE
            budget = min(remaining, max(remaining / (len(sources) - i), needs))
            started = time.monotonic()
            verdict, got = await _try_source(ctx, stage, numel, source, plan, budget)
            search.spent[source] = search.spent.get(source, 0.0) + time.monotonic() - started
            if verdict == attestation.Verdict.ADOPT:
                return await _adopt(worker, plan, got, search)
            if verdict == attestation.Verdict.STALE:
                kept = held.keep(got, plan.majority)
                log.info(
                    "state from %s is of round %d, past the attested round %d: %s",
                    source[-8:],
                    got.state.round,
                    plan.majority.round,
                    "kept while the records are read again" if kept else "not kept (far ahead)",
                )
                break  # the records may attest it by now: read them before the next source
            if verdict == attestation.Verdict.UNAVAILABLE:
                search.unavailable[source] = got
            else:
                search.rejected[source] = got
        if time.monotonic() >= deadline:
            log.warning(
                "state search for stage %d ran out of time (%.0fs): %s",
                stage,
                search.deadline_s,
                _why(plan, search.replicas, search.rejected),
            )
            return None
        poll_s = HELD_POLL_S if held.near(plan.majority) else STATE_POLL_S
        await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


def _split_past(
    plan: attestation.SourcePlan, replicas: list, checkpoint_round: int, reads: int
) -> bool:
    """Read the records again before resuming the checkpoint? While no strict majority
    attests anything, some replica attests a round newer than the checkpoint's, and the
    reads so far are fewer than SPLIT_READS."""
    if plan.majority is not None or reads >= SPLIT_READS:
        return False
    rounds = (a.round for r in replicas if (a := attestation.attestation_of(r)) is not None)
    return any(round_no > checkpoint_round for round_no in rounds)


async def resync_state(ctx: ServiceContext, worker: StageWorker) -> LoadedState | None:
    """A running replica whose anchor a strict majority of its stage's replicas do not
    hold (it mixed apart from them, node/rounds.py `outvoted`): their attested state,
    adopted as a joiner adopts it, or None. Never the checkpoint or the init."""
    deadline_s = min(RESYNC_DEADLINE_S, ctx.config.state_deadline_s)
    return await _from_replicas(ctx, worker, _Search(deadline_s))


async def load_state(ctx: ServiceContext, worker: StageWorker) -> LoadedState:
    """Load `worker`'s stage: the anchor a strict majority of its live replicas attest,
    unless the own checkpoint is at least as new; else the checkpoint or the init.

    Never trusts one peer: a source is used only if it attests the majority, and what it
    sends is adopted only if it decodes strictly (size bound from the stage's parameter
    count, float32, finite) and its recomputed digest is the majority's. Any failure means
    the next source; the whole search ends at `state_deadline_s` (docs/security.md)."""
    stage, m = worker.index, ctx.manifest
    found = await asyncio.to_thread(
        load_latest_checkpoint,
        ctx.checkpoint_dir(stage),
        run_id=m.run_id,
        stage=stage,
        peer_id=ctx.peer_id,  # never another identity's (nodes sharing a data dir)
    )
    checkpoint_round = _checkpoint_round(found[1]) if found is not None else None
    partners = _partners(found[1]) if found is not None else frozenset()
    away_s = _away_s(found[1]) if found is not None else 0.0
    search = _Search(ctx.config.state_deadline_s)
    adopted = await _from_replicas(ctx, worker, search, checkpoint_round, partners, away_s)
    if adopted is not None:
        return adopted
    plan, rejected, unavailable = search.plan, search.rejected, search.unavailable
    if found is not None:
        info, state = found
        await worker.call(worker.load_state_dict, state)
        log.info(
            "resumed stage %d from checkpoint %s (step %d, outer round %s)%s",
            stage,
            info.path,
            info.step,
            checkpoint_round,
            "" if plan.majority is None else f"; replicas attest round {plan.majority.round}",
        )
        origin = await _origin(worker, "checkpoint", str(info.path))
        origin.update(rejected=rejected, unavailable=unavailable)
        return LoadedState(state.get("outer"), False, origin)
    if plan.replicas:
        log.warning(
            "no attested state for stage %d (%s): starting from the manifest's init",
            stage,
            _why(plan, search.replicas, rejected),
        )
    else:
        log.info("first replica of stage %d: deterministic init from the manifest", stage)
    origin = await _origin(worker, "init", "manifest")
    origin.update(rejected=rejected, unavailable=unavailable)
    return LoadedState(None, False, origin)


async def _try_source(
    ctx: ServiceContext,
    stage: int,
    numel: int,
    source: str,
    plan: attestation.SourcePlan,
    remaining: float,
) -> tuple[str, Any]:
    """(ADOPT or STALE, _Fetched) | (REJECT or UNAVAILABLE, reason); never raises for the
    source's sake."""
    m = ctx.manifest
    try:
        async with asyncio.timeout(remaining):
            _, blob = await state_transfer.fetch_state(
                ctx.host.p2p,
                m.run_id,
                source,
                stage,
                max_bytes=state_blob.max_bytes(numel),
                timeout=min(20.0, remaining),
            )
            got = await asyncio.to_thread(state_blob.decode, blob, numel)
            del blob
            anchor_digest, outer_digest = await asyncio.to_thread(got.digests)
    except (state_transfer.StateTransferError, TimeoutError) as exc:
        reason = f"transfer: {str(exc) or 'deadline'}"[:300]
        log.warning("state from %s failed (%s); trying another replica", source[-8:], reason)
        return attestation.Verdict.UNAVAILABLE, reason
    except state_blob.StateFormatError as exc:
        reason = f"malformed: {exc}"
    except Exception as exc:  # a source's bytes must never crash the joiner
        reason = f"{type(exc).__name__}: {exc}"
    else:
        verdict = attestation.check(plan, got.round, anchor_digest)
        if verdict != attestation.Verdict.REJECT:
            return verdict, _Fetched(got, anchor_digest, outer_digest, source)
        reason = f"digest: round {got.round} {anchor_digest} is not the attested one"
    log.warning("state from %s rejected (%s); trying another replica", source[-8:], reason[:300])
    return attestation.Verdict.REJECT, reason[:300]


async def _adopt(
    worker: StageWorker,
    plan: attestation.SourcePlan,
    fetched: _Fetched,
    search: _Search,
) -> LoadedState:
    """Weights := the attested anchor; momentum only if a strict majority attests it."""
    got, source = fetched.state, fetched.source
    momentum_ok = got.momentum is not None and plan.momentum_attested(fetched.outer_digest)
    momentum = got.momentum if momentum_ok else torch.zeros_like(got.anchor)
    await worker.call(worker.adopt_anchor, got.anchor)
    majority = plan.majority
    assert majority is not None
    log.info(
        "loaded stage %d state from %s: outer round %d, anchor %s attested by %d of %d "
        "replicas, momentum %s%s",
        worker.index,
        source[-8:],
        got.round,
        majority.anchor,
        plan.votes,
        plan.replicas,
        "attested" if momentum_ok else "reset",
        f", {len(search.rejected)} source(s) rejected" if search.rejected else "",
    )
    origin = await _origin(worker, "replica", source)
    origin.update(
        anchor_round=got.round,
        anchor_digest=majority.anchor,
        attested_by=plan.votes,
        replicas=plan.replicas,
        momentum="attested" if momentum_ok else "reset",
        rejected=search.rejected,
        unavailable=search.unavailable,
    )
    outer = {"round": got.round, "anchor": got.anchor, "momentum": momentum}
    return LoadedState(outer, True, origin)


MAX_PARTNERS = 4096
"""Partner ids a checkpoint may name (more are ignored: the file is this node's own, but
bounded all the same)."""


def _partners(state: dict[str, Any]) -> frozenset[str]:
    """The stage's other replicas when the checkpoint was saved (none in one written before
    the field existed)."""
    ids = state.get("replicas")
    if not isinstance(ids, list):
        return frozenset()
    return frozenset(p for p in ids[:MAX_PARTNERS] if isinstance(p, str))


def _away_s(state: dict[str, Any]) -> float:
    """Seconds since the checkpoint was saved, by the time it records (0 when it records
    none, or one not in the past: a clock set back reads as a fresh checkpoint)."""
    saved = state.get("saved_at")
    if isinstance(saved, bool) or not isinstance(saved, (int, float)) or not math.isfinite(saved):
        return 0.0
    return max(0.0, time.time() - saved)


def _checkpoint_round(state: dict[str, Any]) -> int:
    outer = state.get("outer")
    try:
        if not isinstance(outer, dict):
            return 0
        # The round its anchor was made at (attestations name that round, not a counter
        # that a catch-up moved past it).
        return int(outer.get("anchor_round", outer["round"]))
    except (KeyError, TypeError, ValueError):
        return 0


def _why(plan: attestation.SourcePlan, replicas: list, rejected: dict[str, str]) -> str:
    if plan.majority is None:
        return f"no strict majority of {len(replicas)} replica(s) attests one anchor"
    return (
        f"round {plan.majority.round} attested by {plan.votes} of {plan.replicas}; "
        f"{len(rejected)} source(s) rejected"
    )


async def _origin(
    worker: StageWorker, kind: str, source: str, source_checksum: str | None = None
) -> dict[str, Any]:
    return {
        "kind": kind,
        "source": source,
        "param_checksum": await worker.call(worker.parameter_checksum),
        "source_param_checksum": source_checksum,
    }
