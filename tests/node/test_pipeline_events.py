"""The pipeline reports its events to one sink: what the status JSON reads and what
/metrics exports are the same counts."""

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agora_node.node.head import Head, Sampler
from agora_node.node.metrics import Metrics
from agora_node.node.pipeline import Pipeline, PipelineConfig, PipelineStats
from agora_node.node.worker import StageWorker
from agora_node.protocol.manifest import parse_manifest
from agora_node.stages.data import TokenWindows
from agora_node.stages.manifest_files import load_manifest

pytestmark = pytest.mark.timeout(120)


def one_stage_manifest():
    """tiny cut to two layers in one stage: a head that is also the last stage, no network."""
    text = load_manifest("tiny").to_toml().replace("n_layers = 8", "n_layers = 2")
    return parse_manifest(text.replace("count = 4", "count = 1"))


def values(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }


def test_a_head_reports_outcomes_latency_and_tokens_to_its_sink():
    m = one_stage_manifest()
    events = Metrics()
    worker = StageWorker(m, 0)
    stats = PipelineStats(events)
    pipeline = Pipeline(m, worker, None, "me", lambda s: [], PipelineConfig(), stats=stats)
    sampler = Sampler(TokenWindows(m, "train"), "me", lambda: [])
    per_mb = m.inner.micro_batch * m.model.seq_len
    try:
        head = Head(pipeline)
        asyncio.run(head.run(sampler, asyncio.Event(), max_tokens=3 * per_mb))
    finally:
        worker.close()
    assert pipeline.stats.results == {"ok": 3, "dropped": 0, "rejected": 0}
    assert head.injected_tokens == events.completed_tokens == 3 * per_mb
    assert events.completed_tokens_per_s() > 0
    v = values(events)
    assert v[("agora_microbatches_total", (("result", "ok"),))] == 3
    assert v[("agora_microbatch_latency_seconds_count", ())] == 3
    assert v[("agora_injected_tokens_total", ())] == v[("agora_completed_tokens_total", ())]
    assert v[("agora_completed_tokens_per_s", ())] > 0


def run_head_failing(fail, budget_mbs: int, in_flight: int = 0):
    """A one-stage head on a budget of `budget_mbs` micro-batches whose n-th micro-batch
    (from 1) raises NonFiniteError where `fail(n)`; returns (head, worker stats, results)."""
    from agora_node.compression import NonFiniteError

    m = one_stage_manifest()
    worker = StageWorker(m, 0)
    pipeline = Pipeline(
        m, worker, None, "me", lambda s: [], PipelineConfig(max_in_flight=in_flight)
    )
    sampler = Sampler(TokenWindows(m, "train"), "me", lambda: [])
    per_mb = m.inner.micro_batch * m.model.seq_len
    last, calls = pipeline.compute.last, []

    async def failing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        if fail(len(calls)):
            raise NonFiniteError("a neighbour's extreme input (simulated)")
        return await last(*args, **kwargs)

    pipeline.compute.last = failing
    head = Head(pipeline)
    try:
        asyncio.run(
            asyncio.wait_for(
                head.run(sampler, asyncio.Event(), max_tokens=budget_mbs * per_mb), timeout=30
            )
        )
    finally:
        worker.close()
    return head, worker.stats, pipeline.stats.results, per_mb


def test_a_dropped_microbatch_does_not_count_toward_the_token_budget():
    """A budget of 2 micro-batches with the first failing: 3 injected, 2 trained."""
    head, stats, results, per_mb = run_head_failing(lambda n: n == 1, 2)
    assert results == {"ok": 2, "dropped": 1, "rejected": 0}
    assert head.injected_tokens == 3 * per_mb
    assert head.trained_tokens == stats.trained_tokens == 2 * per_mb


def test_a_microbatch_failing_at_the_end_of_the_budget_is_injected_again():
    """Both of the budget's micro-batches in flight at once, the second failing after the
    loop had counted the budget as met: a third is injected."""
    head, stats, results, per_mb = run_head_failing(lambda n: n == 2, 2, in_flight=2)
    assert results == {"ok": 2, "dropped": 1, "rejected": 0}
    assert stats.trained_tokens == 2 * per_mb


def test_a_head_whose_every_microbatch_fails_stops_once_more_than_its_budget_failed(caplog):
    head, stats, results, per_mb = run_head_failing(lambda n: True, 2)
    assert results["ok"] == 0 and 2 < results["dropped"] <= 2 + 8  # at most one slot each
    assert head.dropped_tokens > 2 * per_mb and stats.trained_tokens == 0
    assert "stopping short of the token budget" in caplog.text


def test_bytes_are_counted_once():
    m = one_stage_manifest()
    events = Metrics()
    worker = StageWorker(m, 0)
    try:
        stats = PipelineStats(events)
        pipeline = Pipeline(m, worker, None, "me", lambda s: [], PipelineConfig(), stats=stats)
        pipeline._count_bytes("peer", sent=10, received=3)
        assert events.bytes_by_peer() == ({"peer": 10}, {"peer": 3})
        pipeline._count_bytes("peer", sent=5)
        assert events.bytes_by_peer() == ({"peer": 15}, {"peer": 3})
    finally:
        worker.close()


def test_a_head_that_helps_a_cell_injects_nothing_and_counts_what_it_helped(monkeypatch):
    """Pure logic of the head's loop: `cells` is a stand-in with the two fields it reads."""
    from types import SimpleNamespace

    import agora_node.node.head as head_module

    monkeypatch.setattr(head_module, "HELPER_RECHECK_S", 0.01)
    m = one_stage_manifest()
    worker = StageWorker(m, 0)
    pipeline = Pipeline(m, worker, None, "me", lambda s: [], PipelineConfig())
    sampler = Sampler(TokenWindows(m, "train"), "me", lambda: [])
    per_mb = m.inner.micro_batch * m.model.seq_len

    class HelpingCell:
        """Helps throughout; its leader's split micro-batches arrive at the third look."""

        def __init__(self) -> None:
            self.helper, self.looks = SimpleNamespace(tokens=0), 0

        @property
        def role(self) -> str:
            self.looks += 1
            if self.looks == 3:
                self.helper.tokens = 2 * per_mb  # its cell split two micro-batches of the budget
            return "helper"

    cell = HelpingCell()
    pipeline.cells = cell
    head = Head(pipeline)
    try:
        asyncio.run(
            asyncio.wait_for(head.run(sampler, asyncio.Event(), max_tokens=2 * per_mb), timeout=30)
        )
    finally:
        worker.close()
    assert cell.looks == 3  # it waited while helping, and stopped once its budget was met
    assert head.injected_tokens == 0 and head.trained_tokens == 2 * per_mb
    assert pipeline.stats.results == {"ok": 0, "dropped": 0, "rejected": 0}


def test_failed_requests_to_the_next_stage_are_counted_by_kind():
    """A flaky replica was invisible: its micro-batches went elsewhere and only the log said so
    (found by a review)."""
    from agora_node.comms.routing import FailureKind
    from agora_node.node.suspects import Reason

    m = one_stage_manifest()
    events = Metrics()
    worker = StageWorker(m, 0)
    try:
        pipeline = Pipeline(
            m, worker, None, "me", lambda s: [], PipelineConfig(), stats=PipelineStats(events)
        )
        pipeline._hop_failed("peer", FailureKind.TIMEOUT)
        pipeline._hop_failed("peer", FailureKind.BUSY)
        pipeline._refuse("peer", Reason.NONFINITE, "loss nan")
    finally:
        worker.close()
    assert events.hop_failure_counts() == {
        "busy": 1, "timeout": 1, "error": 0, "rejected": 0, "refused": 1
    }  # fmt: skip
    v = values(events)
    assert v[("agora_hop_failures_total", (("kind", "refused"),))] == 1
    assert v[("agora_hop_failures_total", (("kind", "error"),))] == 0  # exported from the start
