"""A training micro-batch is a whole one: a short one would count as one of the inner
step's micro-batches at a full one's loss_scale, its few rows weighed as many. A
validation forward may be short (the last windows of a validation set)."""

import pytest

from agora_node.comms.pipeline_wire import (
    Code,
    Status,
)
from agora_node.node.pipeline import Pipeline, PipelineConfig
from agora_node.node.worker import StageWorker
from agora_node.stages.manifest_files import load_manifest
from tests.node.forward_requests import forward_request, serve

pytestmark = pytest.mark.timeout(60)

M = load_manifest("tiny")


@pytest.fixture
def last_stage():
    worker = StageWorker(M, M.num_stages - 1)
    try:
        yield Pipeline(M, worker, None, "me", lambda s: [], PipelineConfig())
    finally:
        worker.close()


def _serve(p: Pipeline, batch: int, *, train: bool) -> tuple[str, str]:
    width, last = p.worker.stage.boundary_width, M.num_stages - 1
    data = forward_request(M, stage=last, width=width, batch=batch, mode="bf16", train=train)
    reply = serve(p, "up", data)
    return reply.status, reply.code


def test_a_short_training_micro_batch_is_refused(last_stage):
    short = _serve(last_stage, M.inner.micro_batch - 1, train=True)
    assert short == (Status.REJECTED.value, Code.BAD_SHAPE.value)
    assert last_stage.worker.stats.microbatches == 0
    assert _serve(last_stage, M.inner.micro_batch, train=True)[0] == Status.OK.value


def test_a_short_validation_forward_is_served(last_stage):
    assert _serve(last_stage, 1, train=False)[0] == Status.OK.value
