"""Joining a run: the swarm's manifest, a stage to serve, and the state to start from.

1. `discover_manifest`: read the run's manifest from the DHT (the bootstrap
   publishes it; every node re-publishes it), checked against a local one.
2. `settle_stage`: `--stage auto` announces a choice (placement.choose_stage
   over the directory), then re-reads the directory until two reads in a row
   show the same joiners and give the same answer, so nodes starting together
   agree on one assignment instead of committing on views that miss each other.
   A running `auto` node asks `better_stage` now and then (placement.should_switch).
3. The state to start from: node/state_search.py (`load_state`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from agora_node.comms.directory import Directory, RunChoiceError, Snapshot, fetch_manifest
from agora_node.comms.host import Host
from agora_node.node.errors import JoinError, UsageError
from agora_node.protocol.manifest import Manifest
from agora_node.protocol.records import NodeState
from agora_node.stages import memory, placement
from agora_node.stages.device import Compute
from agora_node.stages.optim import in_backward_refusal

log = logging.getLogger(__name__)


async def discover_manifest(
    host: Host, wanted: Manifest | None, run_id: str = "", timeout_s: float = 15.0
) -> Manifest:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            manifest = await fetch_manifest(host, wanted, run_id or None)
            return manifest
        except RunChoiceError as exc:
            raise JoinError(str(exc)) from None  # several runs: waiting will not choose one
        except Exception as exc:
            if time.monotonic() > deadline:
                raise JoinError(str(exc)) from None
            await asyncio.sleep(0.5)  # the DHT may not have replicated the manifest yet


async def check_identity_unused(
    directory: Directory, peer_id: str, since: float, refresh_s: float
) -> None:
    """Before this node announces itself: JoinError if another daemon serves with its
    identity key (a key copied to a second machine: two peers with one id, each taking the
    other's connections and records; one machine's daemons hold their key file, datadir.py).

    Only the key's holder can sign records of its peer id, so the evidence is a record of
    ours we did not write: issued after this process started (`since`), and issued again a
    refresh later, which a predecessor that died before we started cannot do. Without a
    fresh record of our id (the common case, and a restart more than 2 refresh intervals
    after a crash) there is nothing to wait for; with one, this waits up to 2.5 refresh
    intervals. Two holders that start within a refresh of each other both pass."""
    deadline = time.monotonic() + 2.5 * refresh_s + 2.0
    issued: set[float] = set()
    first = True
    while True:
        view = await directory.fetch()
        stale = time.time() - 2 * refresh_s - 2.0  # a live daemon refreshes more often
        mine = [r for records in view.values() for r in records if r.peer_id == peer_id]
        # none, or a dead predecessor's; once a fresh one was seen, an empty read (a DHT
        # read that timed out, the other switching stages) is no answer: go on to the end
        if first and all(r.issued_at < stale for r in mine):
            return
        if first:  # else a restart right after a crash waited in silence
            log.info(
                "a fresh record of this peer id is in the directory (this node's before a "
                "crash, or another daemon with this key): watching it for up to %.0f s",
                deadline - time.monotonic(),
            )
        first = False
        issued |= {r.issued_at for r in mine if r.issued_at > since}
        if len(issued) >= 2:
            other = max(mine, key=lambda r: r.issued_at)
            where = ", ".join(other.addrs[:2]) or "an unknown address"
            raise JoinError(
                f"another daemon serves stage {other.stage} with this identity key (peer id "
                f"{peer_id}, at {where}): stop that daemon first, or give each machine its "
                "own key (a new --identity-path makes a new peer)"
            )
        if time.monotonic() >= deadline:
            return
        await asyncio.sleep(refresh_s / 2)  # the other daemon's refresh interval, roughly


async def settle_stage(
    directory: Directory,
    manifest: Manifest,
    peer_id: str,
    announce: Callable[[int], Awaitable[None]],
    *,
    settle_s: float,
    rounds: int,
    can_hold: list[int] | None = None,
) -> placement.StageChoice:
    """Choose a stage for `--stage auto` (among `can_hold`, from `stages_fitting`);
    `announce(stage)` publishes a joining record."""
    choice = placement.choose_stage(await directory.fetch(), manifest, peer_id, can_hold=can_hold)
    await announce(choice.stage)
    previous = None
    for _ in range(rounds):
        await asyncio.sleep(settle_s)
        view = await directory.fetch()
        choice = placement.choose_stage(view, manifest, peer_id, can_hold=can_hold)
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
    view: Snapshot,
    manifest: Manifest,
    peer_id: str,
    stage: int,
    can_hold: list[int] | None = None,
    verified: Callable[[str], bool] | None = None,
) -> placement.SwitchDecision | None:
    """A stage this running node should move to for a clear gain (and can hold), or None.
    Nodes pinned by `--stage N` count for capacity but never move; `verified`: the peers
    whose hosts answered this node's probes (placement.should_switch)."""
    movable = {r.peer_id for rs in view.values() for r in rs if not r.pinned}
    decision = placement.should_switch(
        view, manifest, peer_id, stage, movable=movable, verified=verified
    )
    if decision.stage is None or (can_hold is not None and decision.stage not in can_hold):
        return None
    return decision


def without_the_head(manifest: Manifest, can_hold: list[int] | None, no_data: str) -> list[int]:
    """The stages a node lacking the run's data (`no_data` says why) can serve, of those
    its device holds: all but stage 0, the only one that reads the data; JoinError when
    none is left (a one-stage run, or a device that holds stage 0 alone)."""
    held = range(manifest.num_stages) if can_hold is None else can_hold
    left = [s for s in held if s != 0]
    if not left:
        others = "run has no" if manifest.num_stages == 1 else "device holds no"
        raise JoinError(f"this node can serve no stage: {no_data}, and its {others} other stage")
    return left


def fixed_stage(manifest: Manifest, wanted: str) -> int:
    """`--stage N` checked against the run: a UsageError (exit 2, as under --dry-run)
    when the run has no stage N."""
    stage = int(wanted)
    if not 0 <= stage < manifest.num_stages:
        raise UsageError(
            f"--stage {stage} does not exist: this run has stages 0..{manifest.num_stages - 1}"
        )
    return stage


def stages_fitting(manifest: Manifest, compute: Compute) -> list[int] | None:
    """The stages this node's device can hold now (None: all, memory not probed); a
    JoinError, in one line, when it can hold none (or steps its optimizer in backward
    while the run accumulates micro-batches)."""
    why = in_backward_refusal(manifest.inner)
    if compute.optimizer_step == "in-backward" and why is not None:
        raise JoinError(why)
    free = compute.free_bytes()
    fitting = memory.stages_that_fit(manifest, free, compute.optimizer_mode)
    if fitting is not None and not fitting:
        smallest = min(
            range(manifest.num_stages),
            key=lambda s: memory.stage_device_bytes(manifest, s, compute.optimizer_mode),
        )
        raise JoinError(
            "no stage of this run fits: "
            + str(
                memory.does_not_fit(
                    manifest, smallest, compute.device, free, compute.optimizer_mode
                )
            )
        )
    return fitting


def check_fits(manifest: Manifest, stage: int, compute: Compute) -> None:
    """Refuse to serve a stage the device cannot hold (JoinError, one line)."""
    reason = memory.does_not_fit(
        manifest, stage, compute.device, compute.free_bytes(), compute.optimizer_mode
    )
    if reason is not None:
        raise JoinError(reason)
