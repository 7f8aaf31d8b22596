"""The node daemon: join a swarm, serve one stage, leave cleanly.

Lifecycle (DESIGN.md "Joining, stage choice, leaving"):
  1. start the status page, the libp2p host + DHT; read the run's manifest (joining.py);
  2. choose a stage (`--stage auto`: joining.settle_stage);
  3. open a StageService (service.py): load the stage's state, start its worker,
     data plane, outer rounds and, at stage 0, the head loop;
  4. serve: this node's protocol endpoints route to the service of the moment;
     publish a signed record every few seconds; SWIM decides who is alive;
     now and then re-evaluate the stage (placement.should_switch) and move by
     closing the service and opening the next;
  5. on a stop signal (run.py) or `agora-node leave`: withdraw the record (which
     announces leaving), drain the service, checkpoint, exit 0.
A private swarm (`--allow-keys`): everything from unlisted peers is refused and
counted; a node that the swarm's peers refuse stops with their one-line refusal
(comms/admission.py) and exit code 1. SIGUSR1 re-reads the allow list.
Everything slow runs in the stage worker's thread or in the DHT process; the
event loop only routes, so the status page always answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable

from agora_node.comms import admission, reachability
from agora_node.comms.directory import (
    MANIFEST_TTL_S,
    Directory,
    RecentPeers,
    Snapshot,
    list_runs,
    publish_manifest,
)
from agora_node.comms.host import Host, HostConfig, is_relayed
from agora_node.comms.membership.messages import MemberMeta
from agora_node.node import joining
from agora_node.node.config import NodeConfig
from agora_node.node.dialback import DialBack
from agora_node.node.errors import JoinError
from agora_node.node.liveness import Liveness
from agora_node.node.loops import Loops
from agora_node.node.metrics import Metrics
from agora_node.node.peerbook import PeerBook
from agora_node.node.pipeline import PipelineStats
from agora_node.node.private import Admittance
from agora_node.node.service import ServiceContext, StageService, serve_endpoints
from agora_node.node.snapshot import build_snapshot, node_record, progress_line, record_history
from agora_node.node.status_server import History, StatusServer
from agora_node.node.suspects import Suspects
from agora_node.node.telemetry import Telemetry
from agora_node.node.waits import SAMPLE_S, Waits
from agora_node.protocol.identity import Identity
from agora_node.protocol.manifest import Manifest
from agora_node.protocol.records import MAX_ADDRS, NodeState, RecordLimits
from agora_node.stages import placement
from agora_node.stages.data import head_data_missing
from agora_node.stages.device import Compute

log = logging.getLogger(__name__)

RECENT_STAGE_CHANGES = 20
"""Stage choices and switches the status page lists (`Node.stage_changes`)."""
STEP_S = 10.0
"""Deadline of each step of leaving and closing that talks to the network or children."""
CHECKPOINT_S = 300.0
MANIFEST_REFRESH_S = MANIFEST_TTL_S / 4
"""How often a node re-stores the manifest and its run pointer entry (they live
MANIFEST_TTL_S) and re-reads the runs announced; its record and the directory go every
refresh_s. (Until 2026-12-03 all of it went every 3 s: three of the eight DHT writes and
reads of each refresh were the manifest's and the run list's.)"""

MEET_EVERY_S = 10.0
"""How often the DHT is asked to meet the peers SWIM sees but the directory lacks."""
MEET_AT_MOST = 8
"""Such peers pinged per meeting, at most (a crowd of strangers in SWIM costs no more;
the initial peers are pinged whenever the DHT lacks them)."""
MEET_CANDIDATES = 64
"""Unlisted peers SWIM finds alive offered to each meeting, of which those the routing
table lacks are chosen from: most unlisted peers are in the table already."""


async def bounded(what: str, step: Awaitable[object], seconds: float) -> bool:
    """Await one step of leaving; past its deadline or on failure, log it and go on
    (False)."""
    try:
        await asyncio.wait_for(step, seconds)
    except TimeoutError:
        log.warning("leaving: %s did not finish within %.0fs; going on", what, seconds)
    except Exception as exc:
        log.warning("leaving: %s failed (%s); going on", what, exc)
    else:
        return True
    return False


class Node:
    def __init__(self, config: NodeConfig, compute: Compute | None = None) -> None:
        self.config = config
        self.compute = compute or config.compute()
        """Where the stage computes (--device, --precision), resolved on this machine."""
        self.identity = Identity.load_or_create(config.identity_path)
        self.peer_id = self.identity.peer_id
        self.admittance = Admittance(config.allow_keys, self.peer_id)
        """The allow list (private swarms) and what the swarm's peers answered about us."""
        self.waits = Waits()
        """Where the stage's wall time went over the last progress interval."""
        self.refused: str | None = None
        """Set when the swarm's peers refuse this node: the one line it stops with."""
        self.failure: BaseException | None = None
        """What stopped a background loop of this node (it then leaves and exits 1)."""
        self.state = NodeState.JOINING
        self.started_at = time.time()
        self.metrics, self.history = Metrics(), History()
        self.stats = PipelineStats(self.metrics)  # pipelines report to the node's one event sink
        self.suspects = Suspects(me=self.peer_id, ban_s=config.ban_s)
        """Peers this node caught misbehaving; outlives stage services (node/suspects.py)."""
        self.stop_event = asyncio.Event()
        self.attested = asyncio.Event()
        """The stage's outer attestation changed: the refresh loop publishes at once."""
        self.manifest: Manifest | None = None
        self.host: Host | None = None
        self.directory: Directory | None = None
        self.view: Snapshot = {}
        self.recent = RecentPeers(keep_s=max(60.0, 2 * config.record_ttl_s))
        """Peers read at each stage lately (leaving ones too): who may send this node
        micro-batches or ask it for state."""
        self.addrs: list[str] = []
        self.peerbook = PeerBook(config.data_dir)
        """Peers seen, remembered in the data dir: a restart rejoins without the bootstrap."""
        self.dialback = DialBack()
        """Whether peers can dial this node, and answering theirs (node/dialback.py)."""
        self.service: StageService | None = None
        self.liveness = Liveness()
        self.liveness.on_gone.append(self._peer_gone)
        self.stage_choice_reason = ""
        self.stage_changes: deque[dict] = deque(maxlen=RECENT_STAGE_CHANGES)
        """This node's stage choice and later switches: {at, from, to, reason}, oldest first."""
        self.last_checkpoint: str | None = None
        self.checkpoint_error: str | None = None
        """Why the last checkpoint failed (None once one succeeds): shown in the status, told
        to `agora-node leave`, and a leave that could not write one exits 1."""
        self.states_served: list[dict] = []
        self.records_rejected: dict[str, int] = {}
        self.runs_seen: list[dict[str, str]] = []
        """Runs the swarm's run pointer announces (signed, fresh), for the status page."""
        self.stage: int | None = None  # announced while joining, then served
        self.can_hold: list[int] | None = None
        """The stages this node can serve (its device's memory, the run's data; None: all;
        joining.stages_fitting)."""
        self._loops = Loops(self._loop_failed, quiet=lambda: self.state == NodeState.LEAVING)
        self._status: StatusServer | None = None
        self._control = None
        self._snapshot: dict = {}
        self.telemetry = Telemetry(
            config.mqtt_url,
            lambda: build_snapshot(self),
            secret=hashlib.sha256(
                b"agora mqtt client id" + self.identity.to_libp2p_bytes()
            ).digest(),
            login=config.mqtt_login,
        )

    def _peer_gone(self, peer: str) -> None:
        """SWIM declared `peer` dead or gone: stop waiting on it (Pipeline.peer_gone)."""
        if self.service is not None:
            self.service.pipeline.peer_gone(peer)

    # ---- joining --------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        self._status = StatusServer(
            self, self.metrics, cfg.status_host, cfg.status_port, names=cfg.status_names
        )
        await self._status.start()  # first: a port clash fails fast, before touching the swarm
        if cfg.control_socket:  # likewise another daemon's socket (`leave` while joining: stop)
            from agora_node.node.control import ControlServer, NodeControl

            self._control = ControlServer(cfg.control_socket, NodeControl(self))
            await self._control.start()
        self.host = await Host.start(
            HostConfig(
                identity_path=cfg.identity_path,
                initial_peers=self.peerbook.initial_peers(cfg.initial_peers),
                host_maddrs=cfg.host_maddrs,
                announce_maddrs=cfg.announce_maddrs,
            )
        )
        self.addrs = (await self.host.visible_maddrs())[:8]
        self.manifest = m = await joining.discover_manifest(self.host, cfg.manifest, cfg.run)
        log.info("joined run %s (%s): %d stages", m.run_id, m.run.name, m.num_stages)
        self.directory = Directory(
            self.host,
            self.identity,
            m.run_id,
            m.num_stages,
            limits=RecordLimits.for_manifest(m),
            admit=self._admit("record"),
        )
        await joining.check_identity_unused(
            self.directory, self.peer_id, self.started_at, cfg.refresh_s
        )
        stage = await self._choose_stage()
        self.view = await self.directory.fetch()
        self.recent.note(self.view)
        refusal = await self._ask_admission()
        if refusal is not None:  # an unlisted node: say so now, not after waiting for state
            raise JoinError(refusal)
        self._note_stage_change(None, stage, self.stage_choice_reason)
        await serve_endpoints(
            self.host,
            m,
            serving=lambda: self.service,
            offering_state=lambda: self.service if self.state == NodeState.ACTIVE else None,
            served=self.states_served,
            allow=self.admittance.allow,
            me=self.peer_id,
            config=cfg.pipeline,
            on_refuse=self.metrics.count_refused,
            # a peer with a record at its stage, and not one this node banned (a liar
            # re-syncing was sent the state again and again)
            joiner=lambda peer: (
                self.recent.seen(self.stage, peer) and not self.suspects.is_banned(peer)
            ),
        )
        refuse = admission.refuser(self.admittance.allow, self.peer_id, "reachability")
        await self.dialback.serve(self.host, m.run_id, cfg.host_maddrs, refuse)
        await self.dialback.serve_relaying(
            self.host,
            self.identity,
            m.run_id,
            offer=cfg.relay_for_others == "on",
            refuse=admission.refuser(self.admittance.allow, self.peer_id, "relay"),
            on_refuse=self.metrics.count_refused,
        )
        # routes before the state is fetched: it may come from a replica behind NAT
        await self._refresh_relay([a for a in self.addrs if not is_relayed(a)])
        async with self._kept_announced():  # replicas send state only to announced peers
            await self._open_service(stage)
        self._loops.spawn(self._refresh_loop())
        self._loops.spawn(self._reachability_loop())
        self._loops.spawn(self._meet_loop())
        self._loops.spawn(self._status_loop())
        self._loops.spawn(self._sample_waits())
        self._loops.spawn(self._checkpoint_loop())
        self._loops.spawn(self._admission_loop())
        if cfg.stage == "auto" and cfg.rebalance_every_s > 0:
            self._loops.spawn(self._rebalance_loop())
        self.state = NodeState.ACTIVE
        meta = MemberMeta(stage=stage, state=self.state.value)
        await self.liveness.start(
            self.host,
            self.identity,
            m.run_id,
            self._others(),
            meta,
            self._admit("membership"),
            on_refuse=self.metrics.count_refused,
        )
        await self._publish()
        log.info("stage %d active after %.1fs", stage, time.time() - self.started_at)
        self.telemetry.start()

    async def _choose_stage(self) -> int:
        """The stage to serve (`--stage auto`: settled with the other joiners; or the one
        asked for), announced as joining there; JoinError if this device cannot hold it."""
        cfg, m = self.config, self.manifest
        # probes the device's free memory (a CUDA call): off the loop
        self.can_hold = await asyncio.to_thread(joining.stages_fitting, m, self.compute)
        # only stage 0 reads the run's data: a node without it serves (and moves to) others
        # the file system: off the loop
        no_data = await asyncio.to_thread(head_data_missing, m, local=cfg.manifest is not None)
        if no_data is not None and cfg.stage == "auto":
            self.can_hold = joining.without_the_head(m, self.can_hold, no_data)
            log.info("not serving stage 0: %s", no_data)
        if cfg.stage == "auto":
            choice = await joining.settle_stage(
                self.directory,
                m,
                self.peer_id,
                self._announce_joining,
                settle_s=cfg.settle_s,
                rounds=cfg.settle_rounds,
                can_hold=self.can_hold,
            )
            stage, self.stage_choice_reason = choice.stage, choice.reason
        else:
            stage, self.stage_choice_reason = joining.fixed_stage(m, cfg.stage), "fixed by --stage"
            if stage == 0 and no_data is not None:
                raise JoinError(f"--stage 0: {no_data}; provide it, or pass another --stage")
            await self._announce_joining(stage)
        await asyncio.to_thread(joining.check_fits, m, stage, self.compute)
        return stage

    async def _announce_joining(self, stage: int) -> None:
        if self.stage is not None and self.stage != stage:
            await self.directory.withdraw(node_record(self), ttl=self.config.record_ttl_s)
        self.stage = stage
        await self._publish()

    async def _publish(self) -> None:
        await self.directory.publish(node_record(self), ttl=self.config.record_ttl_s)

    # ---- serving --------------------------------------------------------------------------
    async def _open_service(self, stage: int) -> None:
        # warming while it loads (placement counts it where it is); its record attests no
        # anchor yet, so joiners do not count it as a replica (attestation.live_replicas).
        # Announced now: the stage's replicas send their state only to its peers.
        self.state, self.stage = NodeState.WARMING, stage
        await self._publish()
        ctx = ServiceContext(
            manifest=self.manifest,
            config=self.config,
            host=self.host,
            identity=self.identity,
            peers_of=self._peers_of,
            records_of=lambda s: self.view.get(s, []),
            seen_at=self.recent.seen,
            fetch_records=self.directory.fetch,
            rtt_of=self.liveness.rtt,
            answered=self.liveness.answered,
            stats=self.stats,
            history=self.history,
            allow=self.admittance.allow,
            suspects=self.suspects,
            compute=self.compute,
            on_attested=self.attested.set,
        )
        self.service = await StageService.open(ctx, stage, self._loop_failed)

    @property
    def limited(self) -> bool:
        """Whether it cannot serve every stage of the run (then its record says pinned)."""
        return self.can_hold is not None and len(self.can_hold) < self.manifest.num_stages

    def _peers_of(self, stage: int) -> list[str]:
        gone = self.liveness.gone()
        return [
            r.peer_id
            for r in self.view.get(stage, [])
            if r.state == NodeState.ACTIVE and r.peer_id not in gone
        ]

    def _others(self) -> list[str]:
        return [r.peer_id for rs in self.view.values() for r in rs if r.peer_id != self.peer_id]

    def _loop_failed(self, exc: BaseException) -> None:
        log.error("background task failed: %r", exc, exc_info=exc)
        if self.failure is None:
            self.failure = exc  # the exit code says so (run.py): a supervisor restarts it
        self.stop_event.set()  # a node that lost a loop is broken: leave cleanly

    async def _refresh_loop(self) -> None:
        """Refresh our record and re-read the directory every refresh_s, and as soon as the
        stage's attestation changes (a round ended); the manifest and the runs the swarm
        announces every MANIFEST_REFRESH_S."""
        progress_at, manifest_at = time.monotonic(), -math.inf
        while not self.stop_event.is_set():
            self.attested.clear()
            await self._publish()
            if time.monotonic() - manifest_at >= MANIFEST_REFRESH_S:
                manifest_at = time.monotonic()
                await publish_manifest(self.host, self.manifest, self.identity)
                runs = await list_runs(self.host, self.directory.rejected)
                self.runs_seen = [{"run_id": r.run_id, "name": r.name} for r in runs]
            self.view = await self.directory.fetch()
            self.recent.note(self.view)
            if self.service is not None:
                self.service.pipeline.update_view([r for rs in self.view.values() for r in rs])
                self.service.regroup()
            self.liveness.introduce(self._others())
            self.peerbook.update(
                (r for rs in self.view.values() for r in rs),
                self.peer_id,
                answered=self.liveness.answered,
            )
            self._sync_rejections()
            if time.monotonic() - progress_at >= 10:
                progress_at = time.monotonic()
                if self.service is not None:
                    self.waits.take(self.service.rounds.outer.totals["seconds_blocked"])
                log.info(progress_line(self))
            await self._wait_stop(self.config.refresh_s, wake=self.attested)

    def _sync_rejections(self) -> None:
        for reason, count in self.directory.rejected.items():
            self.records_rejected[reason] = self.records_rejected.get(reason, 0) + count
            for _ in range(count):
                self.metrics.count_rejected_record(reason)
        self.directory.rejected.clear()
        for what, count in self.admittance.take_refused().items():
            self.metrics.count_unlisted_refused(what, count)

    # ---- private swarms -------------------------------------------------------------------
    def _admit(self, what: str):  # noqa: ANN202 - None or a peer id predicate
        return self.admittance.admit(what)

    async def _ask_admission(self) -> str | None:
        return await self.admittance.ask(self.host.p2p, self.manifest.run_id, self._others())

    async def _admission_loop(self) -> None:
        """Peers that appear later are asked too; the allow list is re-read when it changes."""
        while not self.stop_event.is_set():
            await self._wait_stop(self.config.refresh_s)
            self.admittance.reload(only_if_changed=True)
            refusal = await self._ask_admission()
            if refusal is not None and not self.stop_event.is_set():
                self.refused = refusal
                self.stop_event.set()

    async def _reachability_loop(self) -> None:
        direct = [a for a in self.addrs if not is_relayed(a)]  # what peers are asked to dial
        while not self.stop_event.is_set():
            peers = set(self._others()) | reachability.peer_ids(self.config.initial_peers)
            await self.dialback.check_if_due(self.host, self.manifest.run_id, sorted(peers), direct)
            await self._refresh_relay(direct)
            await self._wait_stop(self.config.refresh_s)

    async def _meet_loop(self) -> None:
        """Every MEET_EVERY_S the DHT meets the peers SWIM finds alive but the directory
        lacks, and our initial peers, where its routing table lost them: the halves of a
        healed partition merge their DHTs (and so their directories) again (Host.meet)."""
        while not self.stop_event.is_set():
            await self._wait_stop(MEET_EVERY_S)
            if self.stop_event.is_set():
                break
            unlisted = self.liveness.unlisted(set(self._others()), MEET_CANDIDATES)
            # and the initial peers, those given and those remembered
            wanted = dict.fromkeys(unlisted, ()) | self.peerbook.to_meet(self.config.initial_peers)
            lacked, met = await self.host.meet(wanted, MEET_AT_MOST)
            if met:
                log.info(
                    "DHT: met %d of %d peer(s) its routing table lacked (a healed partition?)",
                    met,
                    lacked,
                )

    async def _refresh_relay(self, direct: list[str]) -> None:
        """Relayed addresses to announce, and the routes of our streams through relays."""
        addrs_of = {r.peer_id: r.addrs for records in self.view.values() for r in records}
        self.addrs = (await self.dialback.refresh_relay(self.host, direct, addrs_of))[:MAX_ADDRS]

    @contextlib.asynccontextmanager
    async def _kept_announced(self) -> AsyncIterator[None]:
        """Our record refreshed every refresh_s inside (the refresh loop starts once the
        first stage is open): a joiner's record must stay fresh while it loads its state."""

        async def refresh() -> None:
            while not self.stop_event.is_set():
                await self._wait_stop(self.config.refresh_s)
                if not self.stop_event.is_set():
                    try:
                        await self._publish()
                    except Exception as exc:  # the next refresh tries again; never the open's error
                        log.warning("could not refresh our record while joining: %r", exc)

        task = asyncio.create_task(refresh())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _wait_stop(self, seconds: float, wake: asyncio.Event | None = None) -> None:
        """Up to `seconds`, or until the node stops (or `wake` is set)."""
        events = [self.stop_event] if wake is None else [self.stop_event, wake]
        waits = [asyncio.ensure_future(event.wait()) for event in events]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def _checkpoint_loop(self) -> None:
        while not self.stop_event.is_set():
            await self._wait_stop(self.config.checkpoint_every_s)
            if self.stop_event.is_set():
                return
            try:
                await self.checkpoint()
            except OSError as exc:  # a full disk must not stop training: try again next time
                log.error(
                    "checkpoint failed (%s); serving on, next try in %.0fs",
                    exc,
                    self.config.checkpoint_every_s,
                )

    async def checkpoint(self) -> str | None:
        """Checkpoint the stage served now (none while switching); the path."""
        if self.service is not None:
            try:
                self.last_checkpoint = await self.service.checkpoint()
            except Exception as exc:
                self.checkpoint_error = f"{type(exc).__name__}: {exc}"[:300]
                raise
            self.checkpoint_error = None
        return self.last_checkpoint

    # ---- moving between stages ------------------------------------------------------------
    async def _rebalance_loop(self) -> None:
        """Re-evaluate the stage choice now and then; move only for a clear gain
        (placement.should_switch), after a random delay so peers do not herd."""
        rng = random.Random(self.peer_id)
        every = self.config.rebalance_every_s

        def better(view: Snapshot) -> placement.SwitchDecision | None:
            return joining.better_stage(
                view,
                self.manifest,
                self.peer_id,
                self.stage,
                self.can_hold,
                verified=self.liveness.answered,  # a record alone is one DHT store
            )

        while not self.stop_event.is_set():
            await self._wait_stop(every * (0.5 + rng.random()))
            if self.stop_event.is_set() or self.state != NodeState.ACTIVE or self.limited:
                continue  # a limited node is pinned in every election, its own included
            if better(self.view) is None:
                continue
            await self._wait_stop(placement.switch_delay(self.peer_id, rng, every / 2))
            decision = better(await self.directory.fetch())  # still true after the delay?
            if decision is not None and not self.stop_event.is_set():
                await self.switch_stage(decision.stage, decision.reason)

    async def switch_stage(self, stage: int, reason: str) -> None:
        """Drain, checkpoint and close this stage's service, then open `stage`'s."""
        if not 0 <= stage < self.manifest.num_stages:
            raise ValueError(
                f"stage {stage} does not exist: this run has stages 0..{self.manifest.num_stages - 1}"
            )
        if self.can_hold is not None and stage not in self.can_hold:
            raise ValueError(
                f"this node cannot serve stage {stage} (its device, or the run's data)"
            )
        if self.state != NodeState.ACTIVE or stage == self.service.index:
            return
        log.info("switching from stage %d to stage %d: %s", self.service.index, stage, reason)
        self._note_stage_change(self.service.index, stage, reason)
        self.state = NodeState.WARMING  # routers skip us from the next directory read on
        self.liveness.announce(self.service.index, self.state.value)
        await self.directory.withdraw(node_record(self), ttl=self.config.record_ttl_s)
        await self.service.drain(self.config.drain_timeout_s)
        try:
            await self.checkpoint()
        except OSError as exc:  # a full disk: the new stage needs nothing of this one's
            log.error("checkpoint before the switch failed (%s); switching anyway", exc)
        old, self.service = self.service, None  # requests meanwhile: "not ready", retry elsewhere
        await old.close()
        self.stats.losses.clear()  # the old stage's: shown as the new one's until it trained
        self.stats.val_loss = self.stats.val_loss_at = None
        del old  # the new stage measures free memory: the old one must be gone by then
        await asyncio.to_thread(self.compute.release_memory)
        await self._open_service(stage)
        self.stage_choice_reason = reason
        self.state = NodeState.ACTIVE
        self.liveness.announce(stage, self.state.value)
        await self._publish()
        log.info("now serving stage %d", stage)

    def _note_stage_change(self, old: int | None, new: int, reason: str) -> None:
        self.stage_changes.append({"at": time.time(), "from": old, "to": new, "reason": reason})

    # ---- leaving --------------------------------------------------------------------------
    async def leave(self) -> None:
        """Announce leaving, finish in-flight work, checkpoint; idempotent. Every step has
        a deadline, so leaving completes even when the DHT child or p2pd is already gone
        (a process-group SIGTERM reaches them first)."""
        if self.state == NodeState.LEAVING:
            return
        log.info("leaving: finishing in-flight micro-batches")
        self.state = NodeState.LEAVING
        self.stop_event.set()
        self._loops.cancel()  # bookkeeping loops: nothing in them is worth waiting for
        self._show()  # the status loop is gone: /readyz and the page say "leaving" now
        cfg = self.config
        if self.service is not None:
            withdraw = self.directory.withdraw(node_record(self), ttl=cfg.record_ttl_s)
            await bounded("withdrawing the record", withdraw, STEP_S)
            self.liveness.announce(self.service.index, self.state.value)
            await bounded(
                "draining", self.service.drain(cfg.drain_timeout_s), 2 * cfg.drain_timeout_s
            )
            self._show()
            if not await bounded("the checkpoint", self.checkpoint(), CHECKPOINT_S):
                self.checkpoint_error = self.checkpoint_error or (
                    f"the leave's checkpoint did not finish within {CHECKPOINT_S:.0f} s"
                )
            self._show()  # with the checkpoint just written
        await bounded("the SWIM leave", self.liveness.leave(linger_s=1.0), STEP_S)

    def _show(self) -> None:
        """Rebuild the status snapshot now (while leaving, no loop does it)."""
        try:
            self._snapshot = build_snapshot(self)
        except Exception:  # a half-closed part must not stop the leave
            log.debug("status snapshot while leaving failed", exc_info=True)

    async def close(self) -> None:
        if (
            self.state != NodeState.LEAVING
            and self.directory is not None
            and self.stage is not None
        ):
            # stopped while joining (or refused): its joining record counted for placement
            # until it expired, and the next joiner placed itself around a node not there
            withdraw = self.directory.withdraw(node_record(self), ttl=self.config.record_ttl_s)
            await bounded("withdrawing the record", withdraw, STEP_S)
        await bounded("stopping telemetry", self.telemetry.stop(), STEP_S)
        await bounded("stopping SWIM", self.liveness.stop(), STEP_S)
        if self.service is not None:
            await bounded("closing the stage service", self.service.close(), STEP_S)
        if self._control is not None:
            await bounded("stopping the control API", self._control.stop(), STEP_S)
        if self._status is not None:
            await bounded("stopping the status page", self._status.stop(), STEP_S)
        await bounded("stopping the reachability probe", self.dialback.close(), STEP_S)
        if self.host is not None:
            await bounded("shutting down libp2p and the DHT", self.host.shutdown(), STEP_S)

    # ---- status ---------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """The status page's data (status_server.Snapshot), as the status loop last built it."""
        return self._snapshot or build_snapshot(self)

    async def _sample_waits(self) -> None:
        """Where the stage's time goes (node/waits.py), sampled for the progress line."""
        while not self.stop_event.is_set():
            if self.service is not None:
                worker = self.service.worker
                self.waits.sample(computing=worker.calls_open > 0, awaiting=worker.in_flight > 0)
            await self._wait_stop(SAMPLE_S)

    async def _status_loop(self) -> None:
        while not self.stop_event.is_set():
            self._snapshot = build_snapshot(self)
            record_history(self)
            if self.service is not None:  # what rounds.outvoted judges this replica's anchor by
                self.service.rounds.note_replica_anchors(self.view.get(self.service.index, []))
            await self._wait_stop(1.0)
