"""Joining a run: the swarm's manifest, a stage to serve, and the state to start from.

1. `discover_manifest`: read the run's manifest from the DHT (the bootstrap
   publishes it; every node re-publishes it), checked against a local one.
2. `settle_stage`: `--stage auto` announces a choice (placement.choose_stage
   over the directory), then re-reads the directory until two reads in a row
   show the same joiners and give the same answer, so nodes starting together
   agree on one assignment instead of committing on views that miss each other.
   A running `auto` node asks `better_stage` now and then (placement.should_switch).
3. `load_state`: the stage's state from a live replica (streamed, checksummed),
   else the newest local checkpoint when it is newer than what replicas offer,
   else the manifest's deterministic init. It returns what it loaded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agora_node.comms import state_transfer
from agora_node.comms.directory import Directory, RunChoiceError, Snapshot, fetch_manifest
from agora_node.comms.host import Host
from agora_node.node.checkpoint import load_latest_checkpoint
from agora_node.node.errors import JoinError
from agora_node.node.worker import StageWorker
from agora_node.protocol.manifest import Manifest
from agora_node.protocol.records import NodeState
from agora_node.stages import placement

if TYPE_CHECKING:
    from agora_node.node.service import ServiceContext

log = logging.getLogger(__name__)


async def discover_manifest(
    host: Host, wanted: Manifest | None, run_id: str = "", timeout_s: float = 15.0
) -> Manifest:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await fetch_manifest(host, wanted, run_id or None)
        except RunChoiceError as exc:
            raise JoinError(str(exc)) from None  # several runs: waiting will not choose one
        except Exception as exc:
            if time.monotonic() > deadline:
                raise JoinError(str(exc)) from None
            await asyncio.sleep(0.5)  # the DHT may not have replicated the manifest yet


async def settle_stage(
    directory: Directory,
    manifest: Manifest,
    peer_id: str,
    announce: Callable[[int], Awaitable[None]],
    *,
    settle_s: float,
    rounds: int,
) -> placement.StageChoice:
    """Choose a stage for `--stage auto`; `announce(stage)` publishes a joining record."""
    choice = placement.choose_stage(await directory.fetch(), manifest, peer_id)
    await announce(choice.stage)
    previous = None
    for _ in range(rounds):
        await asyncio.sleep(settle_s)
        view = await directory.fetch()
        choice = placement.choose_stage(view, manifest, peer_id)
        joiners = frozenset(
            r.peer_id for rs in view.values() for r in rs if r.state == NodeState.JOINING
        )
        if (choice.stage, joiners) == previous:
            break
        previous = (choice.stage, joiners)
        await announce(choice.stage)
    log.info("chose stage %d: %s", choice.stage, choice.reason)
    return choice


def better_stage(
    view: Snapshot, manifest: Manifest, peer_id: str, stage: int
) -> placement.SwitchDecision | None:
    """A stage this running node should move to for a clear gain, or None.
    Nodes pinned by `--stage N` count for capacity but never move."""
    movable = {r.peer_id for rs in view.values() for r in rs if not r.pinned}
    decision = placement.should_switch(view, manifest, peer_id, stage, movable=movable)
    return decision if decision.stage is not None else None


def fixed_stage(manifest: Manifest, wanted: str) -> int:
    stage = int(wanted)
    if not 0 <= stage < manifest.num_stages:
        raise JoinError(
            f"--stage {stage} does not exist: this run has stages 0..{manifest.num_stages - 1}"
        )
    return stage


@dataclass
class LoadedState:
    outer: dict[str, Any] | None
    """The outer state (anchor, momentum, round) that came with the weights, if any."""
    warming: bool
    """Copied from a replica: carry zero weight in averaging until the first round."""
    origin: dict[str, Any]
    """Where it came from (replica / checkpoint / init), with weight checksums."""


async def load_state(ctx: ServiceContext, worker: StageWorker) -> LoadedState:
    """Load `worker`'s stage from a replica, a checkpoint or the init; what was loaded."""
    stage, m = worker.index, ctx.manifest
    replicas = [
        r
        for r in (await ctx.fetch_records()).get(stage, [])
        if r.peer_id != ctx.peer_id and r.state in (NodeState.ACTIVE, NodeState.WARMING)
    ]
    replicas.sort(key=lambda r: -r.inner_step)
    found = await asyncio.to_thread(
        load_latest_checkpoint,
        ctx.checkpoint_dir(stage),
        run_id=m.run_id,
        stage=stage,
        peer_id=ctx.peer_id,  # never another identity's (nodes sharing a data dir)
    )
    if found is not None and (not replicas or found[0].step >= replicas[0].inner_step):
        info, state = found
        await worker.call(worker.load_state_dict, state)
        log.info("resumed stage %d from checkpoint %s (step %d)", stage, info.path, info.step)
        return LoadedState(
            state.get("outer"), False, await _origin(worker, "checkpoint", str(info.path))
        )
    for record in replicas:
        try:
            header, blob = await state_transfer.fetch_state(
                ctx.host.p2p, m.run_id, record.peer_id, stage
            )
        except state_transfer.StateTransferError as exc:
            log.warning(
                "state from %s failed (%s); trying another replica", record.peer_id[-8:], exc
            )
            continue
        state = await worker.call(StageWorker.decode_state, blob)
        await worker.call(worker.load_state_dict, state)
        log.info(
            "loaded stage %d state from %s (step %s)",
            stage,
            record.peer_id[-8:],
            header.get("inner_step"),
        )
        origin = await _origin(worker, "replica", record.peer_id, header.get("param_checksum"))
        return LoadedState(state.get("outer"), True, origin)
    if replicas:
        log.warning(
            "no replica could send stage %d state: starting from the manifest's init", stage
        )
    else:
        log.info("first replica of stage %d: deterministic init from the manifest", stage)
    return LoadedState(None, False, await _origin(worker, "init", "manifest"))


async def _origin(
    worker: StageWorker, kind: str, source: str, source_checksum: str | None = None
) -> dict[str, Any]:
    return {
        "kind": kind,
        "source": source,
        "param_checksum": await worker.call(worker.parameter_checksum),
        "source_param_checksum": source_checksum,
    }
