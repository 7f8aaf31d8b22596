"""The worker's compute rates, fed to placement as records carry them: on tiny, eight
equal nodes at two per stage stay, and a stage made slower draws a node."""

import pytest
import torch

from agora_node.node.rates import WorkerStats
from agora_node.node.worker import StageWorker
from agora_node.protocol.records import NodeRecord
from agora_node.stages.manifest_files import load_manifest
from agora_node.stages.placement import directory_from_records, should_switch

from .test_worker import pipeline_microbatch

pytestmark = pytest.mark.timeout(180)


def measured_rates(manifest, rounds: int = 3, microbatches: int = 2) -> list[float]:
    """Each stage's compute rate, best of `rounds` windows: other processes on a shared
    machine only ever slow a window down, and unevenly across stages."""
    workers = [StageWorker(manifest, s) for s in range(manifest.num_stages)]
    tokens = torch.randint(0, 256, (manifest.inner.micro_batch, manifest.model.seq_len + 1))
    pipeline_microbatch(workers, "warm-up", tokens, 1.0)  # first calls allocate
    best = [0.0] * len(workers)
    for r in range(rounds):
        for w in workers:
            w.stats = WorkerStats()
        for i in range(microbatches):
            pipeline_microbatch(workers, f"m{r}/{i}", tokens, 1.0)
        best = [max(b, w.stats.compute_rate) for b, w in zip(best, workers, strict=True)]
    return best


def switches(manifest, rates: list[float]) -> dict[str, int]:
    nodes = [(f"s{s}r{k}", s) for s in range(len(rates)) for k in range(2)]
    view = directory_from_records(
        [
            NodeRecord(
                run_id=manifest.run_id, peer_id=p, stage=s, state="active", throughput=rates[s]
            )
            for p, s in nodes
        ]
    )
    decisions = {p: should_switch(view, manifest, p, s) for p, s in nodes}
    return {p: d.stage for p, d in decisions.items() if d.stage is not None}


def test_two_per_stage_of_equal_nodes_stays_and_a_slow_stage_draws_a_node():
    m = load_manifest("tiny")
    rates = measured_rates(m)
    print("compute rates per stage (tokens per compute-second):", [round(r) for r in rates])
    assert all(r > 0 for r in rates)
    assert switches(m, rates) == {}
    slow = list(rates)
    slow[0] /= 3
    assert list(switches(m, slow).values()) == [0]
