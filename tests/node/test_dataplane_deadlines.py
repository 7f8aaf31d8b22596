"""A request is written within a deadline: a peer that accepts the stream and never reads
it is a silent peer (SilentPeerError), directly or through a relay, and the head's
micro-batch ends (its slot freed, the router's count of requests out to the peer back to
0) instead of waiting for good (no network: the peer is a stream that never drains)."""

import asyncio

import pytest
import torch

from agora_node.comms import streams
from agora_node.comms.relay import Relaying
from agora_node.node.head import Head
from agora_node.node.pipeline import Pipeline, PipelineConfig
from agora_node.node.worker import StageWorker
from agora_node.protocol.identity import Identity
from agora_node.stages.data import TokenBatch
from agora_node.stages.manifest_files import load_manifest

pytestmark = pytest.mark.timeout(60)

HANG = 10.0
"""Longer than any deadline here: a write still waiting then never ends."""


class _Unread:
    """A stream the remote peer accepted and never reads: a write's drain waits for good."""

    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        await asyncio.Event().wait()

    def close(self) -> None:
        pass


class _P2P:
    async def call_binary_stream_handler(self, peer_id, name):  # noqa: ANN001, ANN201
        return None, asyncio.StreamReader(), _Unread()


async def test_a_peer_that_never_reads_the_request_is_silent() -> None:
    peer = Identity.generate().peer_id
    call = streams.request(_P2P(), peer, "/test/1", b"x" * (64 << 10), timeout=0.05)
    with pytest.raises(streams.SilentPeerError, match="did not take"):
        await asyncio.wait_for(call, HANG)


async def test_a_relay_that_never_reads_the_request_is_silent() -> None:
    p2p, peer, relay = _P2P(), Identity.generate().peer_id, Identity.generate().peer_id
    relaying = Relaying(Identity.generate(), "run")
    relaying.routes = {peer: [relay]}
    streams.set_route(p2p, relaying)
    call = streams.request(p2p, peer, "/agora/run/echo/1", b"x" * (64 << 10), timeout=0.05)
    with pytest.raises(streams.SilentPeerError, match="did not take"):
        await asyncio.wait_for(call, HANG)


def test_the_heads_micro_batch_ends_and_frees_the_router_count():
    m = load_manifest("tiny")
    worker = StageWorker(m, 0)
    config = PipelineConfig(hop_timeout_s=0.05, deadline_s=0.5)
    pipeline = Pipeline(m, worker, _P2P(), "me", lambda s: ["next"], config)
    b, s = m.inner.micro_batch, m.model.seq_len
    batch = TokenBatch(torch.randint(0, m.model.vocab_size, (b, s + 1)))
    try:
        asyncio.run(asyncio.wait_for(Head(pipeline)._run_microbatch(batch), HANG))
    finally:
        worker.close()
    assert pipeline.stats.results["dropped"] == 1
    assert pipeline._router.snapshot()["next"]["in_flight"] == 0
    assert worker.in_flight == 0
