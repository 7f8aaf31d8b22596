"""Micro-batch ids never travel across hops: each hop keys its worker and names the
micro-batch to its downstream by an id of its own, so two requests under one id (one
upstream's reused, or two upstreams') each get the gradient of their own input; a worker
refuses a forward under an id it holds, and a backward whose forward is gone fails that
request, not the handler (no network: the next stage is replaced in memory)."""

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
    decode_response,
    encode_response,
)
from agora_node.compression import ActivationCodec
from agora_node.node.pipeline import Pipeline, PipelineConfig
from agora_node.node.worker import (
    DuplicateMicroBatchError,
    StageWorker,
    UnknownMicroBatchError,
)
from agora_node.stages.manifest_files import load_manifest
from tests.node.forward_requests import answer, forward_request

pytestmark = pytest.mark.timeout(120)

M = load_manifest("tiny")
B, S = M.inner.micro_batch, M.model.seq_len


@pytest.fixture
def middle():
    worker = StageWorker(M, 1)
    worker.hold_steps = True  # weights stay put: a reply compares with the same one alone
    p = Pipeline(M, worker, None, "me", lambda s: ["below"], PipelineConfig())
    try:
        yield p
    finally:
        worker.close()


def _request(mb_id: str, seed: int) -> bytes:
    width = M.model.subspace_rank
    return forward_request(M, stage=1, width=width, seed=seed, mb_id=mb_id, mode="int8")


class _Below:
    """The next stage: records the id of each request, and answers all of them with one
    gradient once `together` are waiting (so that their forwards are all held above)."""

    def __init__(self, codec: ActivationCodec, together: int, then=None) -> None:  # noqa: ANN001
        self.codec, self.together, self.then = codec, together, then
        self.ids: list[str] = []
        self.all_in = asyncio.Event()

    async def __call__(self, p2p, peer, protocol, payload, **_kw) -> bytes:  # noqa: ANN001
        header = decode_forward(payload)[0]
        self.ids.append(header.mb_id)
        if len(self.ids) >= self.together:
            self.all_in.set()
        await asyncio.wait_for(self.all_in.wait(), 10)
        if self.then is not None:
            await self.then()
        grad = torch.full((header.batch, header.seq, header.width), 0.01)
        return encode_response(ResponseHeader(status="ok", loss=2.0), self.codec.encode(grad))


def _gradient(answer: bytes) -> torch.Tensor:
    reply, payload = decode_response(answer)
    assert reply.status == Status.OK.value, reply
    return ActivationCodec().decode(payload, (B, S, M.model.subspace_rank))


def test_two_requests_under_one_id_each_get_the_gradient_of_their_own_input(middle, monkeypatch):
    first, second = _request("x", seed=1), _request("x", seed=2)
    monkeypatch.setattr(streams, "request", _Below(middle.codec, together=1))
    alone = [_gradient(asyncio.run(answer(middle, "up", r))) for r in (first, second)]
    assert not torch.equal(alone[0], alone[1])

    async def both() -> tuple[list[bytes], list[str]]:
        below = _Below(middle.codec, together=2)
        monkeypatch.setattr(streams, "request", below)
        answers = await asyncio.gather(answer(middle, "up", first), answer(middle, "up", second))
        return answers, below.ids

    answers, ids = asyncio.run(both())
    assert all(torch.equal(_gradient(a), g) for a, g in zip(answers, alone, strict=True))
    assert len(set(ids)) == 2 and "x" not in ids  # this hop's own ids went downstream
    assert middle.worker.in_flight == 0


def test_two_upstreams_with_one_id_do_not_meet_at_the_stage_below(middle, monkeypatch):
    async def both() -> list[str]:
        below = _Below(middle.codec, together=2)
        monkeypatch.setattr(streams, "request", below)
        await asyncio.gather(
            answer(middle, "up-a", _request("x", seed=1)),
            answer(middle, "up-b", _request("x", seed=2)),
        )
        return below.ids

    ids = asyncio.run(both())
    assert len(set(ids)) == 2 and "x" not in ids


def test_a_backward_whose_forward_is_gone_fails_that_request_without_a_traceback(
    middle, monkeypatch, caplog
):
    worker = middle.worker

    async def load_state() -> None:  # a state load while the micro-batch is downstream
        await worker.call(worker.load_state_dict, await worker.call(worker.state_dict))

    monkeypatch.setattr(streams, "request", _Below(middle.codec, together=1, then=load_state))
    with caplog.at_level(logging.INFO):
        reply, _ = decode_response(asyncio.run(answer(middle, "up", _request("x", seed=1))))
    assert (reply.status, reply.code) == (Status.FAILED.value, Code.INTERNAL.value)
    assert middle.stats.results["dropped"] == 1
    assert not [r for r in caplog.records if r.exc_info]


def test_the_worker_refuses_a_forward_under_an_id_it_holds_and_a_backward_it_does_not():
    worker = StageWorker(M, 1)
    try:
        g = torch.Generator().manual_seed(3)
        c = torch.randn(B, S, worker.stage.boundary_width, generator=g)
        tokens = torch.randint(0, M.model.vocab_size, (B, S + 1), generator=g)
        worker.forward("a", c, tokens)
        with pytest.raises(DuplicateMicroBatchError):
            worker.forward("a", c * 2, tokens)
        with pytest.raises(UnknownMicroBatchError):
            worker.backward("b", torch.ones_like(c))
        assert worker.backward("a", torch.ones_like(c)) is not None  # the first one, whole
        assert worker.in_flight == 0
    finally:
        worker.close()
