"""A backward that a neighbour's finite but extreme gradient or input overflows: the
worker drops that weight version's gradients (as after an out-of-memory) instead of
letting the whole inner step be skipped. Nobody is flagged for it (the overflow may be
this stage's own weights, or a gradient from two hops away: flagging the downstream
replica banned honest ones), and the upstream is told the micro-batch failed downstream,
not that its input was refused. No network: the next stage is replaced in memory."""

import asyncio
import logging

import pytest
import torch

from agora_node.comms import streams
from agora_node.comms.pipeline_wire import (
    Code,
    ResponseHeader,
    Status,
    decode_forward,
    encode_response,
)
from agora_node.compression import ActivationCodec
from agora_node.node.head import Head
from agora_node.node.pipeline import Pipeline, PipelineConfig
from agora_node.node.worker import StageWorker
from agora_node.stages.data import TokenBatch
from agora_node.stages.manifest_files import load_manifest
from tests.node.forward_requests import forward_request, serve

pytestmark = pytest.mark.timeout(120)

M = load_manifest("tiny")
B, S = M.inner.micro_batch, M.model.seq_len
SCALE = M.inner.micro_batch / M.inner.local_batch
EXTREME = 3e16
"""A gradient value whose norm is finite (it passes the norm watch, still learning), and
that overflows the backward of tiny's stages 0 and 1."""


def _below(values: list[float]):  # noqa: ANN202
    """The next stage: answers the n-th request with a gradient of values[n] everywhere."""

    async def request(p2p, peer, protocol, payload, **_kw) -> bytes:  # noqa: ANN001
        header = decode_forward(payload)[0]
        grad = torch.full((header.batch, header.seq, header.width), values.pop(0))
        frame = ActivationCodec(mode="fp32").encode(grad)
        return encode_response(ResponseHeader(status=Status.OK.value, loss=2.0), frame)

    return request


def _request(seed: int, width: int, stage: int = 1) -> bytes:
    return forward_request(M, stage=stage, width=width, seed=seed)


def test_a_middle_stage_drops_what_an_extreme_gradient_overflowed(
    monkeypatch,
):
    worker = StageWorker(M, 1)
    config = PipelineConfig(activation_codec="fp32")
    p = Pipeline(M, worker, None, "me", lambda s: ["below"], config)
    monkeypatch.setattr(streams, "request", _below([0.01, EXTREME, 0.01, 0.01]))
    width = worker.stage.boundary_width
    try:
        assert serve(p, "up", _request(1, width)).status == Status.OK.value
        bad = serve(p, "up", _request(2, width))
        assert (bad.status, bad.code) == (Status.FAILED.value, Code.DOWNSTREAM.value)
        assert not p.suspects.banned()
        # the first micro-batch went with the overflowed version's gradients; the next
        # two make a whole step, which is taken, not skipped
        assert serve(p, "up", _request(3, width)).status == Status.OK.value
        assert worker.stats.steps == 0
        assert serve(p, "up", _request(4, width)).status == Status.OK.value
        assert (worker.stats.steps, worker.optimizer.skipped) == (1, 0)
    finally:
        worker.close()


def test_a_head_drops_a_micro_batch_whose_backward_overflowed(monkeypatch, caplog):
    worker = StageWorker(M, 0)
    p = Pipeline(M, worker, None, "me", lambda s: ["below"], PipelineConfig())
    monkeypatch.setattr(streams, "request", _below([EXTREME]))
    batch = TokenBatch(torch.randint(0, M.model.vocab_size, (B, S + 1)))
    try:
        with caplog.at_level(logging.INFO):
            asyncio.run(Head(p)._run_microbatch(batch))
    finally:
        worker.close()
    assert not p.suspects.banned()
    assert p.stats.results["dropped"] == 1
    assert not [r for r in caplog.records if r.exc_info]  # said in one line
    assert worker.stats.microbatches == 0 and worker.in_flight == 0


def test_the_last_stage_drops_an_overflowed_backward(monkeypatch):
    worker = StageWorker(M, M.num_stages - 1)
    p = Pipeline(M, worker, None, "me", lambda s: [], PipelineConfig(activation_codec="fp32"))
    honest = worker.forward_backward_last

    def overflowing(c_in, tokens, loss_scale):  # noqa: ANN001, ANN202
        return honest(c_in, tokens, 1e38)  # what an input that overflows here would do

    width, last = worker.stage.boundary_width, M.num_stages - 1
    try:
        assert serve(p, "up", _request(1, width, last)).status == Status.OK.value
        monkeypatch.setattr(worker, "forward_backward_last", overflowing)
        bad = serve(p, "up", _request(2, width, last))
        assert (bad.status, bad.code) == (Status.REJECTED.value, Code.NON_FINITE.value)
        assert not p.suspects.banned()
        assert worker.stats.steps == 0  # the first micro-batch's gradients went too
    finally:
        worker.close()


def test_a_cells_summed_gradients_are_checked_as_a_backward_is():
    """A cell leader adds its members' gradients to the version copy (`accumulate`): an
    overflow there was not caught, the step was skipped, and the next micro-batch's own
    backward on that version found the non-finite gradients and was blamed for them."""
    from agora_node.compression import NonFiniteError

    worker = StageWorker(M, 1)
    try:
        version, params = worker.current_version()
        grads = {name: torch.full_like(p, 1e20) for name, p in params.items()}
        with pytest.raises(NonFiniteError):
            worker.accumulate(version, params, grads, tokens=B * S, compute_s=0.1)
        assert all(p.grad is None for p in params.values())
        assert worker.stats.microbatches == 0
    finally:
        worker.close()
