"""The node daemon: join a swarm, serve one stage, leave cleanly.

Lifecycle (DESIGN.md "Joining, stage choice, leaving"):
  1. start the libp2p host + DHT, read the run's manifest from the swarm;
  2. choose a stage (`--stage auto`: placement.choose_stage over the directory,
     announced as "joining" and re-checked once so simultaneous joiners spread);
  3. load the stage's state: from a live replica (streamed, checksummed), else
     the newest local checkpoint, else the deterministic init of the manifest;
  4. serve: forward/backward for the stage, state for joiners, stage-0 heads
     inject micro-batches; publish a signed record every few seconds;
  5. on SIGTERM/SIGINT or `agora-node leave`: announce leaving, stop taking
     work, finish in-flight work, checkpoint, withdraw the record, exit 0.
Everything slow runs in the stage worker's thread or in the DHT process; the
event loop only routes, so the status page always answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import time
from dataclasses import asdict
from pathlib import Path

from agora_node import __version__
from agora_node.comms import state_transfer
from agora_node.comms.collective.groups import outer_round_key
from agora_node.comms.directory import Directory, Snapshot, fetch_manifest, publish_manifest
from agora_node.comms.host import Host, HostConfig
from agora_node.comms.membership.messages import MemberMeta, Status
from agora_node.comms.membership.p2p import MembershipService
from agora_node.node.checkpoint import load_latest_checkpoint, save_checkpoint
from agora_node.node.config import NodeConfig
from agora_node.node.errors import JoinError
from agora_node.node.metrics import Metrics
from agora_node.node.outer import OuterLoop
from agora_node.node.pipeline import Pipeline, Sampler
from agora_node.node.status_server import History, StatusServer
from agora_node.node.worker import StageWorker
from agora_node.protocol.identity import Identity
from agora_node.protocol.manifest import Manifest
from agora_node.protocol.records import NodeRecord, NodeState
from agora_node.stages import placement
from agora_node.stages.data import TokenWindows

log = logging.getLogger(__name__)


class Node:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.identity = Identity.load_or_create(config.identity_path)
        self.peer_id = self.identity.peer_id
        self.state = NodeState.JOINING
        self.started_at = time.time()
        self.metrics = Metrics()
        self.history = History()
        self.stop_event = asyncio.Event()
        self.manifest: Manifest | None = None
        self.host: Host | None = None
        self.directory: Directory | None = None
        self.view: Snapshot = {}
        self.worker: StageWorker | None = None
        self.pipeline: Pipeline | None = None
        self.stage_choice_reason = ""
        self._tasks: list[asyncio.Task] = []
        self._status: StatusServer | None = None
        self._control = None
        self._snapshot: dict = {}
        self.last_checkpoint: str | None = None
        self._joining_stage: int | None = None
        self._head_task: asyncio.Task | None = None
        self._head_stop = asyncio.Event()
        self.outer: OuterLoop | None = None
        self._outer_lock = asyncio.Lock()
        self._outer_task: asyncio.Task | None = None
        self.anchor_digests: dict[int, str] = {}
        """Digest of the anchor after each recent outer round: replicas compare equal."""
        self.membership: MembershipService | None = None
        self._introduced: set[str] = set()
        self._loaded_outer: tuple[dict | None, bool] = (None, False)
        self.addrs: list[str] = []
        self.state_origin: dict = {}
        """Where this node's stage state came from: replica / checkpoint / init, with checksums."""
        self.states_served: list[dict] = []
        self.records_rejected: dict[str, int] = {}
        self.final_val_loss: float | None = None

    # ---- joining --------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        self._status = StatusServer(self, self.metrics, host=cfg.status_host, port=cfg.status_port)
        await self._status.start()  # first: a port clash fails fast, before touching the swarm
        self.host = await Host.start(
            HostConfig(
                identity_path=cfg.identity_path,
                initial_peers=cfg.initial_peers,
                host_maddrs=cfg.host_maddrs,
                announce_maddrs=cfg.announce_maddrs,
            )
        )
        self.addrs = (await self.host.visible_maddrs())[:8]
        self.manifest = await self._discover_manifest()
        m = self.manifest
        log.info("joined run %s (%s): %d stages", m.run_id, m.run.name, m.num_stages)
        self.directory = Directory(self.host, self.identity, m.run_id, m.num_stages)
        stage = await self._choose_stage()
        self.worker = StageWorker(m, stage)
        await self._load_state()
        await self._start_outer()
        await self._serve()
        self.state = NodeState.ACTIVE
        await self._start_membership()
        await self._publish()
        log.info("stage %d active after %.1fs", stage, time.time() - self.started_at)

    async def _discover_manifest(self) -> Manifest:
        deadline = time.monotonic() + 15
        while True:
            try:
                return await fetch_manifest(self.host, self.config.manifest)
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise JoinError(str(exc)) from None
                await asyncio.sleep(0.5)  # the DHT may not have replicated the manifest yet

    async def _choose_stage(self) -> int:
        m, wanted = self.manifest, self.config.stage
        if wanted != "auto":
            stage = int(wanted)
            if not 0 <= stage < m.num_stages:
                raise JoinError(
                    f"--stage {stage} does not exist: this run has stages 0..{m.num_stages - 1}"
                )
            self.stage_choice_reason = "fixed by --stage"
            await self._announce_joining(stage)
            return stage
        # Announce a choice, watch the directory, re-choose until two reads in a
        # row show the same joiners and give the same answer: nodes starting
        # together then agree on one greedy assignment (placement.choose_stage)
        # instead of committing on views that still miss each other.
        choice = placement.choose_stage(await self.directory.fetch(), m, self.peer_id)
        await self._announce_joining(choice.stage)
        previous = None
        for _ in range(self.config.settle_rounds):
            await asyncio.sleep(self.config.settle_s)
            view = await self.directory.fetch()
            choice = placement.choose_stage(view, m, self.peer_id)
            joiners = frozenset(
                r.peer_id for rs in view.values() for r in rs if r.state == NodeState.JOINING
            )
            if (choice.stage, joiners) == previous:
                break
            previous = (choice.stage, joiners)
            await self._announce_joining(choice.stage)
        self.stage_choice_reason = choice.reason
        log.info("chose stage %d: %s", choice.stage, choice.reason)
        return choice.stage

    async def _announce_joining(self, stage: int) -> None:
        previous = self._joining_stage
        if previous is not None and previous != stage:
            await self.directory.withdraw(self._record(previous), ttl=self.config.record_ttl_s)
        self._joining_stage = stage
        await self.directory.publish(self._record(stage), ttl=self.config.record_ttl_s)

    def _record(self, stage: int | None = None) -> NodeRecord:
        w = self.worker
        return NodeRecord(
            run_id=self.manifest.run_id,
            peer_id=self.peer_id,
            stage=stage if stage is not None else w.index,
            state=self.state.value,
            throughput=w.stats.throughput if w else 0.0,
            queue=(w.in_flight if w else 0),
            version=__version__,
            inner_step=w.optimizer.steps if w else 0,
            outer_step=self.outer.state.round if self.outer else 0,
            tokens_seen=w.stats.tokens if w else 0,
            pinned=int(self.config.stage != "auto"),
            addrs=self.addrs,
        )

    async def _load_state(self) -> None:
        """State from a live replica if any; else the newest checkpoint; else deterministic init."""
        self.state = NodeState.WARMING
        self._loaded_outer = (None, False)
        stage, m = self.worker.index, self.manifest
        replicas = [
            r
            for r in (await self.directory.fetch()).get(stage, [])
            if r.peer_id != self.peer_id and r.state in (NodeState.ACTIVE, NodeState.WARMING)
        ]
        replicas.sort(key=lambda r: -r.inner_step)
        found = await asyncio.to_thread(
            load_latest_checkpoint, self._checkpoint_dir(), run_id=m.run_id, stage=stage
        )
        if found is not None and (not replicas or found[0].step >= replicas[0].inner_step):
            info, state = found
            await self.worker.call(self.worker.load_state_dict, state)
            self._loaded_outer = (state.get("outer"), False)
            log.info("resumed stage %d from checkpoint %s (step %d)", stage, info.path, info.step)
            await self._note_origin("checkpoint", str(info.path))
            return
        for record in replicas:
            try:
                header, blob = await state_transfer.fetch_state(
                    self.host.p2p, m.run_id, record.peer_id, stage
                )
            except state_transfer.StateTransferError as exc:
                log.warning(
                    "state from %s failed (%s); trying another replica", record.peer_id[-8:], exc
                )
                continue
            state = await self.worker.call(StageWorker.decode_state, blob)
            await self.worker.call(self.worker.load_state_dict, state)
            # A newcomer carries zero weight in averaging until its first outer round.
            self._loaded_outer = (state.get("outer"), True)
            log.info(
                "loaded stage %d state from %s (step %s)",
                stage,
                record.peer_id[-8:],
                header.get("inner_step"),
            )
            await self._note_origin("replica", record.peer_id, header.get("param_checksum"))
            return
        if replicas:
            log.warning(
                "no replica could send stage %d state: starting from the manifest's init", stage
            )
        else:
            log.info("first replica of stage %d: deterministic init from the manifest", stage)
        await self._note_origin("init", "manifest")

    async def _note_origin(
        self, kind: str, source: str, source_checksum: str | None = None
    ) -> None:
        checksum = await self.worker.call(self.worker.parameter_checksum)
        self.state_origin = {
            "kind": kind,
            "source": source,
            "param_checksum": checksum,
            "source_param_checksum": source_checksum,
        }

    def _checkpoint_dir(self) -> Path:
        return (
            Path(self.config.data_dir)
            / "checkpoints"
            / self.manifest.run_id
            / f"stage-{self.worker.index}"
        )

    # ---- serving --------------------------------------------------------------------------
    async def _serve(self) -> None:
        m, cfg = self.manifest, self.config
        self.pipeline = Pipeline(
            m,
            self.worker,
            self.host.p2p,
            self.peer_id,
            self._peers_of,
            cfg.pipeline,
            on_bytes=self._on_bytes,
        )
        await self.pipeline.register()
        await state_transfer.serve_state(self.host.p2p, m.run_id, self._state_snapshot)
        self._spawn(self._refresh_loop())
        self._spawn(self._status_loop())
        self._spawn(self._checkpoint_loop())
        if self.worker.stage.is_first:
            self._head_task = self._spawn(self._head_loop())
        if cfg.stage == "auto" and cfg.rebalance_every_s > 0:
            self._spawn(self._rebalance_loop())
        self._outer_task = self._spawn(self._outer_loop())
        if cfg.control_socket:
            await self._start_control()

    async def _state_snapshot(self, stage: int) -> tuple[dict, bytes]:
        if self.worker is None or stage != self.worker.index or self.state != NodeState.ACTIVE:
            raise state_transfer.StateTransferError(f"this node does not serve stage {stage} now")
        async with self._outer_lock:  # weights and anchor from the same moment
            outer = self.outer.state_dict() if self.outer is not None else None
            blob, checksum = await self.worker.call(self._serialize_state, outer)
        self.states_served.append({"stage": stage, "param_checksum": checksum, "at": time.time()})
        del self.states_served[:-20]
        return {
            "stage": stage,
            "inner_step": self.worker.optimizer.steps,
            "param_checksum": checksum,
        }, blob

    def _serialize_state(self, outer: dict | None) -> tuple[bytes, str]:
        """On the worker thread: bytes and weight checksum of one consistent state."""
        extra = {"outer": outer} if outer is not None else None
        return self.worker.state_bytes(extra), self.worker.parameter_checksum()

    def _peers_of(self, stage: int) -> list[str]:
        gone = self._gone()
        return [
            r.peer_id
            for r in self.view.get(stage, [])
            if r.state == NodeState.ACTIVE and r.peer_id not in gone
        ]

    def _on_bytes(self, peer: str, sent: int, received: int) -> None:
        self.metrics.add_bytes(peer, sent=sent, received=received)

    def _spawn(self, coro) -> asyncio.Task:  # noqa: ANN001
        task = asyncio.create_task(coro)
        task.add_done_callback(self._task_done)
        self._tasks.append(task)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        if (
            not task.cancelled()
            and task.exception() is not None
            and self.state != NodeState.LEAVING
        ):
            log.error("background task failed: %r", task.exception(), exc_info=task.exception())
            self.stop_event.set()  # a node that lost a loop is broken: leave cleanly

    async def _publish(self) -> None:
        await self.directory.publish(self._record(), ttl=self.config.record_ttl_s)

    async def _refresh_loop(self) -> None:
        """Refresh our record and the manifest, and re-read the directory, every refresh_s."""
        progress_at = time.monotonic()
        while not self.stop_event.is_set():
            await self._publish()
            await publish_manifest(self.host, self.manifest)
            self.view = await self.directory.fetch()
            self.pipeline.update_view([r for records in self.view.values() for r in records])
            self._introduce_new_peers()
            self._sync_rejections()
            if time.monotonic() - progress_at >= 10:
                progress_at = time.monotonic()
                log.info(self.progress_line())
            await self._wait_stop(self.config.refresh_s)

    def _sync_rejections(self) -> None:
        for reason, count in self.directory.rejected.items():
            self.records_rejected[reason] = self.records_rejected.get(reason, 0) + count
            for _ in range(count):
                self.metrics.count_rejected_record(reason)
        self.directory.rejected.clear()

    async def _wait_stop(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop_event.wait(), seconds)

    async def _head_loop(self) -> None:
        """Inject micro-batches; validate every eval_every_s (one head does), and once
        more when the token budget (max_tokens) is spent."""
        m = self.manifest
        train, val = TokenWindows(m, "train"), TokenWindows(m, "val")
        sampler = Sampler(train, self.peer_id, lambda: self._peers_of(0))
        inject = asyncio.create_task(
            self.pipeline.run_head(sampler, self._head_stop, self.config.max_tokens)
        )
        stopped = asyncio.create_task(self._head_stop.wait())
        val_ids = val.fixed_subset(self.config.eval_samples)
        try:
            while not self._head_stop.is_set():
                await asyncio.wait(
                    {inject, stopped},
                    timeout=self.config.eval_every_s,
                    return_when="FIRST_COMPLETED",
                )
                if self._head_stop.is_set():
                    break
                if inject.done():
                    await inject
                    self.final_val_loss = await self.pipeline.evaluate(val, val_ids)
                    log.info("token budget reached; final validation loss %s", self.final_val_loss)
                    await self._head_stop.wait()
                    break
                if min(self._peers_of(0) + [self.peer_id]) == self.peer_id:  # one head evaluates
                    loss = await self.pipeline.evaluate(val, val_ids)
                    if loss is not None:
                        self.history.add("val_loss", loss)
                        log.info("validation loss %.4f", loss)
        finally:
            stopped.cancel()
            await inject

    async def _checkpoint_loop(self) -> None:
        while not self.stop_event.is_set():
            await self._wait_stop(self.config.checkpoint_every_s)
            if not self.stop_event.is_set():
                await self.checkpoint()

    async def checkpoint(self) -> str:
        async with self._outer_lock:
            state = await self.worker.call(self.worker.state_dict)
            if self.outer is not None:
                state["outer"] = self.outer.state_dict()
        info = await asyncio.to_thread(
            save_checkpoint,
            self._checkpoint_dir(),
            run_id=self.manifest.run_id,
            stage=self.worker.index,
            step=self.worker.optimizer.steps,
            state=state,
        )
        self.last_checkpoint = str(info.path)
        log.info("checkpoint saved: %s", info.path)
        return self.last_checkpoint

    # ---- membership (SWIM) ------------------------------------------------------------
    async def _start_membership(self) -> None:
        """Who is alive comes from SWIM gossip; the directory only introduces peers."""
        self.membership = MembershipService(
            self.host.p2p,
            self.identity,
            seeds=self._directory_peers(),
            meta=MemberMeta(stage=self.worker.index, state=self.state.value),
            namespace=f"agora/{self.manifest.run_id}/swim",
        )
        await self.membership.start()

    def _directory_peers(self) -> list[str]:
        return [r.peer_id for rs in self.view.values() for r in rs if r.peer_id != self.peer_id]

    def _introduce_new_peers(self) -> None:
        fresh = [p for p in self._directory_peers() if p not in self._introduced]
        if fresh and self.membership is not None:
            self.membership.join(fresh)
            self._introduced.update(fresh)

    def _gone(self) -> set[str]:
        """Peers membership has declared dead or that left (faster than record expiry)."""
        if self.membership is None:
            return set()
        return {
            m.peer_id for m in self.membership.members() if m.status in (Status.DEAD, Status.LEFT)
        }

    def _announce_state(self) -> None:
        if self.membership is not None:
            self.membership.update_meta(stage=self.worker.index, state=self.state.value)

    # ---- outer steps (DiLoCo) --------------------------------------------------------
    async def _start_outer(self) -> None:
        self.outer = await OuterLoop.create(
            self.host.dht,
            self.worker.stage,
            self.identity,
            self.manifest,
            p2p=self.host.p2p,
            stage=self.worker.index,
        )
        outer_state, warming = self._loaded_outer
        if outer_state is not None:
            self.outer.load_state_dict(outer_state, warming=warming)
        else:
            self.outer.reset_to_weights()

    async def _outer_loop(self) -> None:
        """Every H inner steps: mix with this stage's replicas, Nesterov outer step.

        Replicas stay in step without a coordinator: a round ends for every
        replica of the stage as soon as one of them has done its H inner steps
        and opened the round's matchmaking (the others join with what they have;
        contribution weights are their tokens), and a replica whose round number
        fell behind its stage's (seen in the directory) jumps to it.
        Inner steps pause (gradients keep accumulating, forwards go on) only while
        the outer step reads the weights and writes the new anchor into them."""
        every = self.manifest.outer.inner_steps
        while not self.stop_event.is_set():
            self._catch_up_round()
            start_step, start_tokens = self.worker.optimizer.steps, self.worker.stats.trained_tokens
            key = outer_round_key(self.manifest.run_id, self.worker.index, self.outer.state.round)
            while self.worker.optimizer.steps < start_step + every and not self.stop_event.is_set():
                await self._wait_stop(0.5)
                if self.worker.optimizer.steps > start_step and await self._round_opened_elsewhere(
                    key
                ):
                    break
            if self.stop_event.is_set():
                return
            await self.outer.begin_round(expect=len(self._peers_of(self.worker.index)) or 1)
            async with self._outer_lock:
                await self.worker.call(self.worker.hold)
                try:
                    await self.outer.end_round(
                        tokens=self.worker.stats.trained_tokens - start_tokens
                    )
                finally:
                    await self.worker.call(self.worker.release, True)
                state = self.outer.state
                self.anchor_digests[state.round] = await asyncio.to_thread(state.digest)
                for old in sorted(self.anchor_digests)[:-10]:
                    del self.anchor_digests[old]

    def _catch_up_round(self) -> None:
        rounds = [
            r.outer_step
            for r in self.view.get(self.worker.index, [])
            if r.peer_id != self.peer_id and r.state == NodeState.ACTIVE
        ]
        if rounds and max(rounds) > self.outer.state.round:
            log.info(
                "outer round %d -> %d to meet this stage's replicas",
                self.outer.state.round,
                max(rounds),
            )
            self.outer.state.round = max(rounds)

    async def _round_opened_elsewhere(self, key: str) -> bool:
        entries = await self.host.get(key)
        return isinstance(entries, dict) and any(str(k) != self.peer_id for k in entries)

    async def _rebalance_loop(self) -> None:
        """Re-evaluate the stage choice now and then; move only for a clear gain
        (placement.should_switch), after a random delay so peers do not herd."""
        rng = random.Random(self.peer_id)
        every = self.config.rebalance_every_s
        while not self.stop_event.is_set():
            await self._wait_stop(every * (0.5 + rng.random()))
            if self.stop_event.is_set() or self.state != NodeState.ACTIVE:
                continue
            decision = placement.should_switch(
                self.view,
                self.manifest,
                self.peer_id,
                self.worker.index,
                movable=_movable(self.view),
            )
            if decision.stage is None:
                continue
            await self._wait_stop(placement.switch_delay(self.peer_id, rng, every / 2))
            fresh = await self.directory.fetch()  # still true after the delay?
            decision = placement.should_switch(
                fresh, self.manifest, self.peer_id, self.worker.index, movable=_movable(fresh)
            )
            if decision.stage is not None and not self.stop_event.is_set():
                await self.switch_stage(decision.stage, decision.reason)

    async def switch_stage(self, stage: int, reason: str) -> None:
        """Drain and checkpoint this stage, then load and serve `stage`."""
        if not 0 <= stage < self.manifest.num_stages:
            raise ValueError(
                f"stage {stage} does not exist: this run has stages 0..{self.manifest.num_stages - 1}"
            )
        if stage == self.worker.index or self.state != NodeState.ACTIVE:
            return
        log.info("switching from stage %d to stage %d: %s", self.worker.index, stage, reason)
        self.state = NodeState.WARMING  # routers skip us from the next directory read on
        self._announce_state()
        await self.directory.withdraw(self._record(), ttl=self.config.record_ttl_s)
        self.pipeline.accepting = False  # in-flight work gives up once no replica answers
        if self._head_task is not None:
            self._head_stop.set()
            await asyncio.wait({self._head_task}, timeout=self.config.drain_timeout_s)
            self._head_task, self._head_stop = None, asyncio.Event()
        await self.pipeline.drain(self.config.drain_timeout_s)
        await self.checkpoint()
        old = self.worker
        if self._outer_task is not None:
            self._outer_task.cancel()
            await asyncio.gather(self._outer_task, return_exceptions=True)
        if self.outer is not None:
            await self.outer.close()
        self.worker = StageWorker(self.manifest, stage)
        await self._load_state()
        await self._start_outer()
        self._outer_task = self._spawn(self._outer_loop())
        self.pipeline.worker, self.pipeline.accepting = self.worker, True
        old.close()
        self.stage_choice_reason = reason
        if self.worker.stage.is_first:
            self._head_task = self._spawn(self._head_loop())
        self.state = NodeState.ACTIVE
        self._announce_state()
        await self._publish()
        log.info("now serving stage %d", stage)

    # ---- leaving --------------------------------------------------------------------------
    async def leave(self) -> None:
        """Announce leaving, finish in-flight work, checkpoint; idempotent."""
        if self.state == NodeState.LEAVING:
            return
        log.info("leaving: finishing in-flight micro-batches")
        self.state = NodeState.LEAVING
        self.stop_event.set()
        self._head_stop.set()
        for task in self._tasks:  # bookkeeping loops: nothing in them is worth waiting for
            if task is not self._head_task:
                task.cancel()
        if self.directory is not None and self.worker is not None:
            await self.directory.withdraw(self._record(), ttl=self.config.record_ttl_s)
        self._announce_state()
        if self.pipeline is not None and not await self.pipeline.drain(self.config.drain_timeout_s):
            log.warning(
                "in-flight micro-batches did not finish within %.0fs", self.config.drain_timeout_s
            )
        if self._head_task is not None:
            done, _ = await asyncio.wait({self._head_task}, timeout=self.config.drain_timeout_s)
            if not done:
                log.warning(
                    "stage-0 micro-batches did not finish within %.0fs", self.config.drain_timeout_s
                )
                self._head_task.cancel()
        if self.worker is not None:
            await self.checkpoint()
        if self.membership is not None:  # tell the others it is a leave, not a failure
            await self.membership.leave(linger_s=1.0)

    async def close(self) -> None:
        if self.membership is not None:
            await self.membership.stop()
        if self.outer is not None:
            await self.outer.close()
        if self._control is not None:
            await self._control.stop()
        if self._status is not None:
            await self._status.stop()
        if self.worker is not None:
            self.worker.close()
        if self.host is not None:
            await self.host.shutdown()

    async def _start_control(self) -> None:
        from agora_node.node.control import ControlServer

        self._control = ControlServer(self.config.control_socket, _ControlHandlers(self))
        await self._control.start()

    # ---- status ---------------------------------------------------------------------------
    def progress_line(self) -> str:
        w, p = self.worker, self.pipeline
        losses = list(p.stats.losses)[-10:]
        loss = f"{sum(losses) / len(losses):.4f}" if losses else "-"
        return (
            f"stage {w.index} {self.state.value} | step {w.optimizer.steps} | loss {loss} "
            f"| {w.stats.throughput:.0f} tok/s | in-flight {w.in_flight} "
            f"| ok {p.stats.results['ok']} dropped {p.stats.results['dropped']} "
            f"rejected {p.stats.results['rejected']} | peers {sum(len(v) for v in self.view.values())}"
        )

    def snapshot(self) -> dict:
        """The status page's data (status_server.Snapshot), as the status loop last built it."""
        return self._snapshot or build_snapshot(self)

    async def _status_loop(self) -> None:
        while not self.stop_event.is_set():
            self._snapshot = build_snapshot(self)
            self._record_history()
            await self._wait_stop(1.0)

    def _record_history(self) -> None:
        stats = self.pipeline.stats
        if stats.losses:
            self.history.add("loss", stats.losses[-1])
        self.history.add("throughput", self.worker.stats.throughput)


class _ControlHandlers:
    def __init__(self, node: Node) -> None:
        self.node = node

    async def leave(self) -> dict:
        self.node.stop_event.set()
        return {"leaving": True, "peer_id": self.node.peer_id}

    async def checkpoint(self) -> str:
        return await self.node.checkpoint()

    async def switch_stage(self, stage: int) -> dict:
        await self.node.switch_stage(int(stage), "requested through the control API")
        return {"stage": self.node.worker.index, "state": self.node.state.value}

    async def status(self) -> dict:
        return self.node.snapshot()


def build_snapshot(node: Node) -> dict:
    now = time.time()
    m, w, p = node.manifest, node.worker, node.pipeline
    stats = p.stats if p else None
    sent, received = node.metrics.bytes_by_peer()
    return {
        "snapshot_at": now,
        "node": {
            "peer_id": node.peer_id,
            "run_id": m.run_id if m else "",
            "version": __version__,
            "stage": w.index if w else None,
            "num_stages": m.num_stages if m else 0,
            "state": node.state.value,
            "started_at": node.started_at,
            "inner_step": w.optimizer.steps if w else 0,
            "outer_step": node.outer.state.round if node.outer else 0,
            "outer": _outer_status(node),
            "members": _members(node),
            "tokens_seen": w.stats.tokens if w else 0,
            "throughput": w.stats.throughput if w else 0.0,
            "compute_s": w.stats.compute_s if w else 0.0,
            "queue": (p.active_requests if p else 0),
            "in_flight": w.in_flight if w else 0,
            "microbatches": dict(stats.results) if stats else {},
            "bytes_sent": sent,
            "bytes_received": received,
            "last_losses": list(stats.losses)[-20:] if stats else [],
            "val_loss": stats.val_loss if stats else None,
            "dropped": stats.results["dropped"] if stats else 0,
            "stage_choice": node.stage_choice_reason,
            "last_checkpoint": node.last_checkpoint,
            "addrs": node.addrs,
            "state_origin": node.state_origin,
            "states_served": node.states_served,
            "records_rejected": node.records_rejected,
            "final_val_loss": node.final_val_loss,
            "injected_tokens": p.injected_tokens if p else 0,
        },
        "stages": [
            {
                "stage": s,
                "peers": [
                    {
                        "peer_id": r.peer_id,
                        "state": r.state,
                        "throughput": r.throughput,
                        "queue": r.queue,
                        "outer_step": r.outer_step,
                        "version": r.version,
                        "updated_at": r.issued_at,
                        "is_self": r.peer_id == node.peer_id,
                    }
                    for r in node.view.get(s, [])
                ],
            }
            for s in range(m.num_stages if m else 0)
        ],
        "config": _config_dict(node.config),
        "history": node.history.as_dict(),
    }


def _members(node: Node) -> dict:
    if node.membership is None:
        return {}
    return {
        "view": [
            {
                "peer_id": m.peer_id,
                "status": m.status.name.lower(),
                "stage": m.meta.stage,
                "state": m.meta.state,
            }
            for m in node.membership.members()
        ],
        "counters": node.membership.counters,
    }


def _movable(view: Snapshot) -> set[str]:
    """Peers that may change stage (not pinned by --stage N)."""
    return {r.peer_id for rs in view.values() for r in rs if not r.pinned}


def _outer_status(node: Node) -> dict:
    if node.outer is None:
        return {}
    status = node.outer.status()
    status["anchor_digests"] = {str(r): d for r, d in node.anchor_digests.items()}
    return status


def _config_dict(config: NodeConfig) -> dict:
    out = asdict(config)
    out["manifest"] = config.manifest.run_id if config.manifest else None
    return out


async def run_node(config: NodeConfig) -> int:
    """Run a node until it is told to leave; the exit code."""
    node = Node(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, node.stop_event.set)
    try:
        await node.start()
        print(f"agora-node: serving stage {node.worker.index} as {node.peer_id}", flush=True)
        print(
            f"agora-node: status page http://{config.status_host}:{node._status.port}/", flush=True
        )
        await node.stop_event.wait()
        await node.leave()
        return 0
    finally:
        await node.close()
