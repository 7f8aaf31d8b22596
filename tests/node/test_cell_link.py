"""A context-parallel cell over real hivemind peers on 127.0.0.1: two members exchange
K/V frames through libp2p and compute what one peer computes; a stranger's frames are
refused before they are read; a silent member fails the micro-batch at the deadline."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import os
import time

import pytest
import torch

from agora_node.comms import streams
from agora_node.comms.cell_link import CellLink, CellTimeout
from agora_node.protocol.names import cell_protocol
from agora_node.stages.context_parallel import CellContext, ChunkLayout
from agora_node.stages.kv_frames import FramedExchange
from agora_node.stages.manifest_files import load_manifest
from agora_node.stages.model import AttentionContext, Stage
from tests.p2p_peers import start_peers, stop_p2p

pytestmark = [pytest.mark.timeout(90), pytest.mark.integration]
RUN = "cell-test"


@contextlib.asynccontextmanager
async def peers(n: int):
    started = await start_peers(n)
    try:
        yield started
    finally:
        for p in started:
            await stop_p2p(p)


def small_stage(kv_rank: int, kv_tokens: bool = False) -> Stage:
    m = load_manifest("tiny")
    model = dataclasses.replace(
        m.model, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, seq_len=30,
        subspace_rank=0, kv_rank=kv_rank, kv_subspaces=3, kv_tokens=kv_tokens,
    )  # fmt: skip
    manifest = dataclasses.replace(m, model=model, stages=dataclasses.replace(m.stages, count=1))
    torch.manual_seed(0)
    stage = Stage(manifest, 0)
    with torch.no_grad():  # token tables start at zero, where they would go unchecked
        for name, p in stage.named_parameters():
            if name.endswith("kv_mix.tokens"):
                p.normal_()
    return stage


@pytest.mark.parametrize(("kv_rank", "kv_tokens"), [(0, False), (4, False), (4, True)])
async def test_two_members_over_libp2p_compute_what_one_peer_computes(kv_rank, kv_tokens):
    stage = small_stage(kv_rank, kv_tokens)
    batch = torch.randint(0, 256, (2, 31))
    tokens, targets = batch[:, :-1], batch[:, 1:]
    single = copy.deepcopy(stage)
    ref = torch.nn.functional.cross_entropy(single(None, tokens).flatten(0, 1), targets.flatten())
    ref.backward()
    layout = ChunkLayout(30, 2)
    async with peers(2) as (a, b):
        ids = [a.peer_id.to_base58(), b.peer_id.to_base58()]
        links = [
            CellLink(p, RUN, members=ids, me=me, timeout_s=20)
            for p, me in zip((a, b), ids, strict=True)
        ]
        for link in links:
            await link.start()
        mb_id = os.urandom(16)

        def member(rank: int):
            replica = copy.deepcopy(stage)
            exchange = FramedExchange(links[rank].exchange(mb_id))
            ctx = AttentionContext(cell=CellContext(layout, exchange))
            logits = replica(None, layout.take(tokens, rank), ctx)
            loss = (
                torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), layout.take(targets, rank).flatten(), reduction="sum"
                )
                / targets.numel()
            )
            loss.backward()
            return loss.item(), {n: p.grad for n, p in replica.named_parameters()}

        results = await asyncio.gather(*(asyncio.to_thread(member, r) for r in range(2)))
    assert sum(r[0] for r in results) == pytest.approx(ref.item(), rel=1e-5)
    for name, p in single.named_parameters():
        torch.testing.assert_close(results[0][1][name] + results[1][1][name], p.grad, msg=name)
    # forward and backward frames of 2 layers each way crossed the network
    assert all(link.bytes_sent > 0 for link in links)
    assert all(not link.refused for link in links)


async def test_a_stranger_is_refused_and_a_silent_member_fails_the_exchange_in_time():
    async with peers(3) as (a, b, stranger):
        ids = [a.peer_id.to_base58(), b.peer_id.to_base58()]
        link = CellLink(a, RUN, members=ids, me=ids[0], timeout_s=2.0)
        await link.start()
        with pytest.raises(streams.RefusedError):
            await streams.request(stranger, ids[0], cell_protocol(RUN), b"\0" * 64, timeout=10)
        assert link.refused["not_member"] == 1
        # b never serves the protocol: a's push fails and nothing arrives; no hang
        exchange = link.exchange(os.urandom(16))
        started = time.monotonic()
        with pytest.raises(CellTimeout):
            await asyncio.to_thread(exchange.all_to_all, [torch.zeros(4, dtype=torch.uint8)] * 2)
        assert time.monotonic() - started < 10
        with pytest.raises(RuntimeError, match="compute thread"):
            exchange.all_to_all([torch.zeros(4, dtype=torch.uint8)] * 2)


async def test_one_member_pushing_frames_nobody_takes_fills_only_its_share(monkeypatch) -> None:  # noqa: ANN001
    """main held up to 256 frames of 64 MiB from any member (16 GiB); now each member may
    hold its share of the frames and bytes, and the others' frames still get in."""
    from agora_node.comms import cell_link
    from agora_node.comms.cell_link import _HEADER

    async with peers(3) as (a, b, c):
        ids = [p.peer_id.to_base58() for p in (a, b, c)]
        link = CellLink(a, RUN, members=ids, me=ids[0], max_inbox=8, max_inbox_bytes=8192)
        monkeypatch.setattr(cell_link, "MIN_FRAMES_EACH", 1)  # 8 frames in all: 4 each
        await link.start()
        mb_id = os.urandom(16)

        async def push(p2p, seq: int, size: int) -> None:  # noqa: ANN001
            payload = _HEADER.pack(mb_id, seq) + b"\0" * size
            await streams.request(p2p, ids[0], cell_protocol(RUN), payload, timeout=10)

        for seq in range(4):  # b's share: 8 // 2 frames
            await push(b, seq, 16)
        with pytest.raises(streams.StreamError):
            await push(b, 4, 16)
        await push(c, 0, 4000)  # c's share of bytes is 8192 // 2
        with pytest.raises(streams.StreamError):
            await push(c, 1, 100)
        assert link.refused["full"] == 2
        assert link._take(ids[1], mb_id, 0, time.monotonic() + 1) == b"\0" * 16
        await push(b, 4, 16)  # room again once a frame is taken
