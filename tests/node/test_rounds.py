"""The outer-round schedule (node/rounds.py) and the one-writer rule for stage weights."""

import asyncio
import dataclasses
import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agora_node.comms.collective import LocalNetwork, MatchmakingConfig, MemoryBoard
from agora_node.node.outer import OuterLoop
from agora_node.node.outer_state import OuterConfig
from agora_node.node.rounds import (
    ASK_EVERY,
    MAX_ROUND,
    MAX_SOLE_JUMP,
    OuterRounds,
    outvoted,
    round_should_end,
    target_round,
)
from agora_node.node.worker import StageWorker, WorkerWeights
from agora_node.protocol import state_blob
from agora_node.protocol.identity import Identity
from agora_node.protocol.records import MAX_STEP
from agora_node.stages.manifest_files import load_manifest
from tests.outer.helpers import LOCAL

pytestmark = pytest.mark.timeout(120)


def test_target_round_catches_up_and_never_goes_back():
    assert target_round(3, [5, 5, 2]) == 5  # two of three others are at 5
    assert target_round(3, [6, 5, 5, 5]) == 5
    assert target_round(3, [4]) == 4  # one other: its word is all there is
    assert target_round(3, []) == 3
    assert target_round(3, [0, 1]) == 3


def test_one_replica_lying_about_its_round_moves_nobody():
    """Catch-up follows what a strict majority of the other replicas announce, not the
    largest claim (main jumped every replica to 10**9 on one record)."""
    assert target_round(3, [3, 3, 3, 10**9]) == 3
    assert target_round(3, [4, 4, 10**9]) == 4
    assert target_round(3, [10**9, 10**9, 4, 4, 4]) == 4  # two liars of five
    assert target_round(3, [3, -7, True, 2.5, 10**9, 3]) == 3  # junk values are ignored
    # never to the records' limit, however many say it (records no probe answered come as
    # 0: two of them no longer make a majority, StageService's replica_rounds)
    assert target_round(3, [MAX_STEP, MAX_STEP]) == MAX_ROUND
    assert target_round(3, [MAX_STEP, 0, 0]) == 3
    assert target_round(3, [MAX_STEP]) == 3 + MAX_SOLE_JUMP


def test_the_only_other_replica_moves_this_one_a_bounded_step():
    """A stage of two: the other replica's round is followed, but one (a stranger)
    announcing a round near the records' limit moved the honest one there, and its next
    records were out of range for every reader."""
    assert target_round(3, [4]) == 4
    assert target_round(3, [MAX_STEP]) == 3 + MAX_SOLE_JUMP
    assert target_round(3 + MAX_SOLE_JUMP, [MAX_STEP]) == 3 + 2 * MAX_SOLE_JUMP
    assert target_round(10, [MAX_STEP, 11]) == 11  # two others: the lower of the two


@pytest.mark.parametrize(
    ("done", "opened", "expected"),
    [(0, False, False), (0, True, False), (1, False, False), (1, True, True), (4, False, True)],
)
def test_round_ends_after_h_steps_or_once_opened_elsewhere(done, opened, expected):
    assert round_should_end(done, 4, opened) is expected


async def test_weights_are_written_on_the_worker_thread_only():
    worker = StageWorker(load_manifest("tiny"), 1)
    try:
        version = worker.version
        async with worker.frozen() as weights:
            flat = await weights.read()
            await weights.write(flat + 1.0)
        assert worker.version == version + 1  # new forwards see the outer step's weights
        async with worker.frozen() as weights:
            torch.testing.assert_close(await weights.read(), flat + 1.0)
        with pytest.raises(RuntimeError, match="worker thread only"):
            WorkerWeights(worker)._load(flat)  # from the event loop's thread: refused
        assert threading.current_thread() is not worker._thread
    finally:
        worker.close()


def _replica(
    i: int, network: LocalNetwork, board: MemoryBoard, window: float = 0.5
) -> tuple[StageWorker, OuterLoop]:
    worker = StageWorker(load_manifest("tiny"), 1)
    ident = Identity(Ed25519PrivateKey.from_private_bytes(bytes([i + 1]) * 32))
    config = OuterConfig(
        group_size=0,
        codec="fp32",
        block=64,
        deadlines=LOCAL,
        matchmaking=MatchmakingConfig(window=window, settle=0.1, poll_interval=0.02),
    )
    outer = OuterLoop(
        worker.stage,
        ident,
        run_id="run",
        stage=1,
        config=config,
        book=network.join(ident.peer_id),
        transport=network.transport(ident.peer_id),
        board=board,
    )
    return worker, outer


async def _until(condition, tasks, what: str, timeout: float = 30.0) -> None:
    """Poll `condition` under a deadline; a rounds loop in `tasks` that ended fails at once."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what() if callable(what) else what
        assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
        await asyncio.sleep(0.005)  # polling interval of a deadline-bounded wait


async def _rounds_started(rounds, tasks) -> None:
    """Until every loop has begun its first round: it read the step counters, then
    attested its anchor (round 0's digest is noted)."""
    await _until(lambda: all(0 in r.anchor_digests for r in rounds), tasks, "a loop never started")


async def test_a_replica_behind_joins_the_round_another_opened():
    """Replica A has done its H inner steps, B only one: B ends its round with A's,
    and both leave the round with the same anchor."""
    network, board = LocalNetwork(), MemoryBoard()
    replicas = [_replica(i, network, board) for i in range(2)]
    stop = asyncio.Event()
    rounds = [
        OuterRounds(
            outer, worker, inner_steps=4, replica_rounds=list, replica_count=lambda: 2, poll_s=0.02
        )
        for worker, outer in replicas
    ]
    tasks = [asyncio.create_task(r.run(stop)) for r in rounds]
    try:
        (wa, _), (wb, _) = replicas
        await _rounds_started(rounds, tasks)
        wb.optimizer.steps += 1  # stand-ins for inner steps: the schedule only counts them
        wa.optimizer.steps += 4
        both_ended = lambda: all(1 in r.anchor_digests for r in rounds)  # noqa: E731
        await _until(both_ended, tasks, lambda: [r.round for r in rounds], timeout=60)
        assert rounds[0].anchor_digests[1] == rounds[1].anchor_digests[1]
        assert all(r.outer.last_report.participants == 2 for r in rounds)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for worker, outer in replicas:
            await outer.close()
            worker.close()


async def test_a_replica_alone_in_its_stage_never_asks_the_dht_whether_its_round_opened():
    """Nobody else can open a lone replica's round: its polls cost DHT reads and nothing
    else. It still ends its rounds every H steps; with a second replica it asks again."""
    network, board = LocalNetwork(), MemoryBoard()
    worker, outer = _replica(0, network, board)
    asked = []

    async def opened_elsewhere(expect=None) -> bool:
        asked.append(expect)
        return False

    outer.opened_elsewhere = opened_elsewhere
    count, polls = [1], [0]

    def replica_count() -> int:  # asked at every poll (the resync check)
        polls[0] += 1
        return count[0]

    rounds = OuterRounds(
        outer, worker, inner_steps=2, replica_rounds=list, replica_count=replica_count,
        poll_s=0.01,
    )  # fmt: skip
    stop = asyncio.Event()
    task = asyncio.create_task(rounds.run(stop))
    try:
        await _rounds_started([rounds], [task])
        worker.optimizer.steps += 1  # one step of 2: polls go on until the second
        until = polls[0] + 3 * ASK_EVERY  # polls in which a replica with company asks twice
        await _until(lambda: polls[0] >= until, [task], "the rounds loop stopped polling")
        assert asked == []
        worker.optimizer.steps += 1
        ended = lambda: 1 in rounds.anchor_digests  # noqa: E731
        await _until(ended, [task], "the lone replica never ended its round")
        assert asked == []
        count[0] = 2  # a second replica joined the stage
        worker.optimizer.steps += 1
        await _until(lambda: asked, [task], "a replica with company never asked")
    finally:
        stop.set()
        await asyncio.gather(task, return_exceptions=True)
        await outer.close()
        worker.close()


async def test_a_caught_up_replica_attests_the_round_that_made_its_anchor():
    """Catch-up moves the round counter, not the anchor: the attestation and the state a
    joiner is sent keep naming the anchor's own round (in one CI run a caught-up replica
    attested round 2 for its round-1 anchor, and a joiner adopted it as round 2's)."""
    network, board = LocalNetwork(), MemoryBoard()
    worker, outer = _replica(0, network, board)
    others = [0]
    rounds = OuterRounds(
        outer, worker, inner_steps=4, replica_rounds=lambda: others, replica_count=lambda: 2
    )
    try:
        before = await rounds.attest()
        assert (before.round, rounds.anchor_digests) == (0, {0: before.anchor})
        others[:] = [2]
        assert rounds._catch_up() and rounds.round == 2
        after = await rounds.attest()
        assert after == before  # same anchor, same round: no claim about round 2
        attested, blob, _ = await rounds.transfer_blob()
        assert attested == before
        assert state_blob.decode(blob, outer.state.numel).round == 0
        assert rounds.anchor_digests == {0: before.anchor}
    finally:
        await outer.close()
        worker.close()


async def test_one_other_replicas_word_moves_this_one_once_per_round_ended():
    """A stranger, the only other replica, announcing a round near the records' limit:
    the round loop asks again at once after a catch-up, and each ask jumped another
    MAX_SOLE_JUMP rounds, a million a second with no round ended on the way."""
    network, board = LocalNetwork(), MemoryBoard()
    worker, outer = _replica(0, network, board)
    others = [MAX_STEP]
    rounds = OuterRounds(
        outer, worker, inner_steps=4, replica_rounds=lambda: others, replica_count=lambda: 2
    )
    try:
        assert rounds._catch_up() and rounds.round == MAX_SOLE_JUMP
        assert not rounds._catch_up() and rounds.round == MAX_SOLE_JUMP
        outer.state.round += 1  # a round ended (as OuterLoop's end_round counts it)
        outer.totals["rounds"] += 1
        assert rounds._catch_up() and rounds.round == 2 * MAX_SOLE_JUMP + 1
        # near rounds in between open no way to the next far jump: a round must end
        others[:] = [rounds.round + 2]
        assert rounds._catch_up() and rounds.round == 2 * MAX_SOLE_JUMP + 3
        others[:] = [MAX_STEP]
        assert not rounds._catch_up()
        others[:] = [10**9, 10**9 + 1]  # two replicas agree: at once, however far
        assert rounds._catch_up() and rounds.round == 10**9
        others[:] = [10**9 + 1]  # the only partner moved on: followed at once, again
        assert rounds._catch_up() and rounds.round == 10**9 + 1
        others[:] = [10**9 + 2]
        assert rounds._catch_up() and rounds.round == 10**9 + 2
    finally:
        await outer.close()
        worker.close()


async def test_outer_writes_while_forwards_run_never_touch_their_weight_copies():
    """Forwards go on while the worker is frozen; the outer step's weights must land in the
    master parameters, never in the version copies a forward swapped into the module
    (found in a demo: backward failed with 'modified by an inplace operation')."""
    m = load_manifest("tiny")
    worker = StageWorker(m, 0)
    tokens = torch.randint(0, m.model.vocab_size, (2, m.model.seq_len + 1))
    stop = asyncio.Event()

    async def forwards() -> int:
        n = 0
        while not stop.is_set():
            await worker.call(worker.forward, f"mb{n}", None, tokens)
            n += 1
        return n

    try:
        task = asyncio.create_task(forwards())
        for _ in range(20):  # each entry builds WorkerWeights while a forward may be running
            async with worker.frozen() as weights:
                await weights.write(await weights.read() * 0.999)
        stop.set()
        n = await task
        grad = torch.ones(2, m.model.seq_len, m.model.subspace_rank)
        for i in range(n):  # every kept graph still backpropagates through its own copy
            await worker.call(worker.backward, f"mb{i}", grad)
    finally:
        worker.close()


async def test_an_overlapped_outer_step_keeps_the_inner_progress_made_during_the_mix():
    """With overlap the mixes run while inner steps go on: the new anchor lands with the
    progress made since the round's end added to it, under one short freeze."""
    from agora_node.node.overlap import OverlappedWeights

    worker = StageWorker(load_manifest("tiny"), 1)
    try:
        async with worker.frozen() as weights:
            at_end = await weights.read()
        start = at_end - 0.005  # where the inner steps went on from (an eager outer step)
        progress = torch.randn_like(at_end) * 1e-3
        async with worker.frozen() as weights:  # stands in for inner steps during the mix
            await weights.write(start + progress)
        overlapped = OverlappedWeights(worker, at_end, start, blocked_s=0.0)
        assert (await overlapped.read()) is at_end  # the pseudo-gradient is the round's
        new_anchor = at_end - 0.01
        version = worker.version
        await overlapped.write(new_anchor)
        async with worker.frozen() as weights:
            torch.testing.assert_close(await weights.read(), new_anchor + progress)
        assert worker.version == version + 1 and overlapped.blocked_s > 0.0
        assert not worker.hold_steps
    finally:
        worker.close()


async def test_overlapped_rounds_end_with_one_anchor_and_never_hold_steps_during_the_mix():
    network, board = LocalNetwork(), MemoryBoard()
    replicas = [_replica(i, network, board) for i in range(2)]
    stop = asyncio.Event()
    rounds = [
        OuterRounds(
            outer,
            worker,
            inner_steps=4,
            replica_rounds=list,
            replica_count=lambda: 2,
            poll_s=0.02,
            overlap=True,
        )
        for worker, outer in replicas
    ]
    tasks = [asyncio.create_task(r.run(stop)) for r in rounds]
    try:
        (wa, _), (wb, _) = replicas
        await _rounds_started(rounds, tasks)
        wa.optimizer.steps += 4  # A's round ends; its mix waits for B (window 0.5 s)
        await _until(lambda: rounds[0]._landing is not None, tasks, "A's round never ended")
        held_while_mixing = []
        for _ in range(10):  # A's mix is under way: its inner steps are not held
            held_while_mixing.append(wa.hold_steps)
            await asyncio.sleep(0.01)  # sampled across the mix: the spacing is under test
        wb.optimizer.steps += 1
        both_ended = lambda: all(1 in r.anchor_digests for r in rounds)  # noqa: E731
        await _until(both_ended, tasks, lambda: [r.round for r in rounds])
        assert not any(held_while_mixing)
        assert rounds[0].anchor_digests[1] == rounds[1].anchor_digests[1]
        for worker, outer in replicas:
            assert outer.last_report.participants == 2
            async with worker.frozen() as weights:  # no inner progress was made meanwhile
                torch.testing.assert_close(await weights.read(), outer.state.anchor)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for r in rounds:
            await r.close()
        for worker, _ in replicas:
            worker.close()


async def _overlapped_round_under_way(window: float = 30.0, before_end=None):  # noqa: ANN001
    """One replica with overlapped rounds whose round ended and mixes (the other replica
    never joins): (rounds, run task, worker, outer, weights at the round's end, progress
    added since, replicas). `before_end(outer)` runs before the round ends."""
    network, board = LocalNetwork(), MemoryBoard()
    replicas = [_replica(i, network, board, window=window) for i in range(2)]
    (wa, oa), _ = replicas
    rounds = OuterRounds(
        oa, wa, inner_steps=4, replica_rounds=list, replica_count=lambda: 2, poll_s=0.02,
        overlap=True,
    )  # fmt: skip
    task = asyncio.create_task(rounds.run(asyncio.Event()))
    await _rounds_started([rounds], [task])
    async with wa.frozen() as weights:  # the round's inner steps moved the weights
        at_end = await weights.read() + 1e-3 * torch.randn(oa.state.numel)
        await weights.write(at_end)
    if before_end is not None:
        before_end(oa)
    wa.optimizer.steps += 4
    await _until(lambda: rounds._landing is not None, [task], "the round never ended")
    progress = 1e-3 * torch.randn(oa.state.numel)
    async with wa.frozen() as weights:  # inner steps during the mix
        eager = await weights.read()
        await weights.write(eager + progress)
    assert not torch.allclose(eager, at_end)
    return rounds, task, wa, oa, at_end, progress, replicas


async def _stop(rounds, task, replicas) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await rounds.close()
    for worker, _ in replicas:
        worker.close()


async def test_an_overlapped_round_abandoned_before_it_lands_undoes_its_eager_step():
    """A drain cancels the rounds loop, then abandons the round under way. With overlap the
    weights went on from the eager step: they go back to the round's end plus the progress
    made since, which is what the unchanged anchor and momentum belong to (a checkpoint
    saves both). From the eager step to then the rounds' lock is held: no checkpoint or
    state copy sees the eager weights."""
    rounds, task, wa, oa, at_end, progress, replicas = await _overlapped_round_under_way()
    try:
        anchor, landing = oa.state.anchor.clone(), rounds._landing
        assert rounds._lock.locked()
        task.cancel()  # drain's order: the loop first (it waits on the landing), then abandon
        rounds.abandon()
        await asyncio.gather(landing, return_exceptions=True)
        async with wa.frozen() as weights:
            torch.testing.assert_close(await weights.read(), at_end + progress)
        assert torch.equal(oa.state.anchor, anchor) and not rounds._lock.locked()
    finally:
        await _stop(rounds, task, replicas)


def _hold_outer_step(outer: OuterLoop) -> tuple[threading.Event, threading.Event]:
    """Make `outer`'s step wait on its thread: (entered, release)."""
    entered, release = threading.Event(), threading.Event()
    step = outer._outer_step

    def slow(*args):  # noqa: ANN002, ANN202
        entered.set()
        release.wait(30)
        return step(*args)

    outer._outer_step = slow
    return entered, release


async def test_an_overlapped_round_abandoned_while_its_step_commits_lands():
    """Once the outer step runs (on a thread nothing can stop) the round lands: its anchor
    and the weights stay a pair."""
    held: list[threading.Event] = []
    rounds, task, wa, oa, at_end, progress, replicas = await _overlapped_round_under_way(
        0.3, before_end=lambda outer: held.extend(_hold_outer_step(outer))
    )
    entered, release = held
    try:
        await _until(entered.is_set, [task], "the outer step never ran")  # window 0.3 s
        assert oa.committing
        landing = rounds._landing
        rounds.abandon()
        release.set()
        await asyncio.gather(landing, return_exceptions=True)
        assert oa.state.round == 1 and not rounds._lock.locked()
        async with wa.frozen() as weights:
            torch.testing.assert_close(await weights.read(), oa.state.anchor + progress)
    finally:
        await _stop(rounds, task, replicas)


async def test_an_overlapped_round_that_fails_before_its_step_undoes_its_eager_step():
    """A round that fails (here its outer step raises) leaves no eager weights beside the
    old anchor for the leave's checkpoint; its failure still ends the rounds loop."""

    def failing_step(outer: OuterLoop) -> None:
        def fail(*_args):  # noqa: ANN002, ANN202
            raise RuntimeError("outer step failed")

        outer._outer_step = fail

    rounds, task, wa, oa, at_end, progress, replicas = await _overlapped_round_under_way(
        0.3, before_end=failing_step
    )
    try:
        anchor = oa.state.anchor.clone()
        done, _ = await asyncio.wait({task}, timeout=30)
        assert done and isinstance(task.exception(), RuntimeError)
        async with wa.frozen() as weights:
            torch.testing.assert_close(await weights.read(), at_end + progress)
        assert torch.equal(oa.state.anchor, anchor) and not rounds._lock.locked()
    finally:
        await _stop(rounds, task, replicas)


async def test_a_blocking_round_cancelled_while_its_step_commits_writes_its_weights():
    """Without overlap, a drain that cancels the rounds loop while the outer step runs on
    its thread: the step goes on and changes the anchor, so the weights it computed are
    written too (the cancel was raised before the write, and the leave's checkpoint saved
    the new anchor beside the round's end weights)."""
    network, board = LocalNetwork(), MemoryBoard()
    replicas = [_replica(i, network, board, window=0.3) for i in range(2)]
    (wa, oa), _ = replicas
    entered, release = _hold_outer_step(oa)
    flagged: list[int] = []  # rounds whose reports reached the suspect flags
    flag = oa._flag
    oa._flag = lambda report: (flagged.append(report.round), flag(report))
    rounds = OuterRounds(
        oa, wa, inner_steps=4, replica_rounds=list, replica_count=lambda: 2, poll_s=0.02
    )
    task = asyncio.create_task(rounds.run(asyncio.Event()))
    try:
        await _rounds_started([rounds], [task])
        async with wa.frozen() as weights:  # the round's inner steps moved the weights
            await weights.write(await weights.read() + 1e-3 * torch.randn(oa.state.numel))
        wa.optimizer.steps += 4
        await _until(entered.is_set, [task], "the outer step never ran")  # window 0.3 s
        anchor, epoch = oa.state.anchor.clone(), rounds._epoch
        assert rounds._lock.locked() and wa.hold_steps and oa.committing
        task.cancel()  # drain's order
        rounds.abandon()
        release.set()
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled()
        assert oa.state.round == 1 and not torch.equal(oa.state.anchor, anchor)
        assert not rounds._lock.locked() and not wa.hold_steps and not oa.committing
        assert oa.last_report is not None and oa.last_report.round == 0 and flagged == [0]
        assert rounds._epoch > epoch  # a cached state blob of the old anchor is not served
        async with wa.frozen() as weights:
            torch.testing.assert_close(await weights.read(), oa.state.anchor)
    finally:
        release.set()
        await _stop(rounds, task, replicas)


def test_a_replica_is_outvoted_only_by_a_strict_majority_holding_one_other_anchor():
    own = {2: "x", 3: "a"}
    assert outvoted(own, {3: {"p": "b", "q": "b"}}, replicas=3) == 3
    assert outvoted(own, {3: {"p": "b", "q": "a"}}, replicas=3) is None  # one of three
    assert outvoted(own, {3: {"p": "b", "q": "c"}}, replicas=3) is None  # they differ too
    assert outvoted(own, {3: {"p": "b", "q": "b"}}, replicas=5) is None  # two of five
    assert outvoted(own, {3: dict.fromkeys("pqr", "b")}, replicas=5) == 3
    # only the latest own round counts: an older split was mixed away or is judged there
    assert outvoted(own, {2: {"p": "y", "q": "y"}, 3: {"p": "a"}}, replicas=3) is None
    assert outvoted(own, {2: {"p": "y", "q": "y"}}, replicas=3) is None
    assert outvoted({}, {3: {"p": "b", "q": "b"}}, replicas=3) is None
    assert outvoted({3: "a"}, {3: {"p": "b"}}, replicas=1) == 3  # alone in the count: its word


async def test_an_outvoted_replica_takes_the_majoritys_state_once():
    network, board = LocalNetwork(), MemoryBoard()
    worker, outer = _replica(0, network, board)
    theirs = torch.full((outer.state.numel,), 0.25)
    calls = []

    async def resync():
        calls.append(rounds.round)
        await worker.call(worker.adopt_anchor, theirs)
        outer_state = {"round": 1, "anchor": theirs.clone(), "momentum": torch.zeros_like(theirs)}
        return SimpleNamespace(outer=outer_state, warming=True)

    rounds = OuterRounds(
        outer,
        worker,
        inner_steps=10**6,  # no round of its own ends here
        replica_rounds=list,
        replica_count=lambda: 3,
        poll_s=0.01,
        resync=resync,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(rounds.run(stop))
    try:
        await _rounds_started([rounds], [task])
        mine = rounds.anchor_digests[0]
        rounds.note_replica_anchors(
            [SimpleNamespace(peer_id=p, anchor_digest="f" * 64, anchor_round=0) for p in "pq"]
        )
        resynced = lambda: calls and 1 in rounds.anchor_digests  # noqa: E731
        await _until(resynced, [task], lambda: (calls, rounds.anchor_digests))
        assert outer.state.round == 1 and torch.equal(outer.state.anchor, theirs)
        assert outer.state.warming  # counts 0 in averaging until it has done a round
        assert torch.equal(WorkerWeights(worker)._flat(), theirs)
        assert rounds.anchor_digests[1] != mine
        # the same round never resyncs twice, even while the others still differ
        rounds.note_replica_anchors(
            [SimpleNamespace(peer_id=p, anchor_digest="f" * 64, anchor_round=0) for p in "pq"]
        )
        assert not await rounds._resync_if_outvoted()  # what every poll of the loop asks
        assert calls == [0]
    finally:
        stop.set()
        await asyncio.gather(task, return_exceptions=True)
        await outer.close()
        worker.close()


async def test_gossip_groups_never_resync():
    network, board = LocalNetwork(), MemoryBoard()
    worker, outer = _replica(0, network, board)
    outer.config = dataclasses.replace(outer.config, group_size=2)

    async def resync():
        raise AssertionError("gossip groups differ by design: no resync")

    rounds = OuterRounds(
        outer, worker, inner_steps=10**6, replica_rounds=list, replica_count=lambda: 4,
        resync=resync,
    )  # fmt: skip
    try:
        await rounds.attest()
        rounds.note_replica_anchors(
            [SimpleNamespace(peer_id=p, anchor_digest="f" * 64, anchor_round=0) for p in "pqr"]
        )
        assert outvoted(rounds.anchor_digests, rounds.replica_anchors, 4) == 0
        assert not await rounds._resync_if_outvoted()
        # whole-stage groups, but only one of the two who attest is a standing replica
        outer.config = dataclasses.replace(outer.config, group_size=0)
        rounds.replica_ids = lambda: ["p", "s"]
        rounds.replica_count = lambda: 3
        assert not await rounds._resync_if_outvoted()
    finally:
        await outer.close()
        worker.close()


def test_heads_take_turns_measuring_the_validation_loss():
    """The head with the least peer id among stage 0's records measured it for good: a
    stranger whose key was made for it (or a record without a host) silenced the rest."""
    from agora_node.node.service import evaluator

    heads = [f"12D3KooWhead{i:04d}" for i in range(4)]
    turns = Counter(evaluator(heads, slot) for slot in range(400))
    assert set(turns) == set(heads) and min(turns.values()) > 60  # each about a quarter
    assert evaluator(heads, 7) == evaluator(list(reversed(heads)), 7)  # all heads agree
    assert evaluator([], 7) is None
    least = "12D3KooW1111111111111"  # the least id is no longer everyone's evaluator
    assert Counter(evaluator([*heads, least], slot) for slot in range(400))[least] < 120
