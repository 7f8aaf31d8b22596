"""What a replica's answer can make this node hold or log: a forward reply is read up to
the largest valid one (a float32 gradient of a whole micro-batch), not a stream's 64 MiB;
a peer's error or refusal text is cut short and carries no control characters into an
error or the log (no network: the peer is a reader fed by the test)."""

import asyncio
import logging

import pytest
import torch

from agora_node.comms import streams
from agora_node.comms.pipeline_wire import (
    ForwardHeader,
    ResponseHeader,
    Status,
    encode_response,
)
from agora_node.compression import ActivationCodec
from agora_node.node.pipeline import Pipeline, PipelineConfig
from agora_node.node.worker import StageWorker
from agora_node.protocol.identity import Identity
from agora_node.stages.data import TokenBatch
from agora_node.stages.manifest_files import load_manifest
from tests.node.stream_fakes import FakeP2P, frame

pytestmark = pytest.mark.timeout(60)

M = load_manifest("tiny")
HOSTILE = "\x1b[2J\x1b[31mroot# " + "A" * 10_000 + "\r\n"


@pytest.fixture
def head():
    worker = StageWorker(M, 0)
    try:
        yield worker
    finally:
        worker.close()


def _ask(worker: StageWorker, sent: bytes) -> bytes:
    """A forward request of `worker`'s pipeline, answered with `sent`."""

    async def ask() -> bytes:
        reader = asyncio.StreamReader()
        reader.feed_data(sent)
        config = PipelineConfig(hop_timeout_s=5.0)
        pipeline = Pipeline(M, worker, FakeP2P(reader), "me", lambda s: ["next"], config)
        return await pipeline._request(Identity.generate().peer_id, b"request")

    return asyncio.run(ask())


def test_a_forward_reply_larger_than_a_valid_one_is_refused_before_its_body(head):
    limit = Pipeline(M, head, None, "me", lambda s: [], PipelineConfig()).max_reply
    assert limit < 1 << 20  # tiny: a micro-batch's float32 gradient is 128 KiB
    with pytest.raises(streams.StreamError, match="exceeds the limit"):
        _ask(head, frame(streams.KIND_DATA, length=limit + 1))  # its body never comes


def test_the_largest_valid_forward_reply_is_taken(head):
    shape = (M.inner.micro_batch, M.model.seq_len, head.stage.boundary_width)
    grad = ActivationCodec(mode="fp32").encode(torch.ones(shape))
    reply = encode_response(ResponseHeader(status=Status.OK.value, loss=2.0), grad)
    sent = frame(streams.KIND_DATA, reply) + frame(streams.KIND_END)
    assert _ask(head, sent) == reply


@pytest.mark.parametrize("kind", [streams.KIND_ERROR, streams.KIND_REFUSED])
async def test_a_peers_error_text_is_cut_short_and_printable(kind: bytes) -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(frame(kind, HOSTILE.encode()))
    reader.feed_eof()
    peer = Identity.generate().peer_id
    with pytest.raises(streams.StreamError) as info:
        await streams.request(FakeP2P(reader), peer, "/test/1", b"ping", timeout=5)
    text = str(info.value)
    assert len(text) < 2 * streams.PEER_TEXT_CHARS and text.isprintable()
    assert "root# AAA" in text  # still says what the peer said


def test_a_rejecting_replicas_message_is_logged_short_and_quoted(head, monkeypatch, caplog):
    async def reject(*_args, **_kw) -> bytes:
        return encode_response(
            ResponseHeader(status=Status.REJECTED.value, code="bad_shape", message=HOSTILE[:3000])
        )

    monkeypatch.setattr(streams, "request", reject)
    pipeline = Pipeline(M, head, None, "me", lambda s: ["next"], PipelineConfig())
    b, s, k = M.inner.micro_batch, M.model.seq_len, head.stage.boundary_width
    header = ForwardHeader(run_id=M.run_id, mb_id="x", stage=1, batch=b, seq=s, width=k)
    tokens = TokenBatch(torch.zeros(b, s + 1, dtype=torch.long))
    with caplog.at_level(logging.INFO):
        assert asyncio.run(pipeline.send(header, tokens, torch.ones(b, s, k))) is None
    (logged,) = [r.getMessage() for r in caplog.records if "rejected our" in r.getMessage()]
    assert len(logged) < 2 * streams.PEER_TEXT_CHARS and logged.isprintable()
