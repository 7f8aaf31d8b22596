"""Packed documents through the data plane: the head's windows carry where documents
start, the forward request carries it to the next stage, and every stage's attention
keeps documents apart as the one-process reference does (no network: the hop is the
wire format handed from one stage's pipeline to the next one's handler)."""

import asyncio

import pytest
import torch

from agora_node.comms import streams
from agora_node.comms.pipeline_wire import ForwardHeader, Status, decode_response
from agora_node.node.head import Sampler
from agora_node.node.pipeline import Pipeline, PipelineConfig
from agora_node.node.train_local import chain_forward
from agora_node.node.worker import StageWorker
from agora_node.stages.data import TokenBatch, TokenWindows, document_ids
from agora_node.stages.manifest_files import load_manifest
from agora_node.stages.model import lm_loss
from tests.integration.harness import small_manifest

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    path = tmp_path_factory.mktemp("docs") / "two.toml"
    return load_manifest(small_manifest(path, stages=2, layers=2, documents=True))


def test_the_head_claims_windows_with_their_documents(manifest):
    windows = TokenWindows(manifest, "train")
    batch = Sampler(windows, "only", lambda: []).claim(8)
    order = [int(i) for i in windows.epoch_order(0)[:8]]
    assert batch.docs is not None and int(batch.docs[:, -1].max()) >= 1  # packed rows
    for row, sample_id in enumerate(order):
        sample = windows.sample(sample_id)
        assert torch.equal(batch.ids[row], sample.tokens)
        assert torch.equal(batch.docs[row], document_ids(manifest.model.seq_len, sample.doc_starts))


def test_a_hop_carries_the_documents_and_the_next_stage_keeps_them_apart(manifest, monkeypatch):
    workers = [StageWorker(manifest, s) for s in range(2)]
    config = PipelineConfig(activation_codec="fp32")
    first, last = (
        Pipeline(manifest, w, None, f"peer-{w.index}", lambda s: [f"peer-{s}"], config)
        for w in workers
    )

    async def hop(p2p, peer, protocol, payload, *, timeout, **_kw):  # noqa: ANN001, ANN202
        assert peer == "peer-1"
        return b"".join([chunk async for chunk in last.handle("peer-0", payload)])

    monkeypatch.setattr(streams, "request", hop)
    windows = TokenWindows(manifest, "train")
    rows = manifest.inner.micro_batch  # a training micro-batch is a whole one
    batch = windows.batch([int(i) for i in windows.epoch_order(0)[:rows]])
    assert batch.docs is not None and int(batch.docs[:, -1].max()) >= 1
    stages = [w.stage for w in workers]
    with torch.no_grad():
        packed = float(lm_loss(chain_forward(stages, batch), batch.targets))
        whole = float(lm_loss(chain_forward(stages, TokenBatch(batch.ids)), batch.targets))
    try:
        m = manifest.model
        header = ForwardHeader(
            run_id=manifest.run_id, mb_id="mb", stage=1, batch=rows, seq=m.seq_len,
            width=workers[0].stage.boundary_width,
            loss_scale=manifest.inner.micro_batch / manifest.inner.local_batch,
        )  # fmt: skip
        c = workers[0].forward("mb", None, batch)
        reply = asyncio.run(first.send(header, batch, c))
        assert reply is not None
        loss, grad = reply
        tolerance = 1e-6  # fp32 on the wire: the same sums, in another order
        assert loss == pytest.approx(packed, rel=tolerance)
        # the documents change the loss (by 1e-4 relative at init, ~100x the tolerance)
        assert abs(whole - packed) > 20 * tolerance * packed
        assert grad is not None and grad.shape == c.shape
        assert last.stats.results["ok"] == 1
    finally:
        for w in workers:
            w.close()


def test_a_request_whose_documents_do_not_fit_its_rows_is_refused(manifest):
    from agora_node.comms.pipeline_wire import encode_forward

    worker = StageWorker(manifest, 1)
    p = Pipeline(manifest, worker, None, "me", lambda s: [], PipelineConfig())
    try:
        m = manifest.model
        header = ForwardHeader(
            run_id=manifest.run_id, mb_id="mb", stage=1, batch=2, seq=m.seq_len,
            width=worker.stage.boundary_width, train=False,
        )  # fmt: skip
        ids = torch.zeros(2, m.seq_len + 1, dtype=torch.long)
        c = torch.zeros(2, m.seq_len, worker.stage.boundary_width)
        one_row = torch.zeros(1, m.seq_len, dtype=torch.long)
        one_row[0, 5:] = 1  # the documents of one row, sent with two rows of tokens
        data = encode_forward(header, ids, p.codec.encode(c), one_row)

        async def ask() -> bytes:
            return b"".join([chunk async for chunk in p.handle("stranger", data)])

        reply, _ = decode_response(asyncio.run(ask()))
        assert reply.status == Status.REJECTED.value and reply.code == "bad_documents"
        assert p.stats.rejected_codes == {"bad_documents": 1}
    finally:
        worker.close()
