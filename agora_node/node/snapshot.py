"""What a node shows about itself: its directory record, the status snapshot, the progress line.

The snapshot's schema is documented in status_server.py (`Snapshot`); the
daemon rebuilds it every second in a background task, and the status page,
/metrics and the control API serve that copy, so no request waits on the network.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agora_node import __version__
from agora_node.node.config import config_dict
from agora_node.node.waits import describe
from agora_node.protocol.records import NodeRecord

if TYPE_CHECKING:
    from agora_node.node.daemon import Node
    from agora_node.node.worker import StageWorker
    from agora_node.stages.device import Compute


def progress_line(node: Node) -> str:
    """One line per interval for the log: what the node does and how it goes."""
    service, stats = node.service, node.stats
    if service is None:
        return f"{node.state.value} | no stage served"
    w = service.worker
    losses = list(stats.losses)[-10:]
    loss = f"{sum(losses) / len(losses):.4f}" if losses else "-"
    return (
        f"stage {w.index} {node.state.value} | step {w.optimizer.steps} | loss {loss} "
        f"| compute {w.stats.compute_rate:.0f} tok/compute-s, util {w.stats.utilization:.0%} "
        + (f"| head {stats.events.completed_tokens_per_s():.0f} tok/s " if w.index == 0 else "")
        + f"| in-flight {w.in_flight} "
        f"| ok {stats.results['ok']} dropped {stats.results['dropped']} "
        f"rejected {stats.results['rejected']} | peers {live_peers(node)} "
        f"| outer round {service.rounds.round}, blocked {service.rounds.outer.totals['seconds_blocked']:.0f}s "
        f"| rss {rss_bytes() / 2**20:.0f} MiB"
        + (f" | time {describe(node.waits.last, w.index)}" if node.waits.last else "")
        + (f" | waiting on {waiting}" if (waiting := node_waiting_on(node)) else "")
    )


def live_peers(node: Node) -> int:
    """Peers in the directory that membership has not declared dead or gone (SWIM says so
    within seconds; a record lives on until it expires)."""
    gone = node.liveness.gone()
    return sum(1 for records in node.view.values() for r in records if r.peer_id not in gone)


def waiting_on(stage: int, num_stages: int, live: Mapping[int, int]) -> str | None:
    """What this stage cannot work without, from how many live replicas its neighbours
    have: "stage 2 (no replica downstream)" and the like; None when both are served.
    A micro-batch needs every stage, so an empty neighbour stalls this one."""
    missing = []
    if stage > 0 and not live.get(stage - 1):
        missing.append(f"stage {stage - 1} (no replica upstream)")
    if stage < num_stages - 1 and not live.get(stage + 1):
        missing.append(f"stage {stage + 1} (no replica downstream)")
    return ", ".join(missing) or None


UPSTREAM_SILENT_S = 90.0
"""A stage after the first that received no request this long, while the stage before it
has live replicas, says so: it may be banned there (a QA run's honest replica, banned by
the only head, showed active and waiting on nothing for 10 minutes)."""
REFUSED_RECENTLY_S = 60.0
"""A refusal by the next stage this recent, with nothing through since, is what the status
says this node waits on."""


def node_waiting_on(node: Node) -> str | None:
    if node.service is None or node.manifest is None:
        return None
    stage, n = node.service.index, node.manifest.num_stages
    live = {s: len(node._peers_of(s)) for s in (stage - 1, stage + 1) if 0 <= s < n}
    refused = node.service.pipeline.refused_by
    if refused is not None and time.monotonic() - refused[0] <= REFUSED_RECENTLY_S:
        # a node refused by every replica downstream showed active, ready and waiting on
        # nothing while its micro-batches were all dropped
        return f"stage {refused[1]} (refuses our micro-batches: {refused[2]!r})"
    silent = time.monotonic() - node.service.pipeline.last_request_at
    if stage > 0 and live.get(stage - 1) and silent > UPSTREAM_SILENT_S:
        return (
            f"stage {stage - 1} (sent this node nothing for {silent:.0f} s: its nodes route "
            "elsewhere, or banned this node; their status says which)"
        )
    return waiting_on(stage, n, live)


def rss_bytes() -> int:
    """This process's resident memory now (Linux /proc; 0 where unavailable)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def node_record(node: Node) -> NodeRecord:
    """What the node announces in the directory (signed by the directory on publish)."""
    service = node.service
    w = service.worker if service else None
    attested = service.rounds.attested if service else None
    return NodeRecord(
        run_id=node.manifest.run_id,
        peer_id=node.peer_id,
        stage=node.stage,
        state=node.state.value,
        throughput=w.stats.throughput if w else 0.0,
        utilization=w.stats.utilization if w else 0.0,
        # a request being answered (waiting for the worker, or for downstream after its
        # forward) or a micro-batch of its own in flight: the last stage has only the first
        # kind, the head only the second; one micro-batch counts once
        queue=max(w.in_flight, service.pipeline.active_requests) if w else 0,
        version=__version__,
        inner_step=w.optimizer.steps if w else 0,
        outer_step=service.rounds.round if service else 0,
        tokens_seen=w.stats.tokens if w else 0,
        # others never wait for a pinned node to move: one that cannot hold every stage
        # (its device, or stage 0 without the run's data) must not be elected to, and it
        # does not move itself (an election each node ran differently moved several)
        pinned=int(node.config.stage != "auto" or node.limited),
        addrs=node.addrs,
        anchor_round=attested.round if attested else 0,
        anchor_digest=attested.anchor if attested else "",
        outer_digest=attested.outer if attested else "",
    )


def record_history(node: Node) -> None:
    """One point per status refresh for the dashboard's plots."""
    if node.stats.losses:
        node.history.add("loss", node.stats.losses[-1])
    if node.service is not None:
        node.history.add("throughput", node.service.worker.stats.throughput)


def flags_by_peer(rounds: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """How often each peer failed ("failed"), sent a part refused for its norm ("outlier")
    or its direction ("direction_outlier"), replayed an earlier round's ("replayed"), a
    result the witness refuted ("mismatched"), or signed two parts for one span
    ("equivocated") in this replica's recent outer rounds."""
    out: dict[str, Counter] = {}
    for r in rounds:
        for field, name in (
            ("failed_peers", "failed"),
            ("outliers", "outlier"),
            ("direction_outliers", "direction_outlier"),
            ("replayed", "replayed"),
            ("mismatched", "mismatched"),
            ("equivocated", "equivocated"),
        ):
            for peer in r.get(field) or ():
                out.setdefault(peer, Counter())[name] += 1
    return {peer: dict(counts) for peer, counts in out.items()}


def peer_views(node: Node, outer: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The directory by stage, each record with what this node knows of the peer:
    SWIM's verdict, rounds mixed together, bytes exchanged, flags, anchor agreement."""
    m = node.manifest
    sent, received = node.metrics.bytes_by_peer()
    swim = {v["peer_id"]: v["status"] for v in (node.liveness.status().get("view") or [])}
    rounds = outer.get("recent_rounds") or []
    together = Counter(p for r in rounds for p in r.get("group") or ())
    flags = flags_by_peer(rounds)
    own = {int(r): d for r, d in (outer.get("anchor_digests") or {}).items()}
    my_stage = node.service.index if node.service else None

    def anchor_agrees(r: NodeRecord) -> bool | None:
        if r.stage != my_stage or r.peer_id == node.peer_id or r.anchor_round not in own:
            return None
        return r.anchor_digest == own[r.anchor_round]

    return [
        {
            "stage": s,
            "peers": [
                {
                    "peer_id": r.peer_id,
                    "state": r.state,
                    "throughput": r.throughput,
                    "utilization": r.utilization,
                    "queue": r.queue,
                    "inner_step": r.inner_step,
                    "outer_step": r.outer_step,
                    "tokens_seen": r.tokens_seen,
                    "pinned": bool(r.pinned),
                    "version": r.version,
                    "updated_at": r.issued_at,
                    "is_self": r.peer_id == node.peer_id,
                    "swim": "self" if r.peer_id == node.peer_id else swim.get(r.peer_id),
                    "rtt_ms": node.liveness.rtt_ms(r.peer_id),
                    "rounds_together": together.get(r.peer_id, 0),
                    "bytes_sent": sent.get(r.peer_id, 0),
                    "bytes_received": received.get(r.peer_id, 0),
                    "flags": flags.get(r.peer_id, {}),
                    "anchor_agrees": anchor_agrees(r),
                }
                for r in node.view.get(s, [])
            ],
        }
        for s in range(m.num_stages if m else 0)
    ]


def build_snapshot(node: Node) -> dict[str, Any]:
    m, service, stats = node.manifest, node.service, node.stats
    w = service.worker if service else None
    p = service.pipeline if service else None
    sent, received = node.metrics.bytes_by_peer()
    outer = service.rounds.status() if service else {}
    return {
        "snapshot_at": time.time(),
        "node": {
            "peer_id": node.peer_id,
            "run_id": m.run_id if m else "",
            "version": __version__,
            "stage": w.index if w else None,
            "num_stages": m.num_stages if m else 0,
            "state": node.state.value,
            "started_at": node.started_at,
            "inner_step": w.optimizer.steps if w else 0,
            "outer_step": service.rounds.round if service else 0,
            "outer": outer,
            "members": node.liveness.status(),
            "stage_changes": list(node.stage_changes),
            "waiting_on": node_waiting_on(node),
            "time_split": node.waits.last,
            "tokens_seen": w.stats.tokens if w else 0,
            "throughput": w.stats.throughput if w else 0.0,
            "compute_rate": w.stats.compute_rate if w else 0.0,
            "utilization": w.stats.utilization if w else 0.0,
            "compute_s": w.stats.compute_s if w else 0.0,
            "rss_bytes": rss_bytes(),
            "device": node.compute.device,
            "precision": node.compute.precision,
            "queue": p.active_requests if p else 0,
            "canaries": dict(p.canaries.counts) if p else {},
            "in_flight": w.in_flight if w else 0,
            "memory": memory_status(node.compute, w),
            "gradient_lag": round(w.lag, 3) if w else 0.0,
            "microbatches": dict(stats.results),
            "hop_failures": node.metrics.hop_failure_counts(),
            "bytes_sent": sent,
            "bytes_received": received,
            "last_losses": list(stats.losses)[-20:],
            "val_loss": stats.val_loss,
            "val_loss_at": stats.val_loss_at,
            "dropped": stats.results["dropped"],
            "stage_choice": node.stage_choice_reason,
            "last_checkpoint": node.last_checkpoint,
            "checkpoint_error": node.checkpoint_error,
            "addrs": node.addrs,
            "reachability": node.dialback.reach.status(),
            "relay": node.dialback.status(sent, received),
            "cell": p.cells.status() if p is not None and p.cells is not None else None,
            "state_origin": service.origin if service else {},
            "states_served": node.states_served,
            "records_rejected": node.records_rejected,
            "unlisted_refused": node.admittance.refused_counts,
            "requests_refused": node.metrics.refused_counts(),
            "runs_seen": node.runs_seen,
            "final_val_loss": service.final_val_loss if service else None,
            "injected_tokens": stats.events.injected_tokens,
            "completed_tokens": stats.events.completed_tokens,
            "completed_tokens_per_s": stats.events.completed_tokens_per_s(),
            "rejected_codes": stats.rejected_codes,
            "suspects": node.suspects.status(),
        },
        "stages": peer_views(node, outer),
        "config": config_dict(node.config),
        "history": node.history.as_dict(),
    }


def memory_status(compute: Compute, worker: StageWorker | None) -> dict:
    """How the stage's graphs fit: the most kept open, backwards that recomputed their
    forward, micro-batches refused for lack of device memory; on CUDA the bytes held."""
    out: dict = compute.memory_status() or {}
    if worker is not None:
        out.update(
            max_graphs=worker.max_graphs,
            recomputed=worker.stats.recomputed,
            out_of_memory=worker.stats.out_of_memory,
        )
    return out
