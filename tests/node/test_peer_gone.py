"""A request waiting on a peer that membership declares dead is given up at once and the
micro-batch goes to another replica, instead of waiting out the hop timeout (a frozen or
cut-off peer sends no reset). The transport is replaced: this tests the pipeline's logic."""

import asyncio

import pytest
import torch

from agora_node.comms.pipeline_wire import ForwardHeader, ResponseHeader, Status, encode_response
from agora_node.node.pipeline import Pipeline, PipelineConfig
from agora_node.node.worker import StageWorker
from agora_node.protocol.manifest import parse_manifest
from agora_node.stages.data import TokenBatch
from agora_node.stages.manifest_files import load_manifest

pytestmark = pytest.mark.timeout(60)


class _Transport(Pipeline):
    """Replica "frozen" never answers; "live" answers at once."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.asked: list[str] = []
        self.frozen_asked = asyncio.Event()
        self.frozen_cancelled = False

    async def _request(self, peer: str, payload: bytes) -> bytes:
        self.asked.append(peer)
        if peer == "live":
            return encode_response(ResponseHeader(status=Status.OK.value, loss=1.5))
        self.frozen_asked.set()
        try:
            await asyncio.Event().wait()  # the hop timeout would end this after a minute
        except asyncio.CancelledError:
            self.frozen_cancelled = True
            raise
        raise AssertionError("unreachable")


def _two_stages():
    text = load_manifest("tiny").to_toml().replace("n_layers = 8", "n_layers = 2")
    return parse_manifest(text.replace("count = 4", "count = 2"))


async def _send_while_frozen_is_declared_dead(declare: bool):
    m = _two_stages()
    worker = StageWorker(m, 0)
    replicas = ["frozen"]  # "live" joins the stage once the request is out
    pipeline = _Transport(
        m, worker, None, "me", lambda stage: list(replicas), PipelineConfig(deadline_s=30)
    )
    header = ForwardHeader(
        run_id=m.run_id, mb_id="mb", stage=1, batch=1, seq=m.model.seq_len, width=8, train=False
    )
    tokens = TokenBatch(torch.zeros(1, m.model.seq_len + 1, dtype=torch.long))
    try:
        send = asyncio.create_task(
            pipeline.send(header, tokens, torch.zeros(1, m.model.seq_len, 8))
        )
        await asyncio.wait_for(pipeline.frozen_asked.wait(), 10)
        replicas.append("live")
        if declare:
            replicas.remove("frozen")
            pipeline.peer_gone("frozen")
        done, _ = await asyncio.wait({send}, timeout=5)
        if send in done:
            return send.result(), pipeline
        send.cancel()
        return None, pipeline
    finally:
        worker.close()


def test_a_request_to_a_peer_declared_dead_is_retried_elsewhere_at_once():
    result, pipeline = asyncio.run(_send_while_frozen_is_declared_dead(declare=True))
    assert result is not None and result[0] == 1.5
    assert pipeline.asked == ["frozen", "live"] and pipeline.frozen_cancelled
    assert pipeline.waits.idle()  # nothing kept


def test_without_the_declaration_the_request_keeps_waiting():
    result, pipeline = asyncio.run(_send_while_frozen_is_declared_dead(declare=False))
    assert result is None and pipeline.asked == ["frozen"]


def test_cancelling_the_sender_is_not_taken_for_a_departure():
    async def body():
        m = _two_stages()
        worker = StageWorker(m, 0)
        pipeline = _Transport(m, worker, None, "me", lambda s: ["frozen"], PipelineConfig())
        try:
            task = asyncio.create_task(
                pipeline.waits.call("frozen", pipeline._request("frozen", b""))
            )
            await asyncio.wait_for(pipeline.frozen_asked.wait(), 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return pipeline
        finally:
            worker.close()

    pipeline = asyncio.run(body())
    assert pipeline.frozen_cancelled and pipeline.waits.idle()
