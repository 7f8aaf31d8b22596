"""Serving one stage: everything that exists only while a node serves stage k.

A `StageService` is built and torn down as one unit (Petals' ModuleContainer
idea): the stage worker (weights, optimizer, compute thread), its data plane
(`Pipeline`), its outer rounds (`OuterRounds`) and, at stage 0, the head loop
that injects micro-batches and validates. Switching stage is "close this
service, open the next"; leaving is "drain, checkpoint, close".

    service = await StageService.open(ctx, stage, on_failure)   # load state, start loops
    ...                                              # node routes requests to it
    await service.drain(timeout)                     # stop taking work, finish it
    await service.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agora_node.comms import admission, state_transfer, streams
from agora_node.comms.guard import Guard, Limits, Reason
from agora_node.comms.host import Host
from agora_node.comms.pipeline_wire import Code, Status, error_response
from agora_node.node import state_search
from agora_node.node.cell import Cells, standing_replicas
from agora_node.node.checkpoint import save_checkpoint
from agora_node.node.config import NodeConfig, PipelineConfig
from agora_node.node.head import Head, Sampler
from agora_node.node.loops import Loops
from agora_node.node.outer import OuterLoop
from agora_node.node.pipeline import Pipeline, PipelineStats
from agora_node.node.rounds import OuterRounds
from agora_node.node.status_server import History
from agora_node.node.suspects import Suspects
from agora_node.node.worker import MAX_GRAPHS, StageWorker
from agora_node.protocol.allowlist import AllowList
from agora_node.protocol.identity import Identity
from agora_node.protocol.manifest import Manifest
from agora_node.protocol.names import forward_protocol
from agora_node.protocol.records import NodeRecord, NodeState
from agora_node.stages import memory
from agora_node.stages.data import TokenWindows
from agora_node.stages.device import CPU, Compute

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ServiceContext:
    """What a stage service borrows from its node (which outlives it)."""

    manifest: Manifest
    config: NodeConfig
    host: Host
    identity: Identity
    peers_of: Callable[[int], list[str]]
    """Live, active replicas of a stage (directory minus what SWIM declared gone)."""
    records_of: Callable[[int], list[NodeRecord]]
    """The directory's records of a stage, as last read."""
    seen_at: Callable[[int, str], bool]
    """Whether a peer's record was read at a stage lately, leaving ones included
    (directory.RecentPeers.seen): who may send a stage micro-batches."""
    fetch_records: Callable[[], Any]
    """Read the directory now (async): {stage: [NodeRecord]}."""
    rtt_of: Callable[[str], float | None] = lambda _peer: None
    """Measured round trip to a peer (SWIM's probes), None when unknown."""
    answered: Callable[[str], bool] = lambda _peer: True
    """Whether a host runs behind a peer id: it answered this node's SWIM probes (a record
    alone is one DHT store). Tests without SWIM: everyone."""
    stats: PipelineStats
    history: History
    allow: AllowList | None = None
    """A private swarm's allow list (--allow-keys), None in an open swarm."""
    suspects: Suspects = field(default_factory=Suspects)
    """Peers this node banned: routed around, their parts and claims ignored."""
    compute: Compute = CPU
    """The device and precision the stage worker computes with."""
    on_attested: Callable[[], None] = lambda: None
    """The outer state's attestation changed: the node publishes its record now."""

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    def checkpoint_dir(self, stage: int) -> Path:
        return Path(self.config.data_dir) / "checkpoints" / self.manifest.run_id / f"stage-{stage}"


class StageService:
    def __init__(
        self,
        ctx: ServiceContext,
        worker: StageWorker,
        rounds: OuterRounds,
        origin: dict,
        on_failure: Callable[[BaseException], None],
    ) -> None:
        self.ctx, self.worker, self.rounds = ctx, worker, rounds
        self.origin = origin
        """Where this stage's state came from: replica / checkpoint / init, with checksums."""
        self.pipeline = Pipeline(
            ctx.manifest,
            worker,
            ctx.host.p2p,
            ctx.peer_id,
            ctx.peers_of,
            ctx.config.pipeline,
            stats=ctx.stats,
            suspects=ctx.suspects,
            rtt_of=ctx.rtt_of,
            may_send=lambda peer, stage: ctx.seen_at(stage, peer),
        )
        self.final_val_loss: float | None = None
        self._stop = asyncio.Event()
        self._checkpointing = asyncio.Lock()
        self._saving: asyncio.Future | None = None
        """The last checkpoint's write (a thread that a cancelled save leaves running)."""
        self._loops = Loops(on_failure, quiet=self._stop.is_set)
        self._head: asyncio.Task | None = None
        self._rounds: asyncio.Task | None = None

    @property
    def index(self) -> int:
        return self.worker.index

    # ---- building and tearing down ------------------------------------------------------
    @classmethod
    async def open(
        cls, ctx: ServiceContext, stage: int, on_failure: Callable[[BaseException], None]
    ) -> StageService:
        """Load the stage's state (replica, checkpoint or init) and start serving it."""
        compute = ctx.compute
        free = await asyncio.to_thread(compute.free_bytes)  # CUDA calls: never on the loop
        graphs = memory.graph_budget(
            ctx.manifest, stage, free, compute.optimizer_mode, most=MAX_GRAPHS
        )
        if graphs < MAX_GRAPHS:
            log.info(
                "%s holds the graphs of %d micro-batch(es) in flight; more are recomputed at "
                "backward",
                compute.device,
                graphs,
            )
        # building the stage and moving it to its device takes seconds on a GPU: off the
        # loop, which keeps serving SWIM, the directory and the control API meanwhile
        worker = await asyncio.to_thread(
            functools.partial(
                StageWorker,
                ctx.manifest,
                stage,
                max_graphs=graphs,
                compute=compute,
                predict_weights=ctx.manifest.inner.weight_prediction,
            )
        )
        try:
            loaded = await state_search.load_state(ctx, worker)
            outer = await OuterLoop.create(
                ctx.host.dht,
                worker.stage,
                ctx.identity,
                ctx.manifest,
                p2p=ctx.host.p2p,
                stage=stage,
                allow=ctx.allow,
                on_refuse=ctx.stats.events.count_refused,
                suspects=ctx.suspects,
                known=lambda peer: ctx.seen_at(stage, peer),
            )
            if loaded.outer is not None:
                await asyncio.to_thread(outer.load_state_dict, loaded.outer, warming=loaded.warming)
            else:
                await worker.call(outer.reset_to_weights)
        except BaseException:
            worker.close()
            raise

        def replicas() -> list[str]:
            """The stage's replicas in outer rounds: a cell is one (its leader), so a
            leader never waits for its helpers, which take no rounds while they help."""
            return standing_replicas(ctx.peers_of(stage), ctx.manifest.model.cp_degree)

        def replica_rounds() -> list[int]:
            helping = set(ctx.peers_of(stage)) - set(replicas())  # in a cell, not its leader
            # a record no probe of ours answered counts as a replica at round 0: it cannot
            # push anyone forward (two host-less records announcing 2**40 were a stage of
            # two's majority), nor, left out, shrink the vote to one stranger's word
            return [
                r.outer_step if ctx.answered(r.peer_id) else 0
                for r in ctx.records_of(stage)
                if r.peer_id != ctx.peer_id
                and r.state == NodeState.ACTIVE
                and not ctx.suspects.is_banned(r.peer_id)  # a banned peer's round moves nobody
                and r.peer_id not in helping
            ]

        rounds = OuterRounds(
            outer,
            worker,
            inner_steps=ctx.manifest.outer.inner_steps,
            replica_rounds=replica_rounds,
            replica_count=lambda: len(replicas()) or 1,
            replica_ids=replicas,
            overlap=ctx.manifest.outer.overlap,
            resync=lambda: state_search.resync_state(ctx, worker),
            on_attested=ctx.on_attested,
        )
        service = cls(ctx, worker, rounds, loaded.origin, on_failure)
        if Cells.wanted(worker):
            cells = Cells(
                worker, ctx.host.p2p, ctx.peer_id, ctx.manifest.run_id,
                timeout_s=ctx.config.pipeline.hop_timeout_s / 2,
            )  # fmt: skip
            await cells.start()
            service.pipeline.cells = cells
            service.regroup()
        service._rounds = service._loops.spawn(rounds.run(service._stop))
        if worker.stage.is_first:
            service._head = service._loops.spawn(service._head_loop())
        return service

    def regroup(self) -> None:
        """Take this node's place in its stage's cells (node/cell.py), after the directory
        or the membership changed."""
        cells = self.pipeline.cells
        if cells is None:
            return
        was = cells.role
        cells.regroup(self.ctx.peers_of(self.index))
        if was == "helper" and cells.role != "helper":
            self._loops.spawn(self._own_replica_again())

    async def _own_replica_again(self) -> None:
        """A helper whose cell is gone trains on from the weights it last mirrored; its
        outer anchor, untouched while it helped, restarts from them (as after loading
        weights without outer state), and its record attests that anchor. Where a strict
        majority of its stage attests another for that round (3+ replicas, all-replica
        rounds), it takes the stage's attested state instead (rounds: outvoted)."""
        await self.rounds.restart_from_weights()
        log.info("cell: no longer helping; this replica trains on from the cell's last weights")

    async def drain(self, timeout: float) -> None:
        """Stop taking micro-batches, let the head and the ones in flight finish.

        An outer round in progress is abandoned (nothing in it is worth the wait), but an
        outer step already taking place is finished first (seconds): the anchor it sets and
        the weights it writes stay a pair for the leave's checkpoint."""
        self._stop.set()
        if self._rounds is not None:
            self._rounds.cancel()
            self.rounds.abandon()
            await asyncio.gather(self._rounds, return_exceptions=True)
        self.pipeline.accepting = False
        if not await self.pipeline.drain(timeout):
            log.warning("in-flight micro-batches did not finish within %.0fs", timeout)
        if self._head is not None:
            done, _ = await asyncio.wait({self._head}, timeout=timeout)
            if not done:
                log.warning("stage-0 micro-batches did not finish within %.0fs", timeout)

    async def close(self) -> None:
        self._stop.set()
        # no new micro-batch or check starts (a drain cut short by a second signal did not
        # stop them), and the checks under way end before the worker closes
        self.pipeline.accepting = False
        self.pipeline.canaries.cancel()
        await self._loops.cancel_and_wait()
        await self.rounds.close()
        if self.pipeline.cells is not None:
            await self.pipeline.cells.close()
        # the worker may be inside a step: wait off the loop, so the leave's deadline holds
        await asyncio.to_thread(self.worker.close)

    # ---- state ------------------------------------------------------------------------
    async def checkpoint(self) -> str:
        """Save the stage's state as its newest checkpoint; the path.

        Checkpoints are ordered by when they are saved (checkpoint.py), so one save's
        snapshot and write come before the next one's: a periodic save cut by the leave
        (its task cancelled, its writing thread not) still lands before the leave's
        newer snapshot, never after it."""
        async with self._checkpointing:
            if self._saving is not None:  # a cancelled save's thread: let it land first
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._saving)
            async with self.rounds.consistent():
                state = await self.worker.call(self.worker.state_dict)
                state["outer"] = await asyncio.to_thread(self.rounds.state_dict)  # copies the state
            # its partners: whose word alone may replace this state at a restart (state_search):
            # the stage's other peers, cell helpers included, none that this node banned
            suspects = self.ctx.suspects
            partners = [p for p in self.ctx.peers_of(self.index) if not suspects.is_banned(p)]
            state["replicas"] = sorted(set(partners) - {self.ctx.peer_id})
            state["saved_at"] = time.time()
            self._saving = asyncio.ensure_future(
                asyncio.to_thread(
                    save_checkpoint,
                    self.ctx.checkpoint_dir(self.index),
                    run_id=self.ctx.manifest.run_id,
                    stage=self.index,
                    step=self.worker.optimizer.steps,
                    state=state,
                    peer_id=self.ctx.peer_id,
                )
            )
            info = await asyncio.shield(self._saving)
        log.info("checkpoint saved: %s", info.path)
        return str(info.path)

    @contextlib.asynccontextmanager
    async def state_snapshot(self) -> AsyncIterator[tuple[dict, bytes]]:
        """This stage's attested state for a joiner, lent while its transfer lasts: outer
        anchor and momentum (protocol/state_blob.py), serialized once per round, off the
        worker thread (Rounds.lend_blob: a third copy is not made, "busy")."""
        async with self.rounds.lend_blob() as (attested, blob, sha):
            header = {
                "stage": self.index,
                "round": attested.round,
                "anchor_digest": attested.anchor,
                "sha256": sha,
            }
            yield header, blob

    # ---- stage 0 ------------------------------------------------------------------------
    async def _head_loop(self) -> None:
        """Inject micro-batches; validate every eval_every_s (one head does), and once
        more when the token budget (max_tokens) is spent."""
        ctx, cfg = self.ctx, self.ctx.config
        # reading and tokenizing the corpus takes seconds on a large one: off the loop, which
        # keeps serving SWIM, the directory and the status page meanwhile
        train = await asyncio.to_thread(TokenWindows, ctx.manifest, "train")
        val = await asyncio.to_thread(TokenWindows, ctx.manifest, "val")
        # A cell of heads samples as one head, its leader (a helper injects nothing).
        cp = ctx.manifest.model.cp_degree

        # Heads share the epoch among those with a host behind them: host-less records
        # listed as heads shrank this head's share and made each claim cost ~1 s of hashing
        def heads() -> list[str]:
            standing = standing_replicas(ctx.peers_of(0), cp)  # cells as every node sees them
            return [p for p in standing if p == ctx.peer_id or ctx.answered(p)]

        sampler = Sampler(train, ctx.peer_id, heads)
        head = Head(self.pipeline)
        inject = asyncio.create_task(head.run(sampler, self._stop, cfg.max_tokens))
        stopped = asyncio.create_task(self._stop.wait())
        val_ids = val.fixed_subset(cfg.eval_samples)
        try:
            while not self._stop.is_set():
                # wake just after each slot begins: every head asks in every slot, so the
                # slot's evaluator is there to take it (a drifting wait skipped some)
                until_next = cfg.eval_every_s - time.time() % cfg.eval_every_s
                await asyncio.wait(
                    {inject, stopped},
                    timeout=until_next + min(1.0, cfg.eval_every_s / 10),
                    return_when="FIRST_COMPLETED",
                )
                if self._stop.is_set():
                    break
                if inject.done():
                    trained = await inject
                    self.final_val_loss = await head.evaluate(val, val_ids)
                    log.info(
                        "%s; final validation loss %s",
                        "token budget reached" if trained else "stopped short of the budget",
                        self.final_val_loss,
                    )
                    await self._stop.wait()
                    break
                slot = int(time.time() // cfg.eval_every_s)
                candidates = list({*heads(), ctx.peer_id})  # itself, its record stale or not
                if evaluator(candidates, slot) == ctx.peer_id:  # one head evaluates, in turn
                    loss = await head.evaluate(val, val_ids)
                    if loss is not None:
                        ctx.history.add("val_loss", loss)
                        log.info("validation loss %.4f", loss)
        finally:
            stopped.cancel()
            await inject


def evaluator(heads: list[str], slot: int) -> str | None:
    """The head that measures the validation loss in time slot `slot` (eval_every_s long):
    the one whose hash with the slot is least, so each head in turn. Before, the head with
    the least peer id among stage 0's records did, for good: a stranger whose key was made
    for it (or whose record had no host behind it) silenced every honest head's."""
    if not heads:
        return None
    return min(heads, key=lambda p: hashlib.sha256(f"{p}/{slot}".encode()).digest())


def forward_limits(config: PipelineConfig) -> Limits:
    """What the forward protocol allows (comms/guard.py). Honest senders never reach these:
    a node holds `max_queue` micro-batches and answers BUSY beyond, so stream caps only
    replace that answer by a refusal; a stream legitimately lasts as long as this hop's
    retries downstream (`deadline_s`) plus the last try (opening it and waiting for its
    answer: up to twice `hop_timeout_s`). A micro-batch cut there is forgotten by the
    worker after its pending ttl, like any other that never completed."""
    return Limits(
        max_streams=max(64, 4 * config.max_queue),
        max_streams_per_peer=max(8, 2 * config.max_queue),
        rate_per_s=200.0,
        burst=400.0,
        read_deadline_s=10.0,
        drain_deadline_s=30.0,
        deadline_s=config.deadline_s + 2 * config.hop_timeout_s,
    )


def max_request_bytes(manifest: Manifest) -> int:
    """The largest forward request a node of this run accepts (checked before reading it)."""
    m = manifest.model
    per_token = 4 * (m.d_model + 1) + 4  # activation, token id, a document start at most
    return 4096 + m.seq_len * manifest.inner.micro_batch * per_token


async def serve_endpoints(
    host: Host,
    manifest: Manifest,
    *,
    serving: Callable[[], StageService | None],
    offering_state: Callable[[], StageService | None],
    served: list[dict],
    allow: AllowList | None = None,
    me: str = "",
    config: PipelineConfig,
    on_refuse: Callable[[str, str], None] | None = None,
    joiner: Callable[[str], bool] | None = None,
) -> None:
    """Register the run's protocols once per node; each request goes to the service of the
    moment: `serving()` takes micro-batches, `offering_state()` sends its state to joiners
    (None while joining, switching or leaving). `served` logs the states sent (last 20).
    Both protocols sit behind a Guard (comms/guard.py) whose refusals go to `on_refuse`.
    With `allow` (a private swarm), streams of unlisted peers get `me`'s refusal.
    `joiner(peer)`: whether the peer has a record at the stage this node serves; only
    such peers are sent its state (a joiner announces itself there first), so strangers
    cannot hold the few transfer slots a replica has."""

    async def forward(remote: str, data: bytes):  # noqa: ANN202 - async generator
        service = serving()
        if service is None:
            yield error_response(Status.BUSY, Code.NOT_READY, "switching stage")
            return
        async for chunk in service.pipeline.handle(remote, data):
            yield chunk

    @contextlib.asynccontextmanager
    async def state(stage: int) -> AsyncIterator[tuple[dict, bytes]]:
        service = offering_state()
        if service is None or service.index != stage:
            raise state_transfer.StateTransferError(f"this node does not serve stage {stage} now")
        async with service.state_snapshot() as (header, blob):
            served.append(
                {
                    "stage": stage,
                    "round": header["round"],
                    "anchor_digest": header["anchor_digest"],
                    "at": time.time(),
                }
            )
            del served[:-20]
            yield header, blob

    run_id = manifest.run_id
    refuse = admission.refuser(allow, me, "stream")
    await streams.serve(
        host.p2p,
        forward_protocol(run_id),
        forward,
        max_request=max_request_bytes(manifest),
        guard=Guard("forward", forward_limits(config), on_refuse=on_refuse),
        refuse=refuse,
    )
    await state_transfer.serve_state(
        host.p2p,
        run_id,
        state,
        refuse=state_refuser(refuse, joiner, on_refuse),
        on_refuse=on_refuse,
    )
    await admission.serve_admission(host.p2p, run_id, admission.refuser(allow, me, "admission"))


def state_refuser(
    refuse: Callable[[str], str | None] | None,
    joiner: Callable[[str], bool] | None,
    on_refuse: Callable[[str, str], None] | None = None,
) -> Callable[[str], str | None] | None:
    """Who may ask this node for its stage's state: `refuse`'s (a private swarm's allow
    list), and then only peers with a record at its stage (`joiner(peer)`); those
    refusals are counted as ("state", "no_record")."""
    if joiner is None:
        return refuse

    def count(_remote: str) -> None:
        if on_refuse is not None:
            on_refuse("state", Reason.NO_RECORD.value)

    return admission.record_holders_only(refuse, joiner, count)
