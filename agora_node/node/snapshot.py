"""What a node shows about itself: its directory record, the status snapshot, the progress line.

The snapshot's schema is documented in status_server.py (`Snapshot`); the
daemon rebuilds it every second in a background task, and the status page,
/metrics and the control API serve that copy, so no request waits on the network.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agora_node import __version__
from agora_node.protocol.records import NodeRecord

if TYPE_CHECKING:
    from agora_node.node.config import NodeConfig
    from agora_node.node.daemon import Node


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
        f"rejected {stats.results['rejected']} | peers {sum(len(v) for v in node.view.values())} "
        f"| outer round {service.rounds.round}, blocked {service.rounds.outer.totals['seconds_blocked']:.0f}s "
        f"| rss {rss_bytes() / 2**20:.0f} MiB"
    )


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
        queue=w.in_flight if w else 0,
        version=__version__,
        inner_step=w.optimizer.steps if w else 0,
        outer_step=service.rounds.round if service else 0,
        tokens_seen=w.stats.tokens if w else 0,
        pinned=int(node.config.stage != "auto"),
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


def build_snapshot(node: Node) -> dict[str, Any]:
    m, service, stats = node.manifest, node.service, node.stats
    w = service.worker if service else None
    p = service.pipeline if service else None
    sent, received = node.metrics.bytes_by_peer()
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
            "outer": service.rounds.status() if service else {},
            "members": node.liveness.status(),
            "tokens_seen": w.stats.tokens if w else 0,
            "throughput": w.stats.throughput if w else 0.0,
            "compute_rate": w.stats.compute_rate if w else 0.0,
            "utilization": w.stats.utilization if w else 0.0,
            "compute_s": w.stats.compute_s if w else 0.0,
            "rss_bytes": rss_bytes(),
            "queue": p.active_requests if p else 0,
            "in_flight": w.in_flight if w else 0,
            "microbatches": dict(stats.results),
            "bytes_sent": sent,
            "bytes_received": received,
            "last_losses": list(stats.losses)[-20:],
            "val_loss": stats.val_loss,
            "dropped": stats.results["dropped"],
            "stage_choice": node.stage_choice_reason,
            "last_checkpoint": node.last_checkpoint,
            "addrs": node.addrs,
            "state_origin": service.origin if service else {},
            "states_served": node.states_served,
            "records_rejected": node.records_rejected,
            "runs_seen": node.runs_seen,
            "final_val_loss": service.final_val_loss if service else None,
            "injected_tokens": stats.events.injected_tokens,
            "completed_tokens": stats.events.completed_tokens,
            "completed_tokens_per_s": stats.events.completed_tokens_per_s(),
            "rejected_codes": stats.rejected_codes,
            "suspects": node.suspects.status(),
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
        "config": config_dict(node.config),
        "history": node.history.as_dict(),
    }


def config_dict(config: NodeConfig) -> dict[str, Any]:
    out = asdict(config)
    out["manifest"] = config.manifest.run_id if config.manifest else None
    return out
