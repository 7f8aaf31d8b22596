"""Context-parallel cells of daemons' stage workers over real hivemind peers on 127.0.0.1:
a leader and a helper compute what one replica computes (outputs, input gradients and
the inner step), a helper that dies fails the micro-batch at once and the leader redoes
it whole, and a helper refuses anyone but its leader."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import pytest
import torch

from agora_node.comms import streams
from agora_node.comms.cell_link import CellLink
from agora_node.node import cell_work
from agora_node.node.cell import cell_groups, cell_of, routable
from agora_node.node.cell_leader import CellFailed, CellLeader
from agora_node.node.cell_work import CellHelper
from agora_node.node.worker import StageWorker
from agora_node.protocol.manifest import Manifest
from agora_node.protocol.names import cell_work_protocol
from agora_node.stages.data import TokenBatch, document_ids
from agora_node.stages.manifest_files import load_manifest
from tests.p2p_peers import start_peers, stop_p2p

pytestmark = [pytest.mark.timeout(120)]
RUN = "cells-test"


def test_cells_are_consecutive_sorted_peers_and_only_leaders_are_routed_to():
    peers = ["e", "a", "d", "c", "b"]
    assert cell_groups(peers, 2) == [["a", "b"], ["c", "d"], ["e"]]
    assert routable(peers, 2) == ["a", "c", "e"]
    assert cell_groups(peers, 1) == [["a"], ["b"], ["c"], ["d"], ["e"]]
    assert cell_of("d", ["a", "b", "c"], 2) == ["c", "d"]
    assert cell_of("z", ["a"], 2) == ["a", "z"]
    assert cell_of("z", [], 2) == ["z"]


def cell_manifest(stages: int = 3, seq_len: int = 30, kv_rank: int = 4) -> Manifest:
    m = load_manifest("tiny")
    model = dataclasses.replace(
        m.model, d_model=32, n_layers=stages, n_heads=4, n_kv_heads=2, ffn_dim=64,
        seq_len=seq_len, subspace_rank=8, cp_degree=2, kv_rank=kv_rank, kv_subspaces=3,
        kv_tokens=kv_rank > 0,
    )  # fmt: skip
    inner = dataclasses.replace(m.inner, micro_batch=2, local_batch=2)
    return dataclasses.replace(
        m, model=model, inner=inner, stages=dataclasses.replace(m.stages, count=stages)
    )


@contextlib.asynccontextmanager
async def cell_of_two(manifest: Manifest, stage: int, timeout_s: float = 20.0):
    """(leader, helper, the helper's p2p, a stranger's p2p), all on real peers."""
    a, b, stranger = await start_peers(3)
    workers = [StageWorker(manifest, stage) for _ in range(2)]
    try:
        ids = [a.peer_id.to_base58(), b.peer_id.to_base58()]
        links = [
            CellLink(p, RUN, members=ids, me=me, timeout_s=timeout_s)
            for p, me in zip((a, b), ids, strict=True)
        ]
        for link in links:
            await link.start()
        m = manifest.model
        helper = CellHelper(workers[1], links[1], m.seq_len, manifest.inner.micro_batch)
        helper.leader = ids[0]
        await helper.start(b, RUN)
        leader = CellLeader(workers[0], links[0], a, RUN, m.seq_len)
        yield leader, helper, b, stranger
    finally:
        for w in workers:
            w.close()
        for p in (a, b, stranger):
            await stop_p2p(p)


def _batch(manifest: Manifest, stage: int, seed: int = 0, packed: bool = False):
    """(token rows, the stage's input); packed: each row holds documents of its own."""
    g = torch.Generator().manual_seed(seed)
    m = manifest.model
    ids = torch.randint(0, m.vocab_size, (2, m.seq_len + 1), generator=g)
    c_in = torch.randn(2, m.seq_len, m.subspace_rank, generator=g) if stage else None
    if not packed:
        return TokenBatch(ids), c_in
    starts = [torch.tensor([0, 4, 17]), torch.tensor([0, 11])]
    return TokenBatch(ids, torch.stack([document_ids(m.seq_len, s) for s in starts])), c_in


def _masters(worker: StageWorker) -> list[torch.Tensor]:
    return [p.detach().clone() for p in worker.masters]


@pytest.mark.integration
@pytest.mark.parametrize(("stage", "packed"), [(0, False), (1, False), (1, True)])
async def test_a_cell_of_two_computes_what_one_replica_computes(stage, packed):
    """packed: the helper keeps each row's documents apart as the one replica does (the
    documents change the output, so a member that dropped them would not match)."""
    manifest = cell_manifest()
    tokens, c_in = _batch(manifest, stage, packed=packed)
    alone = StageWorker(manifest, stage)
    try:
        if packed:
            unpacked = alone.forward_eval(c_in, tokens.ids)
            assert not torch.allclose(alone.forward_eval(c_in, tokens), unpacked, atol=1e-3)
        c_out_ref = alone.forward("mb", c_in, tokens)
        grad_out = torch.randn_like(c_out_ref)
        grad_in_ref = alone.backward("mb", grad_out)  # one micro-batch is one inner step
        ref_after = _masters(alone)
    finally:
        alone.close()
    async with cell_of_two(manifest, stage) as (leader, helper, _, _):
        before = _masters(leader.worker)
        c_out = await leader.forward("mb", c_in, tokens)
        torch.testing.assert_close(c_out, c_out_ref, rtol=1e-4, atol=1e-5)
        grad_in = await leader.backward("mb", grad_out)
        if stage == 0:  # the head: no input to send a gradient to
            assert grad_in is None and grad_in_ref is None
        else:
            torch.testing.assert_close(grad_in, grad_in_ref, rtol=1e-4, atol=1e-5)
        after = _masters(leader.worker)
        assert leader.worker.stats.steps == 1 and leader.completed == 1
        for b, a, r in zip(before, after, ref_after, strict=True):
            assert not torch.equal(a, b)  # the step moved the weights...
            torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5)  # ...as one replica's did
        # the helper mirrors the weights it computed with, and K/V crossed the network
        assert helper.chunks == 2
        assert leader.link.bytes_sent > 0 and helper.link.bytes_sent > 0
        # the next micro-batch runs on the new version: its weights travel, and the helper's
        # replica mirrors them (its outer rounds carry the cell's weights)
        tokens2, c_in2 = _batch(manifest, stage, seed=1)
        await leader.forward("mb2", c_in2, tokens2)
        for h, a in zip(_masters(helper.worker), after, strict=True):
            assert torch.equal(h, a)
        await leader.backward("mb2", torch.randn_like(c_out))
        assert leader.worker.stats.steps == 2


@pytest.mark.integration
@pytest.mark.parametrize("packed", [False, True])
async def test_the_last_stage_as_a_cell_gives_the_loss_and_gradient_of_one_replica(packed):
    manifest = cell_manifest(stages=2)
    tokens, c_in = _batch(manifest, 1, packed=packed)
    alone = StageWorker(manifest, 1)
    try:
        loss_ref, grad_ref = alone.forward_backward_last(c_in, tokens, 0.5)
        ref_after = _masters(alone)
    finally:
        alone.close()
    async with cell_of_two(manifest, 1) as (leader, _, _, _):
        loss, grad = await leader.last(c_in, tokens, 0.5)
        assert loss == pytest.approx(loss_ref, rel=1e-5)
        torch.testing.assert_close(grad, grad_ref, rtol=1e-4, atol=1e-6)
        for a, r in zip(_masters(leader.worker), ref_after, strict=True):
            torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5)


@pytest.mark.integration
async def test_a_dead_helper_fails_the_micro_batch_at_once_and_the_leader_redoes_it_whole():
    manifest = cell_manifest()
    tokens, c_in = _batch(manifest, 1)
    async with cell_of_two(manifest, 1, timeout_s=30.0) as (leader, _, helper_p2p, stranger):
        # a stranger is refused before its request is read
        with pytest.raises(streams.RefusedError):
            await streams.request(
                stranger, helper_p2p.peer_id.to_base58(), cell_work_protocol(RUN), b"\0" * 64,
                timeout=10,
            )  # fmt: skip
        c_out = await leader.forward("mb", c_in, tokens)
        await stop_p2p(helper_p2p)  # the helper dies between forward and backward
        started = asyncio.get_running_loop().time()
        with pytest.raises(CellFailed):
            await leader.backward("mb", torch.ones_like(c_out))
        assert asyncio.get_running_loop().time() - started < 15  # not the 30 s deadline
        assert not leader.ready and leader.failed == 1
        # redone whole: the worker recomputes the forward on the same weights
        await leader.worker.call(leader.take_back, "mb")
        grad_in = await leader.worker.call(leader.worker.backward, "mb", torch.ones_like(c_out))
        assert grad_in.shape == c_in.shape and bool(torch.isfinite(grad_in).all())


@pytest.mark.parametrize("loss", [-9999.0, float("nan"), 1e5])
def test_a_helpers_loss_must_be_a_cross_entropy_share(loss: float) -> None:
    """A helper's loss of -9999 was taken (|loss| <= 1e4): the leader summed it into its
    answer, and the stage below flagged the honest leader for a negative loss."""
    from types import SimpleNamespace

    from agora_node.stages.context_parallel import ChunkLayout

    numel, width, batch = 10, 4, 2
    leader = SimpleNamespace(
        worker=SimpleNamespace(
            stage=SimpleNamespace(is_first=False, boundary_width=width),
            trainable_numel=lambda: numel,
        )
    )
    layout = ChunkLayout(16, 2)
    parse = CellLeader._parse_grads(leader, layout, batch, with_loss=True)
    zeros = torch.zeros(batch * layout.length(1) * width + numel)
    assert parse(1, cell_work.LOSS.pack(2.5) + cell_work.f32(zeros))[3] == 2.5
    with pytest.raises(ValueError, match="plausible"):
        parse(1, cell_work.LOSS.pack(loss) + cell_work.f32(zeros))


@pytest.mark.integration
@pytest.mark.parametrize("op", ["backward", "last"])
async def test_a_helpers_huge_gradients_fail_the_micro_batch_not_the_leaders_step(op, monkeypatch):
    """A helper answering with finite gradients 1000x its share (a liar, or a broken
    machine): before, they were summed into the leader's step (whose norm they then
    decided, or made non-finite so the step was skipped). Now the micro-batch fails over
    to the leader, which trains it whole, and its weights are untouched."""
    real = cell_work._answer
    monkeypatch.setattr(
        cell_work, "_answer", lambda g_in, grads: real(g_in, {n: 1e3 * g for n, g in grads.items()})
    )
    manifest = cell_manifest(stages=2 if op == "last" else 3)
    tokens, c_in = _batch(manifest, 1)
    async with cell_of_two(manifest, 1) as (leader, _, _, _):
        before = _masters(leader.worker)
        with pytest.raises(CellFailed, match="far above"):
            if op == "last":
                await leader.last(c_in, tokens, 1.0)
            else:
                c_out = await leader.forward("mb", c_in, tokens)
                await leader.backward("mb", torch.ones_like(c_out))
        assert leader.failed == 1 and not leader.ready and leader.worker.stats.steps == 0
        for b, a in zip(before, _masters(leader.worker), strict=True):
            assert torch.equal(a, b)


@pytest.mark.integration
async def test_a_helper_refuses_malformed_work_from_its_leader_and_counts_it():
    from agora_node.node.cell_leader import exchange_id
    from agora_node.node.cell_work import OP_FORWARD, RESEND, WorkRequest, encode_request
    from agora_node.stages.context_parallel import ChunkLayout

    manifest = cell_manifest()
    tokens, c_in = _batch(manifest, 1)
    async with cell_of_two(manifest, 1) as (leader, helper, helper_p2p, _):
        m, n = manifest.model, 15  # member 1's chunk of 30 positions
        good = WorkRequest(
            OP_FORWARD, b"x" * 16, 0, 1, 2, 2, 1.0, None,
            (torch.zeros(2, n, m.subspace_rank), torch.zeros(2, n, dtype=torch.long),
             torch.empty(0, dtype=torch.long)),
        )  # fmt: skip
        nan_input = dataclasses.replace(
            good, tensors=(torch.full((2, n, m.subspace_rank), float("nan")), *good.tensors[1:])
        )
        bad = {
            "no header": b"\0" * 8,
            "wrong member": encode_request(dataclasses.replace(good, rank=0)),
            "too short": encode_request(good)[:-4],
            "too long": encode_request(good) + b"\0\0\0\0",
            "non-finite input": encode_request(nan_input),
            "token outside the vocabulary": encode_request(
                dataclasses.replace(
                    good, tensors=(good.tensors[0], torch.full((2, n), 999), good.tensors[2])
                )
            ),
            "documents that skip one": encode_request(
                dataclasses.replace(good, docs=torch.arange(2 * m.seq_len).view(2, -1) % 3)
            ),
            "documents of the wrong length": encode_request(
                dataclasses.replace(good, docs=torch.zeros(2, m.seq_len - 1, dtype=torch.long))
            ),
        }
        for what, payload in bad.items():
            with pytest.raises(streams.StreamError):
                await streams.request(
                    leader.p2p, helper_p2p.peer_id.to_base58(), cell_work_protocol(RUN),
                    payload, timeout=10,
                )  # fmt: skip
            assert helper.refused["bad_request"] >= 1, what
        assert helper.refused["bad_request"] == len(bad)
        # weights it was never sent: refused, and the leader's next try ships them
        with pytest.raises(streams.StreamError):
            await streams.request(
                leader.p2p, helper_p2p.peer_id.to_base58(), cell_work_protocol(RUN),
                encode_request(dataclasses.replace(good, version=7)), timeout=10,
            )  # fmt: skip
        assert helper.refused["failed"] == 1
        assert helper.chunks == 0
        c_out = await leader.forward("mb", c_in, tokens)  # the cell still works
        assert helper.chunks == 1
        # an answer lost on the way back is sent again, not computed again
        resend = dataclasses.replace(
            good, op=OP_FORWARD | RESEND, xid=exchange_id("mb"), tensors=()
        )
        again = await streams.request(
            leader.p2p, helper_p2p.peer_id.to_base58(), cell_work_protocol(RUN),
            encode_request(resend), timeout=10,
        )  # fmt: skip
        layout = ChunkLayout(m.seq_len, 2)
        mine = layout.take(c_out, 1).contiguous()
        assert again == mine.numpy().tobytes() or torch.allclose(
            torch.frombuffer(bytearray(again), dtype=torch.float32).view_as(mine), mine
        )
        assert helper.chunks == 1


def test_a_node_takes_its_place_in_the_cells_and_a_broken_cell_forms_again_after_a_backoff():
    from agora_node.node.cell import REFORM_AFTER_S, Cells

    worker = StageWorker(cell_manifest(), 1)
    try:
        cells = Cells(worker, p2p=None, me="b", run_id=RUN, timeout_s=5.0)
        cells.regroup(["c"])  # b, c: b leads
        assert cells.role == "leader" and cells.members == ["b", "c"]
        assert cells.helper.leader is None and cells.leader.ready
        first = cells.leader
        first._broken.add("c")  # its helper failed just now
        first.broken_at = time.monotonic()
        cells.regroup(["c"])
        assert cells.leader is first and not cells.leader.ready  # whole sequences for now
        first.broken_at -= REFORM_AFTER_S[0] + 1
        cells.regroup(["c"])
        second = cells.leader
        assert second is not first and second.ready
        second._broken.add("c")  # failed again: the wait doubles
        second.broken_at = time.monotonic() - REFORM_AFTER_S[0] - 1
        cells.regroup(["c"])
        assert cells.leader is second
        second.broken_at -= REFORM_AFTER_S[0]
        cells.regroup(["c"])
        assert cells.leader is not second and cells.leader.ready
        # a peer sorting first joins: b now helps it, and accepts work from it only
        cells.regroup(["a", "c"])
        assert cells.role == "helper" and cells.members == ["a", "b"]
        assert cells.leader is None and cells.helper.leader == "a"
        assert cells.link.members == ["a", "b"] and cells.link.rank == 1
        # alone again when the others go
        cells.regroup([])
        assert cells.role == "alone" and cells.helper.leader is None
        assert cells.status()["members"] == ["b"]
    finally:
        worker.close()
