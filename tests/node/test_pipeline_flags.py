"""The pipeline bans a next-stage replica that returns a non-finite loss or gradient, or a
gradient whose norm is far above the recent ones, and routes around it (no network:
streams.request is replaced by in-memory replicas)."""

import asyncio

import pytest
import torch

from agora_node.comms import streams
from agora_node.comms.pipeline_wire import ForwardHeader, ResponseHeader, Status, encode_response
from agora_node.node.pipeline import Pipeline, PipelineConfig
from agora_node.node.suspects import Reason
from agora_node.node.worker import StageWorker
from agora_node.stages.data import TokenBatch
from agora_node.stages.manifest_files import load_manifest

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pipeline():
    m = load_manifest("tiny")
    worker = StageWorker(m, 0)
    p = Pipeline(m, worker, None, "me", lambda s: ["bad", "good"], PipelineConfig())
    try:
        yield p
    finally:
        worker.close()


def _replicas(monkeypatch, pipeline: Pipeline, answers: dict):
    """answers[peer](shape) -> (loss, gradient tensor); records who was asked."""
    asked: list[str] = []

    async def request(p2p, peer, protocol, payload, *, timeout, **_kw):  # noqa: ANN001, ANN202
        asked.append(peer)
        loss, grad = answers[peer]
        encoded = pipeline.codec.encode(grad) if grad is not None else b""
        return encode_response(ResponseHeader(status=Status.OK.value, loss=loss), encoded)

    monkeypatch.setattr(streams, "request", request)
    return asked


def _send(pipeline: Pipeline, n: int = 1):
    m = pipeline.manifest
    b, s, d = m.inner.micro_batch, m.model.seq_len, m.model.d_model
    header = ForwardHeader(run_id=m.run_id, mb_id="x", stage=1, batch=b, seq=s, width=d)
    tokens = TokenBatch(torch.zeros(b, s, dtype=torch.long))

    async def go():  # noqa: ANN202
        return [await pipeline.send(header, tokens, torch.ones(b, s, d)) for _ in range(n)]

    return asyncio.run(go())


def _shape(pipeline: Pipeline) -> tuple[int, int, int]:
    m = pipeline.manifest
    return (m.inner.micro_batch, m.model.seq_len, m.model.d_model)


@pytest.mark.parametrize(
    ("loss", "reason"),
    [(float("nan"), Reason.NONFINITE), (None, Reason.NONFINITE), ("NaN", Reason.MALFORMED)],
)
def test_a_non_finite_loss_bans_the_replica_and_the_batch_goes_elsewhere(
    pipeline, monkeypatch, loss, reason
):
    grad = torch.ones(_shape(pipeline))
    # It answers fast, the honest replica slowly: the liar is asked first. (Both measured:
    # an unmeasured peer is probed optimistically, and the measured speed of the mock
    # depended on the machine's load.)
    pipeline._router.on_success("bad", 0.001, 0.0)
    pipeline._router.on_success("good", 1.0, 0.0)
    asked = _replicas(monkeypatch, pipeline, {"bad": (loss, grad), "good": (2.5, grad)})
    first, second = _send(pipeline, 2)
    assert first is not None and first[0] == 2.5 and second[0] == 2.5
    assert pipeline.suspects.is_banned("bad") and asked.count("bad") == 1
    (row,) = pipeline.suspects.status()["banned"]
    assert row["reason"] == reason.value


def test_a_gradient_norm_outlier_bans_the_replica(pipeline, monkeypatch):
    shape = _shape(pipeline)
    answers = {"bad": (2.0, torch.ones(shape)), "good": (2.0, torch.ones(shape))}
    asked = _replicas(monkeypatch, pipeline, answers)
    _send(pipeline, 20)  # the watch learns the usual norm
    assert not pipeline.suspects.banned()
    live = ["bad"]  # only the liar is listed when it answers; then a good replica appears
    pipeline.peers_of = lambda s: list(live)
    answers["bad"] = (2.0, torch.full(shape, 1e4))
    monkeypatch.setattr(pipeline.suspects, "flag", _and_then(pipeline.suspects.flag, live))
    asked.clear()
    results = _send(pipeline, 4)
    assert all(r is not None and float(r[1].abs().max()) < 2 for r in results)
    assert pipeline.suspects.is_banned("bad") and asked.count("bad") == 1
    assert pipeline.suspects.flagged_total[Reason.PIPELINE_OUTLIER.value] == 1


def test_gradients_that_moved_at_every_replica_are_taken_and_nobody_stays_banned(
    pipeline, monkeypatch
):
    # training moved the level while this node was idle (boundary norms grow ~400x in
    # tiny's first 40 steps): a watch of old norms must not refuse every replica for good
    shape = _shape(pipeline)
    answers = {"bad": (2.0, torch.ones(shape)), "good": (2.0, torch.ones(shape))}
    _replicas(monkeypatch, pipeline, answers)
    _send(pipeline, 20)
    answers.update(bad=(2.0, torch.full(shape, 500.0)), good=(2.0, torch.full(shape, 500.0)))
    results = _send(pipeline, 4)
    assert all(r is not None and float(r[1].abs().max()) > 400 for r in results)
    assert not pipeline.suspects.banned()
    assert pipeline.suspects.flagged_total[Reason.PIPELINE_OUTLIER.value] == 1  # then pardoned


def _and_then(flag, live: list[str]):  # noqa: ANN001, ANN202
    def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        live.append("good")
        return flag(*args, **kwargs)

    return wrapped


def test_a_banned_replica_is_still_used_when_it_is_the_only_one(pipeline, monkeypatch):
    pipeline.peers_of = lambda s: ["bad"]
    pipeline.suspects.flag("bad", Reason.MISMATCH, "test")
    _replicas(monkeypatch, pipeline, {"bad": (2.0, torch.ones(_shape(pipeline)))})
    (result,) = _send(pipeline)
    assert result is not None and result[0] == 2.0
