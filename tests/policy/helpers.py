"""Builders of directory snapshots for the policy tests."""

from __future__ import annotations

from agora_node.protocol.records import NodeRecord, NodeState
from agora_node.stages.placement import Directory, directory_from_records

RUN = "run0"


def record(
    peer: str,
    stage: int,
    state: NodeState = NodeState.ACTIVE,
    throughput: float = 0.0,
    queue: int = 0,
) -> NodeRecord:
    return NodeRecord(
        run_id=RUN, peer_id=peer, stage=stage, state=state.value, throughput=throughput, queue=queue
    )


def directory(*records: NodeRecord) -> Directory:
    return directory_from_records(list(records))


def counts(assignment: dict[str, int], n_stages: int) -> list[int]:
    out = [0] * n_stages
    for stage in assignment.values():
        out[stage] += 1
    return out
