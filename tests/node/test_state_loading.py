"""A joiner's state search (state_search.load_state) and a replica's state handler, with the
network replaced by in-memory sources (real daemons: tests/integration/test_state_trust.py)."""

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from agora_node.comms import state_transfer
from agora_node.node import state_search
from agora_node.node.checkpoint import save_checkpoint
from agora_node.node.suspects import Reason, Suspects
from agora_node.node.worker import StageWorker
from agora_node.protocol import state_blob
from agora_node.protocol.records import NodeRecord
from agora_node.stages.manifest_files import load_manifest

pytestmark = pytest.mark.timeout(60)

STAGE = 1


@dataclass
class _Ctx:
    manifest: object
    data_dir: Path
    records: list[NodeRecord]
    deadline_s: float = 10.0
    peer_id: str = "me-joiner"
    host: object = field(default_factory=lambda: SimpleNamespace(p2p=None))
    suspects: Suspects = field(default_factory=Suspects)

    @property
    def config(self):
        return SimpleNamespace(state_deadline_s=self.deadline_s, refresh_s=1.0)

    async def fetch_records(self):
        return {STAGE: list(self.records)}

    def checkpoint_dir(self, stage: int) -> Path:
        return self.data_dir / f"stage-{stage}"


@pytest.fixture
def worker():
    w = StageWorker(load_manifest("tiny"), STAGE)
    try:
        yield w
    finally:
        w.close()


def _honest(worker: StageWorker, round_no: int = 6):
    g = torch.Generator().manual_seed(1)
    n = worker.trainable_numel()
    return round_no, torch.randn(n, generator=g) * 0.02, torch.randn(n, generator=g) * 1e-3


def _record(peer: str, blob_state, **kw) -> NodeRecord:
    round_no, anchor, momentum = blob_state
    a, o = state_blob.digests(anchor, momentum)
    fields = {"state": "active", "anchor_round": round_no, "anchor_digest": a, "outer_digest": o}
    fields.update(kw)
    return NodeRecord(run_id="r", peer_id=peer, stage=STAGE, **fields)


def _serve(monkeypatch, blobs: dict[str, object]):
    """fetch_state answers from `blobs`: bytes, an exception to raise, or "hang"."""
    asked: list[str] = []

    async def fetch_state(p2p, run_id, peer_id, stage, *, max_bytes, timeout, **_):
        asked.append(peer_id)
        blob = blobs[peer_id]
        if blob == "hang":
            await asyncio.sleep(3600)
        if isinstance(blob, Exception):
            raise blob
        if len(blob) > max_bytes:
            raise state_transfer.StateTransferError("over the bound")
        return {"bytes": len(blob)}, blob

    monkeypatch.setattr(state_transfer, "fetch_state", fetch_state)
    return asked


async def test_hostile_sources_are_rejected_and_the_attested_anchor_adopted(
    worker, tmp_path, monkeypatch
):
    honest = _honest(worker)
    round_no, anchor, momentum = honest
    altered = anchor.clone()
    altered[0] += 1.0
    nan = anchor.clone()
    nan[5] = float("nan")
    blobs = {
        "h-garbage": b"\x00" * 100,
        "h-nan": state_blob.encode(round_no, nan, momentum),
        "h-altered": state_blob.encode(round_no, altered, momentum),
        "h-pickle": b"PK\x03\x04" + b"x" * 1000,
        "honest-1": state_blob.encode(*honest),
        "honest-2": state_blob.encode(*honest),
    }
    # Four liars attest the honest digest (so they are tried), claim to be idle and far
    # ahead; six honest replicas are the strict majority of ten.
    liars = [
        _record(p, honest, queue=0, inner_step=10**9)
        for p in ("h-garbage", "h-nan", "h-altered", "h-pickle")
    ]
    honest_records = [_record(f"honest-{i}", honest, queue=3) for i in range(1, 7)]
    asked = _serve(monkeypatch, blobs)
    ctx = _Ctx(load_manifest("tiny"), tmp_path, liars + honest_records)
    loaded = await state_search.load_state(ctx, worker)
    assert asked == ["h-altered", "h-garbage", "h-nan", "h-pickle", "honest-1"]
    origin = loaded.origin
    assert origin["kind"] == "replica" and origin["source"] == "honest-1"
    assert set(origin["rejected"]) == {"h-garbage", "h-nan", "h-altered", "h-pickle"}
    assert origin["anchor_digest"] == state_blob.digests(anchor, None)[0]
    assert origin["momentum"] == "attested" and loaded.warming

    assert torch.equal(loaded.outer["anchor"], anchor) and loaded.outer["round"] == round_no
    weights = torch.cat([p.detach().reshape(-1) for p in worker.stage.parameters()])
    assert torch.equal(weights, anchor)  # weights := the attested anchor
    assert worker.optimizer.steps == 0  # fresh inner optimizer


async def test_a_liar_alone_against_two_honest_replicas_is_never_asked(
    worker, tmp_path, monkeypatch
):
    honest = _honest(worker)
    fake = (99, honest[1] + 1, honest[2])
    blobs = {"hostile": state_blob.encode(*fake), "p1": state_blob.encode(*honest)}
    asked = _serve(monkeypatch, {**blobs, "p2": blobs["p1"]})
    records = [_record("hostile", fake, inner_step=10**9, queue=0), _record("p1", honest)]
    records.append(_record("p2", honest))
    loaded = await state_search.load_state(_Ctx(load_manifest("tiny"), tmp_path, records), worker)
    assert asked == ["p1"] and loaded.origin["source"] == "p1"


async def test_unattested_momentum_is_reset(worker, tmp_path, monkeypatch):
    honest = _honest(worker)
    _serve(monkeypatch, {"p1": state_blob.encode(*honest), "p2": state_blob.encode(*honest)})
    records = [_record("p1", honest), _record("p2", honest, outer_digest="")]
    loaded = await state_search.load_state(_Ctx(load_manifest("tiny"), tmp_path, records), worker)
    assert loaded.origin["momentum"] == "reset"
    assert not loaded.outer["momentum"].any()


async def test_own_checkpoint_wins_unless_a_majority_attests_a_newer_round(
    worker, tmp_path, monkeypatch
):
    m = load_manifest("tiny")
    honest = _honest(worker, round_no=6)
    asked = _serve(monkeypatch, {"p1": state_blob.encode(*honest)})
    state = worker.state_dict()
    state["outer"] = {"round": 6, "anchor": honest[1], "momentum": honest[2]}
    ckpt = dict(run_id=m.run_id, stage=STAGE, step=3, state=state, peer_id="me-joiner")
    save_checkpoint(tmp_path / f"stage-{STAGE}", **ckpt)
    # The only replica claims a huge inner step at the same round: the checkpoint wins.
    records = [_record("p1", honest, inner_step=10**9)]
    loaded = await state_search.load_state(_Ctx(m, tmp_path, records), worker)
    assert loaded.origin["kind"] == "checkpoint" and asked == []
    # The only replica attests round 7: its word alone does not replace the checkpoint.
    newer = (7, honest[1], honest[2])
    blobs = {p: state_blob.encode(*newer) for p in ("p1", "p2")}
    asked = _serve(monkeypatch, blobs)
    loaded = await state_search.load_state(_Ctx(m, tmp_path, [_record("p1", newer)]), worker)
    assert loaded.origin["kind"] == "checkpoint" and asked == []
    # Two replicas attest round 7: fetched.
    records = [_record("p1", newer), _record("p2", newer)]
    loaded = await state_search.load_state(_Ctx(m, tmp_path, records), worker)
    assert loaded.origin["kind"] == "replica" and len(asked) == 1
    # A partner of when the checkpoint was saved: after a long absence its word alone is
    # believed (it trained on meanwhile; resuming the old state dragged it back).
    state["replicas"], state["saved_at"] = ["p1"], time.time() - 60  # a crash a minute ago
    save_checkpoint(tmp_path / f"stage-{STAGE}", **{**ckpt, "state": state})
    loaded = await state_search.load_state(_Ctx(m, tmp_path, [_record("p1", newer)]), worker)
    assert loaded.origin["kind"] == "checkpoint"
    state["saved_at"] = time.time() - 3600  # away an hour
    save_checkpoint(tmp_path / f"stage-{STAGE}", **{**ckpt, "state": state})
    loaded = await state_search.load_state(_Ctx(m, tmp_path, [_record("p1", newer)]), worker)
    assert loaded.origin["kind"] == "replica" and asked[-1] == "p1"


async def test_the_search_is_bounded_in_time_then_falls_back_to_init(
    worker, tmp_path, monkeypatch, caplog
):
    honest = _honest(worker)
    _serve(monkeypatch, {"p1": "hang"})
    ctx = _Ctx(load_manifest("tiny"), tmp_path, [_record("p1", honest)], deadline_s=1.0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with caplog.at_level(logging.INFO):
        loaded = await state_search.load_state(ctx, worker)
    assert loop.time() - started < 5
    assert loaded.origin["kind"] == "init" and "p1" in loaded.origin["unavailable"]
    assert "starting from the manifest's init" in caplog.text


async def test_no_majority_falls_back_to_init_after_the_deadline(worker, tmp_path, monkeypatch):
    honest = _honest(worker)
    other = (6, honest[1] + 1, honest[2])
    _serve(monkeypatch, {})
    records = [_record("p1", honest), _record("p2", other)]
    ctx = _Ctx(load_manifest("tiny"), tmp_path, records, deadline_s=1.5)
    loaded = await state_search.load_state(ctx, worker)
    assert loaded.origin["kind"] == "init" and loaded.outer is None


async def test_a_source_one_round_ahead_makes_the_joiner_read_again(worker, tmp_path, monkeypatch):
    old, new = _honest(worker, 6), _honest(worker, 7)
    new = (7, new[1] + 0.5, new[2])
    ctx = _Ctx(load_manifest("tiny"), tmp_path, [_record("p1", old), _record("p2", old)])
    reads = 0
    original = ctx.fetch_records

    async def fetch_records():
        nonlocal reads
        reads += 1
        if reads > 1:  # the directory catches up with the round that ended
            ctx.records = [_record("p1", new), _record("p2", new)]
        return await original()

    ctx.fetch_records = fetch_records
    _serve(monkeypatch, {"p1": state_blob.encode(*new), "p2": state_blob.encode(*new)})
    loaded = await state_search.load_state(ctx, worker)
    assert loaded.origin["kind"] == "replica" and loaded.outer["round"] == 7
    assert loaded.origin["rejected"] == {}


class _Stage:
    """A stage whose round moves as a test makes it (`round`), its state at round r being
    `at(r)`; `serve` answers a joiner's reads with records(stage) and its transfers with
    send(stage, peer) (bytes), noting who was asked."""

    def __init__(self, worker, round_no: int = 6) -> None:
        self.round = round_no
        self.base = _honest(worker, round_no)
        self.asked: list[str] = []
        self.delay: dict[str, float] = {}
        """Seconds a peer takes to send."""

    def at(self, round_no: int):
        return round_no, self.base[1] + 0.01 * round_no, self.base[2]

    def serve(self, ctx, monkeypatch, records, send) -> None:
        async def fetch_records():
            return {STAGE: records(self)}

        async def fetch_state(p2p, run_id, peer_id, stage, **_):
            self.asked.append(peer_id)
            await asyncio.sleep(self.delay.get(peer_id, 0.0))  # time taken: under test
            return {}, send(self, peer_id)

        ctx.fetch_records = fetch_records
        monkeypatch.setattr(state_transfer, "fetch_state", fetch_state)
        monkeypatch.setattr(state_search, "HELD_POLL_S", 0.01)


@pytest.mark.parametrize("rounds", [1, 3])
async def test_a_stage_whose_rounds_outrun_each_read_and_transfer_is_joined(
    worker, tmp_path, monkeypatch, rounds
):
    # The stage finishes `rounds` rounds between each directory read and the transfers
    # after it, and its records attest them by the next read: every state sent is ahead of
    # the records read before asking (each pass used to end in STALE).
    stage = _Stage(worker)
    ctx = _Ctx(load_manifest("tiny"), tmp_path, [], deadline_s=5.0)

    def records(s: _Stage):
        s.round += rounds
        return [_record(p, s.at(s.round - rounds)) for p in ("p1", "p2", "p3")]

    stage.serve(ctx, monkeypatch, records, lambda s, _: state_blob.encode(*s.at(s.round)))
    loaded = await state_search.load_state(ctx, worker)
    assert loaded.origin["kind"] == "replica" and loaded.outer["round"] == 6 + rounds
    assert torch.equal(loaded.outer["anchor"], stage.at(6 + rounds)[1]) and stage.asked == ["p1"]
    assert loaded.origin["momentum"] == "attested" and loaded.origin["rejected"] == {}


async def test_a_stage_that_finishes_a_round_during_each_transfer_is_joined(
    worker, tmp_path, monkeypatch
):
    # Records are current when read, but every transfer outlasts a round: each state sent
    # is of the round after the one the records attested when it was asked for.
    stage = _Stage(worker)
    ctx = _Ctx(load_manifest("tiny"), tmp_path, [], deadline_s=5.0)

    def send(s: _Stage, _peer: str) -> bytes:
        s.round += 1
        return state_blob.encode(*s.at(s.round))

    records = lambda s: [_record(p, s.at(s.round)) for p in ("p1", "p2", "p3")]  # noqa: E731
    stage.serve(ctx, monkeypatch, records, send)
    loaded = await state_search.load_state(ctx, worker)
    assert loaded.origin["kind"] == "replica" and loaded.outer["round"] == 7
    assert torch.equal(loaded.outer["anchor"], stage.at(7)[1]) and stage.asked == ["p1"]


def _moving(ctx, steps: dict[int, list[NodeRecord]], on_read=None):
    """ctx.fetch_records that shows steps[n] from the n-th read on (and calls on_read(n)
    first); returns the read count."""
    reads = [0]
    original = ctx.fetch_records

    async def fetch_records():
        reads[0] += 1
        if on_read is not None:
            on_read(reads[0])
        if reads[0] in steps:
            ctx.records = steps[reads[0]]
        return await original()

    ctx.fetch_records = fetch_records
    return reads


async def test_a_liars_far_round_is_not_kept_and_its_source_asked_for_once(
    worker, tmp_path, monkeypatch
):
    # A liar attests the majority (so it is asked, first: it claims to be idle) and sends a
    # self-consistent state of a far later round: not kept, and not asked again when the
    # stage moves on; the honest state is adopted when the records attest it.
    old, new = _honest(worker, 6), _honest(worker, 7)
    new = (7, new[1] + 0.5, new[2])
    busy = state_transfer.StateTransferError("busy")
    blobs = {"liar": state_blob.encode(10**6, old[1] + 1, old[2]), "p1": busy, "p2": busy}
    asked = _serve(monkeypatch, blobs)
    queues = (("liar", 0), ("p1", 2), ("p2", 2))
    ctx = _Ctx(load_manifest("tiny"), tmp_path, [_record(p, old, queue=q) for p, q in queues])

    def finished_round_7(n: int) -> None:  # while the joiner waited after its second read
        if n == 3:
            blobs.update(p1=state_blob.encode(*new), p2=state_blob.encode(*new))

    reads = _moving(ctx, {3: [_record(p, new, queue=q) for p, q in queues]}, finished_round_7)
    monkeypatch.setattr(state_search, "STATE_POLL_S", 0.01)
    monkeypatch.setattr(state_search, "HELD_POLL_S", 3600.0)  # kept, it would hold the search
    loaded = await state_search.load_state(ctx, worker)
    assert asked[:3] == ["liar", "p1", "p2"] and asked[3] in ("p1", "p2") and reads[0] == 3
    assert loaded.origin["source"] == asked[3] and loaded.outer["round"] == 7
    assert torch.equal(loaded.outer["anchor"], new[1])


async def test_a_slow_liar_sending_next_round_junk_is_not_asked_first_every_round(
    worker, tmp_path, monkeypatch
):
    # The liar claims to be idle (asked first), sends junk of the round after the attested
    # one and takes two of the stage's rounds doing it: by the next read the majority has
    # passed its junk, which is dropped unjudged. The honest replicas, busy the first time
    # they are asked, took less time than the liar: they are asked before it after that.
    stage = _Stage(worker)
    stage.delay["liar"] = 0.05
    ctx = _Ctx(load_manifest("tiny"), tmp_path, [], deadline_s=5.0)
    queues = (("liar", 0), ("p1", 2), ("p2", 2))

    def send(s: _Stage, peer: str) -> bytes:
        if peer == "liar":
            s.round += 2
            return state_blob.encode(s.round - 1, s.base[1] - 1, s.base[2])
        if s.asked.count(peer) == 1:
            raise state_transfer.StateTransferError("busy")
        return state_blob.encode(*s.at(s.round))

    records = lambda s: [_record(p, s.at(s.round), queue=q) for p, q in queues]  # noqa: E731
    stage.serve(ctx, monkeypatch, records, send)
    monkeypatch.setattr(state_search, "STATE_POLL_S", 0.01)
    loaded = await state_search.load_state(ctx, worker)
    # (the liar is asked again after them in the second pass, and the stage moves on)
    assert stage.asked[:3] == ["liar", "p1", "p2"] and stage.asked.count("liar") <= 2
    assert loaded.origin["source"] == stage.asked[-1] != "liar"
    got = loaded.outer["round"]
    assert got == stage.round and torch.equal(loaded.outer["anchor"], stage.at(got)[1])


def _a_liar_before_two_honest(monkeypatch, tmp_path, liar, then, now, moves_at: int):
    """A liar that claims to be idle (asked first) and sends `liar`; two honest replicas that
    send `now` and whose records (the liar copies them) attest `then`, and `now` from the
    `moves_at`-th directory read on. Returns (ctx, asked, reads)."""
    blobs = {"liar": state_blob.encode(*liar), "p1": state_blob.encode(*now)}
    asked = _serve(monkeypatch, {**blobs, "p2": blobs["p1"]})
    queues = (("liar", 0), ("p1", 2), ("p2", 2))
    ctx = _Ctx(load_manifest("tiny"), tmp_path, [_record(p, then, queue=q) for p, q in queues])
    reads = _moving(ctx, {moves_at: [_record(p, now, queue=q) for p, q in queues]})
    monkeypatch.setattr(state_search, "HELD_POLL_S", 0.01)
    return ctx, asked, reads


async def test_a_liars_next_round_stands_in_for_no_newer_honest_state(
    worker, tmp_path, monkeypatch
):
    # The honest replicas run rounds shorter than their record refreshes: asked while their
    # records attest round 6, they send round 8, and their records go from 6 to 8. The liar
    # sends junk of round 7. The honest state, fetched last, is kept and adopted.
    old, new = _honest(worker, 6), _honest(worker, 8)
    new = (8, new[1] + 0.5, new[2])
    junk = (7, old[1] + 1, old[2])
    ctx, asked, reads = _a_liar_before_two_honest(monkeypatch, tmp_path, junk, old, new, 3)
    loaded = await state_search.load_state(ctx, worker)
    assert asked == ["liar", "p1"] and reads[0] == 3
    assert loaded.origin["source"] == "p1" and loaded.outer["round"] == 8
    assert torch.equal(loaded.outer["anchor"], new[1])


async def test_a_kept_state_the_majority_attests_otherwise_rejects_its_source(
    worker, tmp_path, monkeypatch
):
    # The liar sends a state of the next round that the honest replicas then attest with
    # another digest: dropped, and the liar rejected for the rest of the search.
    old, new = _honest(worker, 6), _honest(worker, 7)
    new = (7, new[1] + 0.5, new[2])
    fake = (7, new[1] + 1, new[2])
    ctx, asked, reads = _a_liar_before_two_honest(monkeypatch, tmp_path, fake, old, new, 2)
    loaded = await state_search.load_state(ctx, worker)
    assert asked == ["liar", "p1"] and reads[0] == 2
    assert "liar" in loaded.origin["rejected"] and loaded.outer["round"] == 7
    assert torch.equal(loaded.outer["anchor"], new[1])


async def test_a_partner_one_round_past_its_record_replaces_the_checkpoint(
    worker, tmp_path, monkeypatch
):
    # A stage of two: this node's only partner trained on while it was away, and has just
    # finished a round its record does not attest yet. Held until it does; never the
    # old checkpoint meanwhile.
    old, mid, new = _honest(worker, 6), _honest(worker, 8), _honest(worker, 9)
    mid = (8, mid[1] + 0.25, mid[2])
    new = (9, new[1] + 0.5, new[2])
    m = load_manifest("tiny")
    state = worker.state_dict()
    state["outer"] = {"round": 6, "anchor": old[1], "momentum": old[2]}
    state["replicas"], state["saved_at"] = ["p1"], time.time() - 3600  # away an hour
    ckpt = dict(run_id=m.run_id, stage=STAGE, step=3, state=state, peer_id="me-joiner")
    save_checkpoint(tmp_path / f"stage-{STAGE}", **ckpt)
    _serve(monkeypatch, {"p1": state_blob.encode(*new)})
    ctx = _Ctx(m, tmp_path, [_record("p1", mid)])
    reads = _moving(ctx, {4: [_record("p1", new)]})  # the record catches up a few reads later
    monkeypatch.setattr(state_search, "HELD_POLL_S", 0.01)
    loaded = await state_search.load_state(ctx, worker)
    assert loaded.origin["kind"] == "replica" and loaded.outer["round"] == 9 and reads[0] == 4
    assert torch.equal(loaded.outer["anchor"], new[1])


def _checkpoint_at(worker, tmp_path, state_at) -> None:
    """This node's own checkpoint, of outer state `state_at` (round, anchor, momentum)."""
    m = load_manifest("tiny")
    state = worker.state_dict()
    state["outer"] = dict(zip(("round", "anchor", "momentum"), state_at, strict=True))
    save_checkpoint(
        tmp_path / f"stage-{STAGE}",
        run_id=m.run_id,
        stage=STAGE,
        step=3,
        state=state,
        peer_id="me-joiner",
    )


async def test_a_checkpoint_holder_reads_again_while_newer_replicas_are_a_round_apart(
    worker, tmp_path, monkeypatch
):
    # A stage of three: the two others trained on while this node was away and are caught
    # mid-change (one attests round 8, the other still round 7): no strict majority at
    # the first read. Not the old checkpoint: it reads again and adopts round 8.
    old, r7, r8 = _honest(worker, 6), _honest(worker, 7), _honest(worker, 8)
    r7, r8 = (7, r7[1] + 0.25, r7[2]), (8, r8[1] + 0.5, r8[2])
    _checkpoint_at(worker, tmp_path, old)
    _serve(monkeypatch, {"p1": state_blob.encode(*r8), "p2": state_blob.encode(*r8)})
    ctx = _Ctx(load_manifest("tiny"), tmp_path, [_record("p1", r8), _record("p2", r7)])
    reads = _moving(ctx, {2: [_record("p1", r8), _record("p2", r8)]})
    monkeypatch.setattr(state_search, "STATE_POLL_S", 0.01)
    loaded = await state_search.load_state(ctx, worker)
    assert loaded.origin["kind"] == "replica" and loaded.outer["round"] == 8 and reads[0] == 2
    assert torch.equal(loaded.outer["anchor"], r8[1])


async def test_a_checkpoint_holder_resumes_it_when_the_stage_stays_split(
    worker, tmp_path, monkeypatch
):
    # The two others attest different states for good (or a stranger attests a far round
    # alone): SPLIT_READS reads, then the own checkpoint; nobody is asked for bytes.
    old, r7 = _honest(worker, 6), _honest(worker, 7)
    other = (7, r7[1] + 1, r7[2])
    _checkpoint_at(worker, tmp_path, old)
    asked = _serve(monkeypatch, {})
    ctx = _Ctx(load_manifest("tiny"), tmp_path, [_record("p1", r7), _record("p2", other)])
    reads = _moving(ctx, {})
    monkeypatch.setattr(state_search, "STATE_POLL_S", 0.01)
    loaded = await state_search.load_state(ctx, worker)
    assert loaded.origin["kind"] == "checkpoint" and asked == []
    assert reads[0] == state_search.SPLIT_READS
    # split, but neither newer than the checkpoint: resumed at the first read
    ctx = _Ctx(
        load_manifest("tiny"), tmp_path, [_record("p1", old), _record("p2", (6, *other[1:]))]
    )
    reads = _moving(ctx, {})
    loaded = await state_search.load_state(ctx, worker)
    assert loaded.origin["kind"] == "checkpoint" and reads[0] == 1


# ---- the replica's side ---------------------------------------------------------------


async def test_concurrent_joiners_cost_one_serialization_per_round(monkeypatch):
    from agora_node.node.outer_state import OuterState
    from agora_node.node.rounds import OuterRounds

    state = OuterState(torch.nn.Linear(8, 8), lr=0.7, momentum=0.9)
    announced: list[int] = []  # the node publishes its record on each (daemon.attested)
    rounds = OuterRounds(
        SimpleNamespace(state=state),
        None,
        inner_steps=1,
        replica_rounds=list,
        replica_count=lambda: 1,
        on_attested=lambda: announced.append(rounds.attested.round),
    )
    encodes = []
    real = state_blob.encode

    def counting(*args):
        encodes.append(args[0])
        return real(*args)

    monkeypatch.setattr(state_blob, "encode", counting)
    results = await asyncio.gather(*(rounds.transfer_blob() for _ in range(8)))
    assert encodes == [0] and len({id(blob) for _, blob, _ in results}) == 1
    assert announced == [0]
    attested, blob, _ = results[0]
    assert attested == rounds.attested and attested.anchor == state.digest()
    assert attested.outer == state.digest(with_momentum=True)
    # A round ends: the next request serializes the new state once.
    state.anchor = state.anchor + 1
    state.round = state.anchor_round = 1  # what OuterState.step sets
    rounds._epoch += 1
    await asyncio.gather(*(rounds.transfer_blob() for _ in range(3)))
    assert encodes == [0, 1] and rounds.attested.anchor == state.digest()
    assert announced == [0, 1]


async def test_a_replica_restarting_from_its_weights_attests_and_serves_the_new_anchor():
    # A cell helper whose cell is gone restarts its anchor from its weights: its record and
    # what it sends a joiner must change together (the old attestation with the new anchor
    # made every joiner reject this honest replica).
    from agora_node.node.outer_state import OuterState
    from agora_node.node.rounds import OuterRounds

    state = OuterState(torch.nn.Linear(8, 8), lr=0.7, momentum=0.9)

    def reset_to_weights() -> None:
        state.anchor = state.anchor + 1

    async def call(fn, *args):
        return fn(*args)

    announced: list[int] = []
    rounds = OuterRounds(
        SimpleNamespace(state=state, reset_to_weights=reset_to_weights),
        SimpleNamespace(call=call),
        inner_steps=1,
        replica_rounds=list,
        replica_count=lambda: 1,
        on_attested=lambda: announced.append(rounds.attested.round),
    )
    before, _, _ = await rounds.transfer_blob()
    await rounds.restart_from_weights()
    after, blob, _ = await rounds.transfer_blob()
    assert after.anchor == state.digest() != before.anchor and announced == [0, 0]
    assert rounds.attested == after
    assert state_blob.decode(blob, state.anchor.numel()).digests()[0] == after.anchor


class _FakeStream:
    def __init__(self, request: bytes, hold: asyncio.Event | None = None) -> None:
        from agora_node.comms import streams

        self.reader = asyncio.StreamReader()
        self.reader.feed_data(streams.KIND_DATA + len(request).to_bytes(8, "big") + request)
        self.sent = bytearray()
        self.hold = hold

    def write(self, data) -> None:  # noqa: ANN001
        self.sent += bytes(data)

    async def drain(self) -> None:
        if self.hold is not None:
            await self.hold.wait()

    def close(self) -> None:
        pass


async def test_state_handler_one_transfer_per_peer_and_a_send_deadline():
    import json

    from agora_node.comms import streams

    handlers = {}

    class _P2P:
        async def add_binary_stream_handler(self, name, on_stream):  # noqa: ANN001
            handlers[name] = on_stream

    @contextlib.asynccontextmanager
    async def provider(stage: int):
        yield {"stage": stage}, b"x" * (3 * streams.CHUNK)

    await state_transfer.serve_state(_P2P(), "run", provider, deadline_s=0.5)
    (on_stream,) = handlers.values()
    peer = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "peer-A"))
    request = json.dumps({"stage": 1}).encode()
    hold = asyncio.Event()  # the first joiner reads nothing: its drain blocks
    first = _FakeStream(request, hold)
    task = asyncio.create_task(on_stream(peer, first.reader, first))
    deadline = time.monotonic() + 5
    while not first.sent:  # poll under a deadline: the first transfer has begun
        assert time.monotonic() < deadline, "the first transfer never started"
        await asyncio.sleep(0.01)
    second = _FakeStream(request)
    await on_stream(peer, second.reader, second)
    assert second.sent[:1] == streams.KIND_ERROR and b"peer_streams" in second.sent
    await asyncio.wait_for(task, 5)  # cut by the send deadline, not left hanging
    assert streams.KIND_END not in first.sent[-9:-8]
    third = _FakeStream(request)  # the slot is free again
    await on_stream(peer, third.reader, third)
    assert third.sent[-9:-8] == streams.KIND_END


async def test_a_busy_source_is_asked_again_a_liar_is_not(worker, tmp_path, monkeypatch):
    honest = _honest(worker)
    good = state_blob.encode(*honest)
    answers = {"busy": [state_transfer.StateTransferError("busy"), good], "liar": [b"junk"]}
    asked = []

    async def fetch_state(p2p, run_id, peer_id, stage, *, max_bytes, timeout, **_):
        asked.append(peer_id)
        answer = answers[peer_id].pop(0) if len(answers[peer_id]) > 1 else answers[peer_id][0]
        if isinstance(answer, Exception):
            raise answer
        return {}, answer

    monkeypatch.setattr(state_transfer, "fetch_state", fetch_state)
    records = [_record("busy", honest, queue=1), _record("liar", honest, queue=0)]
    records.append(_record("third", honest, state="warming", anchor_digest=""))
    loaded = await state_search.load_state(_Ctx(load_manifest("tiny"), tmp_path, records), worker)
    assert asked == ["liar", "busy", "busy"]
    assert loaded.origin["source"] == "busy" and set(loaded.origin["rejected"]) == {"liar"}
    assert set(loaded.origin["unavailable"]) == {"busy"}


async def test_a_banned_replica_is_never_asked_for_state(worker, tmp_path, monkeypatch):
    honest = _honest(worker)
    blobs = {p: state_blob.encode(*honest) for p in ("banned", "honest-1", "honest-2")}
    records = [_record("banned", honest, queue=0), _record("honest-1", honest, queue=5)]
    records.append(_record("honest-2", honest, queue=5))
    asked = _serve(monkeypatch, blobs)
    ctx = _Ctx(load_manifest("tiny"), tmp_path, records)
    ctx.suspects.flag("banned", Reason.MISMATCH, "test")
    loaded = await state_search.load_state(ctx, worker)
    assert "banned" not in asked and loaded.origin["source"].startswith("honest")


async def test_a_liar_that_claims_to_be_idle_and_then_stalls_costs_only_its_share(
    worker, tmp_path, monkeypatch
):
    # It attests the (public) majority digest and claims an empty queue, so it is asked
    # first; it then sends nothing. The search goes on to the honest replicas within its
    # share of the deadline instead of spending the whole deadline on it.
    honest = _honest(worker)
    good = state_blob.encode(*honest)
    asked = _serve(monkeypatch, {"staller": "hang", "p1": good, "p2": good})
    records = [_record("staller", honest, queue=0), _record("p1", honest, queue=2)]
    records.append(_record("p2", honest, queue=2))
    # tiny's stage-1 state at GOOD_STATE_RATE: 2 s; a third of the deadline is more
    ctx = _Ctx(load_manifest("tiny"), tmp_path, records, deadline_s=12.0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    loaded = await state_search.load_state(ctx, worker)
    assert loop.time() - started < 6  # its share (4 s), not the 12 s deadline
    assert asked == ["staller", "p1"]
    assert loaded.origin["kind"] == "replica" and loaded.origin["source"] == "p1"
    assert "staller" in loaded.origin["unavailable"]


async def test_a_source_that_could_not_send_is_asked_after_the_others_next_pass(
    worker, tmp_path, monkeypatch
):
    honest = _honest(worker)
    good = state_blob.encode(*honest)
    records = [_record("first", honest, queue=0)]
    ctx = _Ctx(load_manifest("tiny"), tmp_path, records)
    asked: list[str] = []

    async def fetch_state(p2p, run_id, peer_id, stage, *, max_bytes, timeout, **_):
        asked.append(peer_id)
        if peer_id == "first":  # claims to be idle, never sends; meanwhile a replica joins
            ctx.records.append(_record("joined", honest, queue=1))
            raise state_transfer.StateTransferError("busy")
        return {"bytes": len(good)}, good

    monkeypatch.setattr(state_transfer, "fetch_state", fetch_state)
    monkeypatch.setattr(state_search, "STATE_POLL_S", 0.01)
    loaded = await state_search.load_state(ctx, worker)
    # pass 2: the replica not yet asked before the one that failed, whatever it claims
    assert asked == ["first", "joined"]
    assert loaded.origin["source"] == "joined"


def test_a_replica_sends_its_state_only_to_peers_with_a_record_at_its_stage():
    from agora_node.node.service import state_refuser

    joiners, counted = {"joiner"}, []
    refuse = state_refuser(None, joiners.__contains__, lambda *labels: counted.append(labels))
    assert refuse("joiner") is None
    assert "no record of" in refuse("stranger")  # refused before anything is read
    assert counted == [("state", "no_record")]
    listed = state_refuser(
        lambda peer: None if peer == "listed" else "not listed", joiners.__contains__
    )
    assert listed("joiner") == "not listed"  # a private swarm's refusal comes first
    assert state_refuser(None, None) is None  # nothing to check: served as before


async def test_a_slow_honest_source_gets_the_time_its_state_takes_at_a_good_rate(
    worker, tmp_path, monkeypatch
):
    # Two sources, a 3 s deadline: a share is 1.5 s, but tiny's stage-1 state at
    # GOOD_STATE_RATE takes 2 s, and the first source (1.75 s) is given that, not cut off.
    honest = _honest(worker)
    good = state_blob.encode(*honest)
    asked: list[str] = []

    async def fetch_state(p2p, run_id, peer_id, stage, *, max_bytes, timeout, **_):
        asked.append(peer_id)
        await asyncio.sleep(1.75)
        return {"bytes": len(good)}, good

    monkeypatch.setattr(state_transfer, "fetch_state", fetch_state)
    records = [_record("p1", honest, queue=0), _record("p2", honest, queue=1)]
    ctx = _Ctx(load_manifest("tiny"), tmp_path, records, deadline_s=3.0)
    assert 1.8 < state_blob.max_bytes(worker.trainable_numel()) / state_search.GOOD_STATE_RATE < 3.0
    loaded = await state_search.load_state(ctx, worker)
    assert asked == ["p1"] and loaded.origin["source"] == "p1"


async def test_slow_joiners_hold_two_copies_of_the_state_and_none_is_cut():
    """Each transfer held its own copy (four slow joiners in four rounds held four). Two
    copies at most now: a third is answered busy until one transfer ends, and a running
    transfer is never cut for a newer state (a stranger asking once a round would have cut
    every slow joiner's)."""
    from agora_node.node.outer_state import OuterState
    from agora_node.node.rounds import OuterRounds

    state = OuterState(torch.nn.Linear(8, 8), lr=0.7, momentum=0.9)
    rounds = OuterRounds(
        SimpleNamespace(state=state), None, inner_steps=1, replica_rounds=list,
        replica_count=lambda: 1,
    )  # fmt: skip

    def next_round() -> None:  # what a round does to the state and to Rounds
        state.anchor = state.anchor + 1
        state.round = state.anchor_round = state.round + 1
        rounds._state_changed()

    async with contextlib.AsyncExitStack() as held:
        first = await held.enter_async_context(rounds.lend_blob())
        again = await held.enter_async_context(rounds.lend_blob())  # same state: same copy
        assert again[1] is first[1]
        next_round()
        second = await held.enter_async_context(rounds.lend_blob())
        assert second[0].round == 1 and second[1] is not first[1]
        next_round()
        with pytest.raises(state_transfer.StateTransferError, match="busy"):
            await rounds.transfer_blob()  # a third copy: refused, nothing cut
        assert first[1] and second[1]
    # the transfers ended: the newest state is lent again
    async with rounds.lend_blob() as (attested, blob, _):
        assert attested.round == 2 and state_blob.decode(blob, state.numel).round == 2
    assert not rounds._lent


async def test_a_broken_transfer_gives_its_copy_back_at_once():
    """The handler's generator was left to the garbage collector when its stream broke:
    a lent copy stayed counted (and held) until then."""
    import json

    from agora_node.comms import streams

    handlers, lent = {}, []

    class _P2P:
        async def add_binary_stream_handler(self, name, on_stream):  # noqa: ANN001
            handlers[name] = on_stream

    @contextlib.asynccontextmanager
    async def provider(stage: int):
        lent.append(stage)
        try:
            yield {"stage": stage}, b"x" * (3 * streams.CHUNK)
        finally:
            lent.remove(stage)

    class _Broken(_FakeStream):
        async def drain(self) -> None:
            if len(self.sent) > streams.CHUNK:
                raise ConnectionResetError("the joiner went away")

    await state_transfer.serve_state(_P2P(), "run", provider, deadline_s=30)
    (on_stream,) = handlers.values()
    peer = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "peer-A"))
    broken = _Broken(json.dumps({"stage": 1}).encode())
    await on_stream(peer, broken.reader, broken)  # (no task switch before the check)
    assert streams.KIND_END not in broken.sent[-9:-8] and lent == []
