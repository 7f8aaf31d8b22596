"""What a stranger can make a stage do through its forward protocol (docs/security.md,
"Micro-batches from strangers"): a stage takes requests only from peers with a record at
the stage before it, stage 0 takes none, a training request weighs no more than a head's,
one replica's REJECTED does not drop a micro-batch, and a reply's loss must be a loss. No
network: streams.request is replaced by in-memory replicas."""

import asyncio
import time

import pytest
import torch

from agora_node.comms import streams
from agora_node.comms.pipeline_wire import (
    Code,
    ForwardHeader,
    ResponseHeader,
    Status,
    decode_response,
    encode_forward,
    encode_response,
    error_response,
)
from agora_node.compression import ActivationCodec
from agora_node.node.pipeline import MAX_REJECTIONS, Pipeline, PipelineConfig
from agora_node.node.suspects import Reason
from agora_node.node.worker import StageWorker, WorkerClosed
from agora_node.stages.data import TokenBatch
from agora_node.stages.manifest_files import load_manifest

pytestmark = pytest.mark.timeout(60)

M = load_manifest("tiny")
HEAD_SCALE = M.inner.micro_batch / M.inner.local_batch


def _request(stage: int, width: int, **header) -> bytes:
    b, s = M.inner.micro_batch, M.model.seq_len
    fields = dict(run_id=M.run_id, mb_id="x", stage=stage, batch=b, seq=s, width=width)
    h = ForwardHeader(**{**fields, "loss_scale": HEAD_SCALE, **header})
    tokens = torch.randint(0, M.model.vocab_size, (b, s + 1), generator=torch.Generator())
    c = torch.randn(b, s, width, generator=torch.Generator().manual_seed(1)) * 0.1
    return encode_forward(h, tokens, ActivationCodec(mode="int8").encode(c))


def _serve(p: Pipeline, remote: str, data: bytes) -> ResponseHeader:
    async def ask() -> bytes:
        return b"".join([chunk async for chunk in p.handle(remote, data)])

    reply, _ = decode_response(asyncio.run(ask()))
    return reply


@pytest.fixture
def last_stage():
    worker = StageWorker(M, M.num_stages - 1)
    heads = {"upstream"}
    p = Pipeline(
        M, worker, None, "me", lambda s: [], PipelineConfig(), may_send=lambda p, _stage: p in heads
    )
    try:
        yield p
    finally:
        worker.close()


def test_a_stage_serves_only_peers_with_a_record_at_the_stage_before(last_stage):
    width = last_stage.worker.stage.boundary_width
    data = _request(M.num_stages - 1, width)
    refused = _serve(last_stage, "stranger", data)
    assert (refused.status, refused.code) == (Status.BUSY.value, Code.UNKNOWN_SENDER.value)
    assert last_stage.worker.stats.microbatches == 0  # refused before the worker was asked
    assert last_stage.stats.rejected_codes == {"unknown_sender": 1}  # counted, shown
    served = _serve(last_stage, "upstream", data)
    assert served.status == Status.OK.value
    assert last_stage.worker.stats.microbatches == 1


def test_a_request_that_finds_the_worker_closed_is_answered_leaving(last_stage):
    """A second stop signal closes the node under its requests: its worker's executor shut
    down, a handler's next call raised `RuntimeError: cannot schedule new futures after
    shutdown`, logged as an ERROR traceback, and its text went to the sender as a failure."""
    width = last_stage.worker.stage.boundary_width
    last_stage.worker.close()
    with pytest.raises(WorkerClosed):
        asyncio.run(last_stage.worker.call(lambda: None))
    reply = _serve(last_stage, "upstream", _request(M.num_stages - 1, width))
    assert (reply.status, reply.code) == (Status.BUSY.value, Code.LEAVING.value)


def test_a_training_request_weighs_no_more_than_a_heads_micro_batch(last_stage):
    width = last_stage.worker.stage.boundary_width
    heavy = _request(M.num_stages - 1, width, loss_scale=2 * HEAD_SCALE)
    reply = _serve(last_stage, "upstream", heavy)
    assert (reply.status, reply.code) == (Status.REJECTED.value, Code.BAD_HEADER.value)
    assert last_stage.worker.stats.microbatches == 0


def test_stage_0_takes_no_micro_batches_and_keeps_no_gradients():
    worker = StageWorker(M, 0)
    p = Pipeline(M, worker, None, "me", lambda s: ["next"], PipelineConfig())
    sent: list[str] = []

    async def request(*_args, **_kwargs):  # noqa: ANN202
        sent.append("downstream")
        raise AssertionError("stage 0 forwarded a stranger's micro-batch")

    try:
        streams_request, streams.request = streams.request, request
        reply = _serve(p, "stranger", _request(0, M.model.d_model))
        assert reply.status != Status.OK.value and reply.code == Code.WRONG_STAGE.value
        assert sent == [] and worker.stats.microbatches == 0
        assert all(t.grad is None for t in worker.stage.parameters())
    finally:
        streams.request = streams_request
        worker.close()


# ---- the sender's side: what the next stage's replicas answer ---------------------------


@pytest.fixture
def head():
    worker = StageWorker(M, 0)
    p = Pipeline(M, worker, None, "me", lambda s: ["liar", "honest", "other"], PipelineConfig())
    try:
        yield p
    finally:
        worker.close()


def _replicas(monkeypatch, p: Pipeline, answers: dict) -> list[str]:
    """answers[peer]: 'reject', ('busy', loss): busy once and then that loss, or a loss
    (the gradient is ones)."""
    asked: list[str] = []
    shape = (M.inner.micro_batch, M.model.seq_len, p.worker.stage.boundary_width)

    async def request(p2p, peer, protocol, payload, *, timeout, **_kw):  # noqa: ANN001, ANN202
        asked.append(peer)
        if answers[peer] == "reject":
            return error_response(Status.REJECTED, Code.BAD_SHAPE, "no")
        if isinstance(answers[peer], tuple):
            answers[peer] = answers[peer][1]
            return error_response(Status.BUSY, Code.OVERLOADED, "full")
        grad = p.codec.encode(torch.ones(shape))
        return encode_response(ResponseHeader(status=Status.OK.value, loss=answers[peer]), grad)

    monkeypatch.setattr(streams, "request", request)
    return asked


def _send(p: Pipeline, *, train: bool = True):  # noqa: ANN202
    b, s, d = M.inner.micro_batch, M.model.seq_len, p.worker.stage.boundary_width
    header = ForwardHeader(
        run_id=M.run_id, mb_id="x", stage=1, batch=b, seq=s, width=d, train=train,
        loss_scale=HEAD_SCALE,
    )  # fmt: skip
    tokens = TokenBatch(torch.zeros(b, s + 1, dtype=torch.long))
    return asyncio.run(p.send(header, tokens, torch.ones(b, s, d)))


def _liar_first(p: Pipeline) -> None:
    now = time.monotonic()  # the router's clock: measurements older than 20 s are stale
    p._router.on_success("liar", 0.001, now)
    p._router.on_success("honest", 0.5, now)
    p._router.on_success("other", 1.0, now)


def test_one_replica_that_rejects_does_not_drop_the_micro_batch(head, monkeypatch):
    _liar_first(head)
    asked = _replicas(monkeypatch, head, {"liar": "reject", "honest": 2.5, "other": 2.5})
    reply = _send(head)
    assert reply is not None and reply[0] == 2.5
    assert asked[0] == "liar" and len(asked) == 2


def test_a_micro_batch_two_replicas_reject_is_dropped(head, monkeypatch):
    assert MAX_REJECTIONS == 2
    asked = _replicas(monkeypatch, head, {"liar": "reject", "honest": "reject", "other": 2.5})
    head.peers_of = lambda s: ["liar", "honest"]
    assert _send(head) is None
    assert sorted(asked) == ["honest", "liar"]  # each once: no waiting for the deadline


@pytest.mark.parametrize("loss", [float("nan"), -1.0, float("-inf")])
@pytest.mark.parametrize("train", [True, False])
def test_a_reply_whose_loss_is_no_loss_is_refused(head, monkeypatch, loss, train):
    _liar_first(head)
    asked = _replicas(monkeypatch, head, {"liar": loss, "honest": 2.5, "other": 2.5})
    reply = _send(head, train=train)
    assert reply is not None and reply[0] == 2.5  # validation losses too
    assert asked[0] == "liar" and head.suspects.is_banned("liar")
    (row,) = head.suspects.status()["banned"]
    assert row["reason"] == Reason.NONFINITE.value


def test_recent_peers_remember_a_stage_s_senders_a_while_after_their_record_leaves_the_view():
    from agora_node.comms.directory import RecentPeers
    from agora_node.protocol.records import NodeRecord

    def record(peer: str, stage: int) -> NodeRecord:
        return NodeRecord(run_id="r", peer_id=peer, stage=stage, state="active")

    recent = RecentPeers(keep_s=60)
    recent.note({0: [record("head", 0)], 1: [record("mid", 1)]}, now=0.0)
    recent.note({0: [], 1: [record("mid", 1)]}, now=10.0)  # the head left (or a read failed)
    assert recent.seen(0, "head", now=10.0)  # still served while it drains
    assert recent.seen(1, "mid", now=10.0) and not recent.seen(1, "head", now=10.0)
    recent.note({}, now=61.0)
    assert not recent.seen(0, "head", now=61.0) and recent.seen(1, "mid", now=61.0)
    recent.note({}, now=71.0)
    assert not recent.seen(1, "mid", now=71.0)
    assert not recent._seen  # forgotten, not just hidden: bounded


def test_a_rejection_waits_for_a_briefly_busy_replica_instead_of_dropping(head, monkeypatch):
    _liar_first(head)
    head.peers_of = lambda s: ["liar", "honest"]
    asked = _replicas(monkeypatch, head, {"liar": "reject", "honest": ("busy", 2.5)})
    reply = _send(head)
    assert reply is not None and reply[0] == 2.5
    assert asked.count("liar") == 1  # never asked again after it rejected
