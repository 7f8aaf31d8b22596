"""Outer steps of one stage replica: gossip-mixed DiLoCo (factored in two mixes).

How one round runs (when rounds happen is decided in rounds.py):

    await outer.begin_round()          # publish an entry, find this round's groups,
                                       # start the anchor mix in the background
    report = await outer.end_round(tokens=n, weights=w)
                                       # blocking pseudo-gradient mix, the Nesterov
                                       # step, weights := new anchor (written via `w`;
                                       # less what stays unsent, `unsent = "weights"`)

The daemon calls begin_round right before end_round, once its replica's H inner
steps are done or another replica opened the round (rounds.py; with `outer.overlap`
the inner steps go on while both mixes run); tests and benchmarks call begin_round,
run H inner steps, then end_round, overlapping the anchor mix.

- `OuterState` (outer_state.py, with `OuterConfig`) holds the anchor (weights at the
  last outer step), the outer momentum and the round counter, as flat float32 vectors.
- The anchor mix averages the anchors (optionally also the outer momenta) of a
  random group as they were at round start (inputs frozen: neither changes during a round),
  overlapped with the inner steps. A group whose states already agree (same
  digest) skips it, so with one group of everyone nothing is sent.
- The pseudo-gradient mix averages delta = anchor - weights over another random
  group, compressed with error feedback.
- Then m := momentum * (mixed m) + mixed delta, anchor := mixed anchor - lr *
  (mixed delta + momentum * m) (torch SGD's Nesterov form), and the weights := anchor. With one
  group of everyone and no compression this is exactly DiLoCo. With `unsent = "weights"`
  the weights := anchor less what this replica's part left out (`_keep_unsent`), which the
  next delta then holds again, instead of the encoder keeping it.

A newcomer (`warming`, e.g. after a state transfer) contributes weight 0 to both
mixes until it has completed one round. Contribution weight is the tokens processed
in the round, capped (by every reducer) at what H inner steps can process.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor, nn

from agora_node.comms.collective import (
    AggregationSpec,
    AllReduce,
    GroupPlan,
    Matchmaker,
    Outcome,
    PartEncoder,
    RoundBook,
    RoundEntry,
    RoundView,
)
from agora_node.comms.collective.entries import MAX_FLAGS
from agora_node.comms.collective.groups import Expect
from agora_node.comms.collective.payload import max_frame_bytes
from agora_node.comms.collective.proofs import Signing
from agora_node.comms.collective.replay import ReplayMemory
from agora_node.node.heap import release_freed_memory
from agora_node.node.loops import to_completion
from agora_node.node.lowrank import LowRank
from agora_node.node.outer_bounds import bound_mixes
from agora_node.node.outer_state import (
    ModuleWeights,
    OuterConfig,
    OuterState,
    Weights,
)
from agora_node.node.round_report import RoundReport, round_report, round_summary
from agora_node.node.suspects import ROUND_EVIDENCE, Reason, Suspects
from agora_node.protocol.allowlist import AllowList
from agora_node.protocol.identity import Identity
from agora_node.protocol.identity import verify as verify_signature
from agora_node.protocol.manifest import Manifest
from agora_node.protocol.names import outer_namespace

log = logging.getLogger(__name__)

RECENT_ROUNDS = 20
"""Rounds whose summary the status page lists (`OuterLoop.recent`)."""


@dataclass
class _Prep:
    view: RoundView
    delta_plan: GroupPlan | None
    anchor: Outcome | None
    factor_plan: GroupPlan | None = None
    """A low-rank round's second mix (same group as the delta plan)."""


def part_signing(identity: Identity, config: OuterConfig) -> Signing | None:
    """Parts are signed, and others' signatures checked, wherever results are verified: a
    failed check then names the member that sent two parts (proofs.py). Every member of a
    group must agree on it, as on `verify_results`."""
    return Signing(identity.sign, verify_signature) if config.verify_results else None


class OuterLoop:
    """The outer step machinery the daemon calls; see the module docstring for the cycle."""

    def __init__(
        self,
        module: nn.Module,
        identity: Identity,
        *,
        run_id: str,
        stage: int,
        config: OuterConfig,
        book: RoundBook,
        transport: Any,
        board: Any,
        admit: Callable[[str], bool] | None = None,
        suspects: Suspects | None = None,
    ) -> None:
        self.state = OuterState(module, lr=config.lr, momentum=config.momentum)
        self.suspects = suspects if suspects is not None else Suspects(me=identity.peer_id)
        """Peers this replica caught (its own, or the node's shared ledger): named in its
        round entries, their parts dropped when it reduces (docs/security.md)."""
        self.identity, self.me = identity, identity.peer_id
        self.signing = part_signing(identity, config)
        """Signs this replica's parts when results are verified (proofs.py)."""
        self.run_id, self.stage, self.config = run_id, stage, config
        self.book, self.transport = book, transport
        book.current = lambda: self.state.round  # peers' messages about it are expected
        self.namespace = outer_namespace(run_id, stage)
        self.matchmaker = Matchmaker(
            board, identity, run_id=run_id, stage=stage, config=config.matchmaking, admit=admit
        )
        self.delta_encoder = PartEncoder(config.delta_format())
        self.low_rank: LowRank | None = None
        """With `config.rank`: the factorization of the pseudo-gradient (lowrank.py); its
        two mixes encode with `delta_encoder`, then in `config.factor_format()`."""
        if config.rank:
            shapes = [tuple(p.shape) for p in self.state.params]
            self.low_rank = LowRank(shapes, config.rank)
            self.delta_encoder = PartEncoder(config.factor_format())
        delta_numel = self.low_rank.first_numel if self.low_rank else self.state.numel
        self.replays = {"delta": ReplayMemory(delta_numel)}
        """Per phase (anchors repeat by nature, so not theirs): samples of other members'
        recent parts, a replayed part is flagged (replay.py)."""
        if self.low_rank is not None:
            self.replays["factor"] = ReplayMemory(self.low_rank.second_numel)
        """Samples of other members' recent delta parts: a replayed delta is flagged."""
        self.anchor_encoder = PartEncoder(config.anchor_format())
        self.last_report: RoundReport | None = None
        self.totals = {
            "rounds": 0, "bytes_sent": 0, "bytes_received": 0, "seconds_blocked": 0.0,
            "bounded": 0,
        }  # fmt: skip
        self.bounded: list[str] = []
        """What the last outer step's own bounds cut (RoundReport.bounded)."""
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_ROUNDS)
        """Summaries of the last rounds (`round_summary`), oldest first."""
        self._prep: asyncio.Task[_Prep] | None = None
        self.committing = False
        """True while a round's outer step and weight write run: not to be cancelled."""
        self.carried: Tensor | None = None
        """With `config.unsent == "weights"`: what the weights hold unsent from earlier
        rounds (the new anchor less them was written), so next round's delta holds it."""
        self._closers: list[Any] = []

    # ---- construction --------------------------------------------------------------------
    @classmethod
    async def create(
        cls,
        dht: Any,
        module: nn.Module,
        identity: Identity,
        manifest: Manifest,
        *,
        p2p: Any = None,
        stage: int | None = None,
        config: OuterConfig | None = None,
        allow: AllowList | None = None,
        on_refuse: Callable[[str, str], None] | None = None,
        suspects: Suspects | None = None,
        known: Callable[[str], bool] | None = None,
    ) -> OuterLoop:
        """Serve the collective in the caller's event loop, on `p2p` (e.g. the node's Host.p2p)
        or else on a replica of the DHT's libp2p daemon. `allow`: a private swarm's allow
        list (round entries and collective RPCs of other peers are refused). `known`: the
        peers with a record at this stage (whole requests through a relay are read only
        from them or from members of registered collectives: CollectiveServicer.serve_streams).
        The state (a host copy of the weights) is built off the loop."""
        from agora_node.comms.collective.groups import DHTBoard
        from agora_node.comms.collective.handlers import Responder
        from agora_node.comms.collective.p2p import LIMITS as COLLECTIVE_LIMITS
        from agora_node.comms.collective.p2p import CollectiveServicer, P2PTransport
        from agora_node.comms.guard import Guard

        stage = getattr(module, "index", 0) if stage is None else stage
        if p2p is None:
            p2p = await dht.replicate_p2p()
        if p2p.peer_id.to_base58() != identity.peer_id:
            raise ValueError("the libp2p identity must be the node's Ed25519 identity")
        config = config or OuterConfig.from_manifest(manifest)
        limit = max_frame_bytes(sum(p.numel() for p in module.parameters()))
        book = RoundBook(identity.peer_id)
        namespace = outer_namespace(manifest.run_id, stage)
        rpc_admit = allow.admit("rpc") if allow is not None else None
        guard = Guard("collective", COLLECTIVE_LIMITS, on_refuse=on_refuse)
        signing = part_signing(identity, config)
        responder = Responder(
            book,
            admit=rpc_admit,
            verify=signing.verify if signing is not None else None,
            sign=signing.sign if signing is not None else None,
            known=known,
        )
        servicer = CollectiveServicer(responder, limit, guard=guard)
        await servicer.add_p2p_handlers(p2p, namespace=namespace)
        await servicer.serve_streams(p2p, namespace, known=known)
        transport = P2PTransport(p2p, namespace=namespace, max_frame_bytes=limit)
        # copies the weights to the host (and a momentum buffer): seconds on a large stage
        loop = await asyncio.to_thread(
            functools.partial(
                cls,
                module,
                identity,
                run_id=manifest.run_id,
                stage=stage,
                config=config,
                book=book,
                transport=transport,
                board=DHTBoard(dht),
                admit=allow.admit("round_entry") if allow is not None else None,
                suspects=suspects,
            )
        )
        loop._closers.append(lambda: servicer.remove_p2p_handlers(p2p, namespace=namespace))
        loop._closers.append(lambda: servicer.stop_streams(p2p, namespace))
        return loop

    async def close(self) -> None:
        if self._prep is not None:
            self._prep.cancel()
        await self.matchmaker.close()
        for closer in self._closers:
            await closer()

    # ---- the round --------------------------------------------------------------------------
    async def begin_round(self, *, expect: Expect = None) -> None:
        """Join round `state.round`; matchmaking and the anchor mix continue in the background.

        expect: the replicas of this stage the caller knows of (itself included), as peer
        ids (or a count); a majority of them opens the round (groups.py) and when all of
        them have joined, the round closes without waiting for the window.
        """
        if self._prep is not None:
            raise RuntimeError(f"round {self.state.round} already begun")
        self._prep = asyncio.create_task(self._prepare_or_alone(self.state.round, expect))

    async def end_round(
        self,
        *,
        tokens: int,
        weights: Weights | None = None,
        blocked_s: Callable[[], float] | None = None,
    ) -> RoundReport:
        """Mix pseudo-gradients, take the outer step, write the new anchor into the weights
        (less what stays unsent, with `unsent = "weights"`).

        weights: where to read and write them (default: the module, directly); the
        daemon passes its frozen stage worker's, or with overlap `overlap.OverlappedWeights`.
        blocked_s: how long the inner loop was held, asked after the write (default: this
        call's wall time, which it spends holding the inner loop)."""
        weights = weights or ModuleWeights(self.state)
        started = time.monotonic()
        if self.config.unsent == "weights":  # a round cancelled after its mix left one
            self.delta_encoder.take_residual()
        if self._prep is None:
            await self.begin_round()
        # a stage-sized subtraction: on a thread, not the event loop
        delta = await asyncio.to_thread(Tensor.sub, self.state.anchor, await weights.read())
        prep_task, self._prep = self._prep, None
        prep = await prep_task
        waited = time.monotonic() - started
        outcomes: list[Outcome] = []
        mixed = delta
        if prep.delta_plan is not None:
            weight = 0.0 if self.state.warming else float(tokens)
            try:
                if self.low_rank is not None:
                    outcomes, mixed = await self._mix_low_rank(prep, delta, weight)
                else:
                    outcomes = [await self._mix(prep.delta_plan, delta, weight, self.delta_encoder)]
                    mixed = outcomes[0].value
            except Exception:  # see _prepare_or_alone: apply the own delta, report it
                log.exception("outer round %d: pseudo-gradient mix failed", self.state.round)
                if self.low_rank is not None:
                    self.low_rank.abandon()
                prep.delta_plan, outcomes, mixed = None, [], delta
        anchor = momentum = None
        if prep.anchor is not None:
            anchor = prep.anchor.value[: self.state.numel]
            if self.config.mix_momentum:
                momentum = prep.anchor.value[self.state.numel :]
        round_no = self.state.round
        self.matchmaker.finish_soon(round_no)  # its mixes are over (groups.py)
        for phase, outcome in zip(("delta", "factor"), outcomes, strict=False):
            # what every member now holds: sending it back is a replay
            self.replays[phase].remember_mixed(round_no, outcome.value)
        self.committing = True  # from here the round lands (rounds.py does not cancel it)
        try:  # a cancel waits: no new anchor without its weights written and its report made
            report = await to_completion(
                self._commit(
                    weights,
                    prep,
                    outcomes,
                    (round_no, delta, mixed, anchor, momentum, tokens),
                    (started, waited),
                    blocked_s,
                )
            )
        finally:
            self.committing = False
        del prep_task, prep, outcomes, delta, mixed, anchor, momentum  # this round's vectors
        await asyncio.to_thread(release_freed_memory)  # glibc keeps them otherwise (heap.py)
        return report

    async def _commit(
        self,
        weights: Weights,
        prep: _Prep,
        outcomes: list[Outcome],
        step: tuple[int, Tensor, Tensor, Tensor | None, Tensor | None, int],
        times: tuple[float, float],
        blocked_s: Callable[[], float] | None,
    ) -> RoundReport:
        """Take the outer step (`step`: the `_outer_step` arguments), write its new anchor
        into the weights and make the round's report."""
        self.bounded = []
        new, applied = await asyncio.to_thread(self._outer_step, *step)
        if self.config.unsent == "weights":
            new = await asyncio.to_thread(self._keep_unsent, new, applied, step[1])
        await weights.write(new)
        round_no, delta = step[0], step[1]
        # the stage-sized norms on a thread; the report on the loop, whose handlers may
        # still count late parts into the outcomes' stats
        norms = await asyncio.to_thread(lambda: (float(delta.norm()), float(applied.norm())))
        report = self._report(round_no, prep, outcomes, norms, times)
        report.bounded = self.bounded
        if blocked_s is not None:
            report.seconds_blocked = blocked_s()
        self._account(report)
        self._flag(report)
        return report

    def _report(
        self,
        round_no: int,
        prep: _Prep,
        outcomes: list[Outcome],
        norms: tuple[float, float],
        times: tuple[float, float],
    ) -> RoundReport:
        """The round's report: `norms` are of the own and the applied pseudo-gradient,
        `times` when the round ended and how long it waited for its matchmaking."""
        n = len(prep.delta_plan.members) if prep.delta_plan else 1
        if self.low_rank is not None:  # two mixes, each of its factors
            numel = self.low_rank.first_numel + self.low_rank.second_numel
        else:
            numel = self.state.numel
        deadline = self.config.deadlines.worst_case(numel, n, self.delta_encoder.fmt)
        return round_report(
            round_no,
            prep.view,
            self.config.group_size,
            (prep.anchor, *outcomes),
            norms,
            (*times, deadline),
        )

    def _outer_step(
        self,
        round_no: int,
        delta: Tensor,
        mixed: Tensor,
        anchor: Tensor | None,
        momentum: Tensor | None,
        tokens: int,
    ) -> tuple[Tensor, Tensor]:
        """The outer step from the mixes' results, taken within this replica's own bounds
        (outer_bounds.py); returns the new anchor and the pseudo-gradient it applied."""
        mixed, anchor, momentum, notes = bound_mixes(
            self.state, delta, mixed, anchor, momentum, self._shortfall(tokens), self.carried
        )
        if notes:
            log.warning(
                "outer round %d: %s (this replica's own bounds)", round_no, "; ".join(notes)
            )
        self.bounded = list(notes)  # for the round's report (_commit)
        return self.state.step(mixed, anchor, momentum, self.config.consensus), mixed

    def _keep_unsent(self, anchor: Tensor, applied: Tensor, delta: Tensor) -> Tensor:
        """The weights for `outer.unsent = "weights"`: the new anchor less what this round's
        part left out (a delta is anchor - weights, so the next one holds it again). Where
        the own delta was applied whole (the mix refused or failed) nothing of it is left
        out. (A span that fell back to the own part applied the part as sent: what it left
        out stays unsent, as in a span that was mixed.)"""
        unsent = self.delta_encoder.take_residual()
        if unsent is None or applied is delta:
            self.carried = None
            return anchor
        self.carried = unsent
        return unsent.neg().add_(anchor)  # not in place: `anchor` is the state's

    def _shortfall(self, tokens: int) -> float:
        """How many times more tokens a full round processes than this replica did (1 when
        the cap is unknown or met): how much longer a full round's delta may be."""
        cap = self.config.aggregation.max_weight
        return cap / tokens if math.isfinite(cap) and 0 < tokens < cap else 1.0

    def _flag(self, report: RoundReport) -> None:
        """Ban what this replica saw itself: parts it refused for their norm or direction,
        parts replaying an earlier round's, results that failed the witness check (owner
        and, when not this replica, the witness)."""
        where = f"outer round {report.round}"
        for peer in report.outliers:
            self.suspects.flag(peer, Reason.NORM_OUTLIER, f"{where}: part refused for its norm")
        for peer in report.direction_outliers:
            evidence = f"{where}: part refused for its direction"
            self.suspects.flag(peer, Reason.DIRECTION_OUTLIER, evidence)
        for peer in report.replayed:
            evidence = f"{where}: part repeats one of an earlier round"
            self.suspects.flag(peer, Reason.REPLAY, evidence)
        for peer in report.mismatched:
            self.suspects.flag(peer, Reason.MISMATCH, f"{where}: its span result failed the check")
        for peer in report.mismatch_witnesses:
            self.suspects.flag(peer, Reason.MISMATCH, f"{where}: witness of a failed span check")
        for peer in report.equivocated:
            evidence = f"{where}: signed one part for a span's owner and another for its witness"
            self.suspects.flag(peer, Reason.EQUIVOCATION, evidence)

    async def opened_elsewhere(self, expect: Expect = None) -> bool:
        """Have enough other replicas opened this round's matchmaking (verified entries) that
        joining now completes a majority of the `expect` replicas (groups.py)? Entries of
        banned peers do not count."""
        return await self.matchmaker.opened_by_others(
            self.state.round, expect, ignore=self.suspects.banned()
        )

    async def _prepare(self, round_no: int, expect: Expect) -> _Prep:
        digest = await asyncio.to_thread(self.state.digest, self.config.mix_momentum)
        view = await self.matchmaker.gather(
            round_no,
            digest=digest,
            warming=self.state.warming,
            expect=expect,
            flags=self.suspects.newest_banned(MAX_FLAGS, ROUND_EVIDENCE),
        )
        g = self.config.group_size
        delta_group, anchor_group = view.group("delta", g), view.group("anchor", g)
        if len(delta_group) < 2 and len(anchor_group) < 2:  # mixes with nobody this round
            self.matchmaker.finish_soon(round_no)  # now: a joiner reading it would wait on it
        low_rank = self.low_rank
        delta_numel = low_rank.first_numel if low_rank else self.state.numel
        delta_plan = self._plan(round_no, "delta", delta_group, delta_numel)
        factor_plan = None
        if delta_plan is not None:
            self.book.register(delta_plan)  # accept parts from members that finish first
            if low_rank is not None:
                factor_plan = self._plan(round_no, "factor", delta_group, low_rank.second_numel)
                self.book.register(factor_plan)
        anchor_plan = None
        digests = {(view.entry(p).digest if view.entry(p) else p) for p in anchor_group}
        if len(digests) > 1:  # a group that already agrees has nothing to mix
            numel = self.state.numel * (2 if self.config.mix_momentum else 1)
            anchor_plan = self._plan(round_no, "anchor", anchor_group, numel)
        anchor = None
        if anchor_plan is not None:
            weight = 0.0 if self.state.warming else 1.0
            mixed = await asyncio.to_thread(self.state.mixed_state, self.config.mix_momentum)
            anchor = await self._mix(anchor_plan, mixed, weight, self.anchor_encoder)
        return _Prep(view, delta_plan, anchor, factor_plan)

    async def _prepare_or_alone(self, round_no: int, expect: Expect) -> _Prep:
        try:
            return await self._prepare(round_no, expect)
        except Exception:  # a bug or a broken DHT must cost one round's mixing, not the node
            log.exception(
                "outer round %d: matchmaking or anchor mix failed, mixing alone", round_no
            )
            me = RoundEntry(
                peer_id=self.me,
                run_id=self.run_id,
                stage=self.stage,
                round=round_no,
                joined_at=time.time(),
            )
            return _Prep(RoundView(self.run_id, self.stage, round_no, self.me, (me,)), None, None)

    def _plan(
        self, round_no: int, phase: str, group: tuple[str, ...], numel: int
    ) -> GroupPlan | None:
        if len(group) < 2:
            return None
        return GroupPlan(
            round=round_no,
            phase=phase,
            members=group,
            numel=numel,
            block=self.config.block,
            namespace=self.namespace,
        )

    async def _mix(
        self, plan: GroupPlan, flat: Tensor, weight: float, encoder: PartEncoder
    ) -> Outcome:
        fmt = encoder.fmt
        run = AllReduce(
            self.book.register(plan),
            self.transport,
            fmt=fmt,
            encoder=encoder,
            aggregation=self._aggregation(plan.phase),
            deadlines=self.config.deadlines,
            verify=self.config.verify_results,
            ignore=self.suspects.banned(),
            replays=self.replays.get(plan.phase),
            signing=self.signing,
        )
        return await run.run(flat, weight)

    async def _mix_low_rank(
        self, prep: _Prep, delta: Tensor, weight: float
    ) -> tuple[list[Outcome], Tensor]:
        """A low-rank round's two mixes (lowrank.py): the outcomes and the mixed delta."""
        low_rank, enc = self.low_rank, self.delta_encoder
        assert low_rank is not None and prep.delta_plan is not None
        assert prep.factor_plan is not None
        seed = f"{self.namespace}/{self.state.round}/factors".encode()
        first = await asyncio.to_thread(low_rank.first, delta, seed)
        p = await self._mix(prep.delta_plan, first, weight, enc)
        second = await asyncio.to_thread(low_rank.second, p.value)
        q = await self._mix(prep.factor_plan, second, weight, enc)
        return [p, q], await asyncio.to_thread(low_rank.finish, q.value)

    def _aggregation(self, phase: str) -> AggregationSpec:
        """The delta mix (and a low-rank round's factor mix) refuses norms above an absolute
        bound and directions away from the others' too; anchors never (a mix that refused
        every anchor would have nothing to start from, and weights all point the same way)."""
        spec = self.config.aggregation
        return spec if phase != "anchor" else replace(spec, max_norm=math.inf, min_cosine=-1.0)

    # ---- state transfer and status ----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def load_state_dict(self, state: dict[str, Any], *, warming: bool = True) -> None:
        if self._prep is not None:
            raise RuntimeError("cannot load outer state in the middle of a round")
        self.state.load_state_dict(state, warming=warming)
        self._forget_residuals()  # they belonged to the old trajectory

    def reset_to_weights(self) -> None:
        """Anchor := the module's current weights, momentum := 0 (weights loaded without outer state)."""
        if self._prep is not None:
            raise RuntimeError("cannot reset outer state in the middle of a round")
        self.state.anchor = self.state.weights()
        self.state.restart_momentum()
        self._forget_residuals()

    def _forget_residuals(self) -> None:
        self.delta_encoder.reset()
        # The weights were replaced (a state transfer): they carry nothing unsent. Weights
        # reloaded from the node's own checkpoint may: until the next round ends, the
        # bounds then measure the whole delta (looser), as with error feedback.
        self.carried = None
        if self.low_rank is not None:
            self.low_rank.reset()

    def status(self) -> dict[str, Any]:
        last = self.last_report
        return {
            "outer_round": self.state.round,
            "warming": self.state.warming,
            "in_round": self._prep is not None,
            "group": list(last.delta_group) if last else [],
            "last_round": None
            if last is None
            else last.__dict__ | {"rejected": dict(last.rejected)},
            "recent_rounds": list(self.recent),
            **self.totals,
        }

    def _account(self, report: RoundReport) -> None:
        self.last_report = report
        self.recent.append(round_summary(report))
        self.totals["rounds"] += 1
        self.totals["bytes_sent"] += report.bytes_sent
        self.totals["bytes_received"] += report.bytes_received
        self.totals["seconds_blocked"] += report.seconds_blocked
        self.totals["bounded"] += bool(report.bounded)
        log.info(
            "outer round %d | group %d/%d | anchor %s | sent %.1f MB | blocked %.2fs%s",
            report.round,
            len(report.delta_group),
            report.participants,
            "mixed" if report.anchor_mixed else "in sync",
            report.bytes_sent / 1e6,
            report.seconds_blocked,
            "" if report.consistent else " | INCONSISTENT",
        )
