"""Matchmaking: signed entries, the closing rule, identical views and groups."""

import asyncio
import dataclasses
import json
import time

import pytest

from agora_node.comms.collective import Matchmaker, MatchmakingConfig, MemoryBoard, RoundEntry
from agora_node.comms.collective.entries import EntryError, view_digest
from agora_node.comms.collective.groups import (
    close_view,
    excluded,
    expected_ids,
    finished_apart,
)
from agora_node.protocol.identity import Identity
from agora_node.protocol.names import outer_round_key

pytestmark = pytest.mark.timeout(60)
QUICK = MatchmakingConfig(window=0.3, settle=0.1, poll_interval=0.02)


def entry(peer: str, joined: float) -> RoundEntry:
    return RoundEntry(peer_id=peer, run_id="r", stage=0, round=1, joined_at=joined)


def test_close_view_waits_for_the_window_then_keeps_early_joiners() -> None:
    entries = [entry("a", 100.0), entry("b", 102.0), entry("c", 111.0)]
    assert close_view([], window=10, settle=1, now=200, expect=None) is None
    assert close_view(entries, window=10, settle=1, now=110.5, expect=None) is None
    closed = close_view(entries, window=10, settle=1, now=111.5, expect=None)
    assert [e.peer_id for e in closed] == ["a", "b"]


def test_close_view_closes_early_when_everyone_expected_is_there() -> None:
    entries = [entry("a", 100.0), entry("b", 100.5)]
    assert close_view(entries, window=10, settle=1, now=101, expect=2) is not None
    assert close_view(entries, window=10, settle=1, now=101, expect=3) is None


def test_entries_verify_only_under_their_own_key_and_round() -> None:
    me, other = Identity.generate(), Identity.generate()
    e = RoundEntry(peer_id=me.peer_id, run_id="r", stage=0, round=1, joined_at=1.0)
    value = e.sign(me)
    assert RoundEntry.verified(value, peer_id=me.peer_id, run_id="r", stage=0, round_no=1) == e
    bad = [
        (e.sign(other), me.peer_id, 1),  # signed by someone else
        ({**value, "r": value["r"].replace(b'"stage":0', b'"stage":1')}, me.peer_id, 1),  # altered
        (value, other.peer_id, 1),  # stored under another peer's subkey
        (value, me.peer_id, 2),  # replayed into another round
        ({"r": b"x" * 5000, "s": b""}, me.peer_id, 1),
        ("not a dict", me.peer_id, 1),
    ]
    for v, peer, round_no in bad:
        with pytest.raises(EntryError):
            RoundEntry.verified(v, peer_id=peer, run_id="r", stage=0, round_no=round_no)


async def test_concurrent_peers_see_the_same_view_and_the_same_groups() -> None:
    board = MemoryBoard()
    ids = [Identity.generate() for _ in range(5)]
    makers = [Matchmaker(board, i, run_id="r", stage=2, config=QUICK) for i in ids]
    views = await asyncio.gather(*(m.gather(4, expect=5) for m in makers))
    assert len({tuple(v.peers) for v in views}) == 1 and len(views[0].peers) == 5
    for phase in ("anchor", "delta"):
        groups = {v.group(phase, 2) for v in views}
        assert sorted(p for g in groups for p in g) == sorted(i.peer_id for i in ids)
        assert all(len(g) >= 2 for g in groups)


async def test_a_peer_arriving_after_the_close_is_alone() -> None:
    board = MemoryBoard()
    early = [
        Matchmaker(board, Identity.generate(), run_id="r", stage=0, config=QUICK) for _ in range(2)
    ]
    await asyncio.gather(*(m.gather(0) for m in early))
    late = Matchmaker(board, Identity.generate(), run_id="r", stage=0, config=QUICK)
    view = await late.gather(0)
    assert view.group("delta", 0) == (late.identity.peer_id,)


async def test_forged_entries_are_ignored_and_counted() -> None:
    board = MemoryBoard()
    me, victim, forger = Identity.generate(), Identity.generate(), Identity.generate()
    forged = RoundEntry(peer_id=victim.peer_id, run_id="r", stage=0, round=0, joined_at=0.0)
    await board.publish(outer_round_key("r", 0, 0), victim.peer_id, forged.sign(forger), 1e12)
    maker = Matchmaker(
        board, me, run_id="r", stage=0, config=dataclasses.replace(QUICK, window=0.05)
    )
    view = await maker.gather(0)
    assert view.peers == [me.peer_id]
    assert maker.ignored >= 1


class FlakyBoard(MemoryBoard):
    """Refuses the first `failures` stores, as a loaded DHT sometimes does."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def publish(self, key: str, subkey: str, value: object, expiration: float) -> bool:
        if self.failures > 0:
            self.failures -= 1
            return False
        return await super().publish(key, subkey, value, expiration)


async def test_a_refused_store_is_retried_within_the_window_not_mixed_alone() -> None:
    board = FlakyBoard(failures=2)
    ids = [Identity.generate() for _ in range(2)]
    makers = [Matchmaker(board, i, run_id="r", stage=0, config=QUICK) for i in ids]
    views = await asyncio.gather(*(m.gather(0, expect=2) for m in makers))
    assert all(sorted(v.peers) == sorted(i.peer_id for i in ids) for v in views)
    dead = FlakyBoard(failures=10**6)  # a DHT that never stores: alone, after the window
    alone = Matchmaker(dead, ids[0], run_id="r", stage=0, config=QUICK)
    started = time.monotonic()
    view = await alone.gather(0, expect=2)
    assert view.peers == [ids[0].peer_id] and time.monotonic() - started < 5 * QUICK.window


def test_unknown_fields_from_newer_peers_are_tolerated_and_bad_types_are_not() -> None:
    me = Identity.generate()
    body = {"peer_id": me.peer_id, "run_id": "r", "stage": 0, "round": 1, "joined_at": 1.0}

    def signed(extra: dict) -> dict:
        data = json.dumps({**body, **extra}).encode()
        return {"r": data, "s": me.sign(data)}

    entry = RoundEntry.verified(
        signed({"future": [1, 2]}), peer_id=me.peer_id, run_id="r", stage=0, round_no=1
    )
    assert entry.joined_at == 1.0
    for bad in (
        {"joined_at": "soon"},
        {"stage": True},
        {"joined_at": float("inf")},
        {"round": None},
    ):
        with pytest.raises(EntryError):
            RoundEntry.verified(signed(bad), peer_id=me.peer_id, run_id="r", stage=0, round_no=1)


# ---- one stranger's entry decides nothing (issue 10) ------------------------------------


def test_one_entry_claiming_an_early_join_does_not_close_the_round() -> None:
    """Closing needs a majority of the expected replicas: joined_at = 0 is just the earliest."""
    entries = [entry("z", 0.0), entry("a", 100.0), entry("b", 101.0), entry("c", 102.0)]
    assert close_view(entries[:2], window=10, settle=1, now=100.5, expect=3) is None
    for expect in (3, 4, 5):  # peers whose membership views differ still agree
        closed = close_view(entries, window=10, settle=1, now=112, expect=expect)
        assert [e.peer_id for e in closed] == ["a", "b", "c", "z"]
    # given the replicas' ids, a stranger's entry does not stand in for a missing replica
    abc = {"a", "b", "c"}
    assert close_view([entries[0], *entries[1:3]], window=10, settle=1, now=102, expect=abc) is None
    assert close_view(entries, window=10, settle=1, now=102, expect=abc) is not None


def test_without_a_quorum_the_round_closes_on_whoever_came_after_patience() -> None:
    entries = [entry("a", 100.0)]
    kw = {"window": 1, "settle": 1, "expect": 5, "since": 100.0, "patience": 20.0}
    assert close_view(entries, now=110, **kw) is None
    assert [e.peer_id for e in close_view(entries, now=121, **kw)] == ["a"]


def _signed_entry(ident: Identity, round_no: int, joined_at: float, stage: int = 0) -> dict:
    e = RoundEntry(
        peer_id=ident.peer_id, run_id="r", stage=stage, round=round_no, joined_at=joined_at
    )
    return e.sign(ident)


@pytest.mark.parametrize("joined_ago", [float("inf"), 1.0], ids=["joined_at=0", "1s-early"])
async def test_an_early_joined_at_does_not_cut_honest_replicas_out(joined_ago: float) -> None:
    """main closed every round at (earliest joined_at) + window: a signed entry claiming
    joined_at = 0 left each honest replica in a round of the attacker alone."""
    board, attacker = MemoryBoard(), Identity.generate()
    joined = 0.0 if joined_ago == float("inf") else time.time() - joined_ago
    await board.publish(
        outer_round_key("r", 0, 7), attacker.peer_id, _signed_entry(attacker, 7, joined), 1e12
    )
    ids = [Identity.generate() for _ in range(3)]
    makers = [Matchmaker(board, i, run_id="r", stage=0, config=QUICK) for i in ids]
    replicas = {i.peer_id for i in ids}  # membership's live replicas of the stage
    views = await asyncio.gather(*(m.gather(7, expect=replicas) for m in makers))
    honest = {i.peer_id for i in ids}
    assert len({tuple(v.peers) for v in views}) == 1  # everyone computed the same groups
    assert honest <= set(views[0].peers)
    assert all(set(v.group("delta", 0)) >= honest for v in views)


async def test_entries_planted_for_future_rounds_are_ignored() -> None:
    """Entries planted long before their round (main kept them 900 s and believed their
    joined_at) or dated in the future change nobody's round."""
    board, attacker = MemoryBoard(), Identity.generate()
    now = time.time()
    for round_no in range(8, 13):
        for joined in (now - 300.0, now + 500.0):
            key = outer_round_key("r", 0, round_no)
            value = _signed_entry(attacker, round_no, joined)
            await board.publish(key, attacker.peer_id, value, 1e12)
            await board.publish(key, f"{attacker.peer_id}", value, 1e12)
    ids = [Identity.generate() for _ in range(3)]
    makers = [Matchmaker(board, i, run_id="r", stage=0, config=QUICK) for i in ids]
    assert not await makers[0].opened_by_others(10, expect=3)
    replicas = {i.peer_id for i in ids}
    views = await asyncio.gather(*(m.gather(10, expect=replicas) for m in makers))
    honest = sorted(i.peer_id for i in ids)
    assert all(v.peers == honest for v in views)
    assert all(m.ignored >= 1 for m in makers)


async def test_an_entry_with_a_number_beyond_float_range_is_ignored_not_raised() -> None:
    """One stranger's signed entry with joined_at = 10**400 (JSON allows it; the DHT's
    validator reads the time of signing from an extra issued_at) raised OverflowError in
    every reader: the outer-round loop ended and every replica of the stage stopped."""
    board, stranger, me = MemoryBoard(), Identity.generate(), Identity.generate()
    data = json.dumps(
        {"peer_id": stranger.peer_id, "run_id": "r", "stage": 0, "round": 5}
        | {"joined_at": 10**400, "issued_at": time.time()}
    ).encode()
    key = outer_round_key("r", 0, 5)
    await board.publish(key, stranger.peer_id, {"r": data, "s": stranger.sign(data)}, 1e12)
    maker = Matchmaker(board, me, run_id="r", stage=0, config=QUICK)
    assert not await maker.opened_by_others(5, expect=2)
    view = await maker.gather(5, expect={me.peer_id})
    assert view.peers == [me.peer_id] and maker.ignored >= 2


async def test_a_replica_re_storing_a_later_joined_at_cannot_hold_the_round_open() -> None:
    """Stage {me, crashed, liar}: the liar re-stored its entry every poll with joined_at =
    now + 1.9 s (within max_skew), so the second expected entry was always the newest and
    the close kept moving: the round was still open after 900 s. Now a peer's first
    joined_at read stands, and a list closes by a last time in any case."""
    board, me, liar = MemoryBoard(), Identity.generate(), Identity.generate()
    config = dataclasses.replace(QUICK, patience=0.5, max_skew=2.0)
    key = outer_round_key("r", 0, 6)
    stop = asyncio.Event()

    async def re_store() -> None:
        while not stop.is_set():
            entry = _signed_entry(liar, 6, time.time() + 1.9)
            await board.publish(key, liar.peer_id, entry, 1e12)
            await asyncio.sleep(0.01)

    storing = asyncio.create_task(re_store())
    try:
        maker = Matchmaker(board, me, run_id="r", stage=0, config=config)
        expect = {me.peer_id, liar.peer_id, "12D3KooWcrashed"}
        view = await asyncio.wait_for(maker.gather(6, expect=expect), 10)
        assert set(view.peers) == {me.peer_id, liar.peer_id}
    finally:
        stop.set()
        await storing


async def test_one_other_entry_ends_nobodys_round_in_a_stage_of_five() -> None:
    """A replica still doing inner steps joins once joining makes a majority, not on one
    stranger's (valid, fresh) entry; main ended every replica's round on any entry."""
    board = MemoryBoard()
    me, attacker, honest = Identity.generate(), Identity.generate(), Identity.generate()
    maker = Matchmaker(board, me, run_id="r", stage=0, config=QUICK)
    key = outer_round_key("r", 0, 3)
    await board.publish(key, attacker.peer_id, _signed_entry(attacker, 3, time.time()), 1e12)
    assert not await maker.opened_by_others(3, expect=5)
    assert await maker.opened_by_others(3, expect=2)  # two replicas: the other's word counts
    await board.publish(key, honest.peer_id, _signed_entry(honest, 3, time.time()), 1e12)
    assert await maker.opened_by_others(3, expect=5)  # joining now makes 3 of 5


async def test_strangers_entries_neither_close_the_round_nor_end_anyones_inner_steps() -> None:
    """Three strangers' entries (fresh keys, joined_at 60 s back, still fresh) closed the
    round on themselves before the replicas came, when every entry counted: each replica
    then mixed alone, round after round. Given the replicas' ids, only theirs count."""
    board = MemoryBoard()
    key, now = outer_round_key("r", 0, 4), time.time()
    for sybil in (Identity.generate() for _ in range(3)):
        await board.publish(key, sybil.peer_id, _signed_entry(sybil, 4, now - 60.0), 1e12)
    ids = [Identity.generate() for _ in range(3)]
    replicas = {i.peer_id for i in ids}
    makers = [Matchmaker(board, i, run_id="r", stage=0, config=QUICK) for i in ids]
    assert not await makers[0].opened_by_others(4, expect=replicas)
    assert await makers[0].opened_by_others(4, expect=3)  # by count, anyone counts
    views = await asyncio.gather(*(m.gather(4, expect=replicas) for m in makers))
    assert len({tuple(v.peers) for v in views}) == 1
    assert all(replicas <= set(v.group("delta", 0)) for v in views)


def test_only_the_expected_replicas_vote_to_leave_a_peer_out() -> None:
    def flagged(peer: str, joined: float, flags: tuple[str, ...]) -> RoundEntry:
        return dataclasses.replace(entry(peer, joined), flags=flags)

    entries = [
        flagged("a", 100.0, ()),
        flagged("b", 100.1, ("x",)),
        flagged("c", 100.2, ("x",)),
        flagged("x", 100.3, ()),
        *(flagged(f"s{i}", 100.4, ("a", "b")) for i in range(5)),  # strangers voting
    ]
    assert excluded(entries) == {"a", "b"}  # every entry a vote: the strangers win
    assert excluded(entries, {"a", "b", "c", "x"}) == frozenset()  # 2 of 4: no majority
    assert excluded(entries, {"a", "b", "c"}) == {"x"}  # 2 of the 3 replicas


async def test_a_finished_peers_entry_ends_inner_steps_but_joins_no_group() -> None:
    """A replica that expected only itself closed its round at once and finished it; a
    joiner that copied its state just then read the still-fresh entry, ended its inner
    steps on it and formed a group of two that the other never formed (then waited on it,
    bench/late_joiner.py). Marked done with another list, it no longer holds the joiner."""
    board = MemoryBoard()
    first, joiner = Identity.generate(), Identity.generate()
    a = Matchmaker(board, first, run_id="r", stage=0, config=QUICK)
    b = Matchmaker(board, joiner, run_id="r", stage=0, config=QUICK)
    assert (await a.gather(6, expect={first.peer_id})).peers == [first.peer_id]
    both = {first.peer_id, joiner.peer_id}
    assert await b.opened_by_others(6, expect=both)  # not yet marked: it counts
    assert await a.finish(6)
    assert not await a.finish(6)  # marked once
    assert await b.opened_by_others(6, expect=both)  # the round ran: end the inner steps
    started = time.monotonic()
    view = await b.gather(6, expect=both)
    assert view.peers == [joiner.peer_id]
    assert time.monotonic() - started < QUICK.waited()  # not waiting for the finished one
    key = outer_round_key("r", 0, 6)
    stored = {p: RoundEntry.verified(v, peer_id=p, run_id="r", stage=0, round_no=6)
              for p, v in board.data[key].items()}  # fmt: skip
    assert stored[first.peer_id].done and not stored[joiner.peer_id].done
    assert stored[first.peer_id].view == view_digest([entry(first.peer_id, 0.0)])


async def test_finish_marks_only_rounds_this_peer_entered() -> None:
    board = MemoryBoard()
    me = Identity.generate()
    maker = Matchmaker(board, me, run_id="r", stage=0, config=QUICK)
    assert not await maker.finish(3)  # never entered: nothing stored
    assert board.data == {}
    for round_no in range(10):  # only the last few are remembered
        await maker.gather(round_no, expect={me.peer_id})
    assert not await maker.finish(0)
    assert await maker.finish(9)


LONG_WINDOW = MatchmakingConfig(window=5.0, settle=0.1, poll_interval=0.02)
"""Everyone arrives within the window: lists close early, once all expected are in."""


async def test_peers_that_finished_without_a_late_one_are_not_expected_by_count_either() -> None:
    board = MemoryBoard()
    ids = [Identity.generate() for _ in range(3)]
    makers = [Matchmaker(board, i, run_id="r", stage=0, config=LONG_WINDOW) for i in ids]
    views = await asyncio.gather(*(m.gather(2, expect=2) for m in makers[:2]))
    assert all(len(v.peers) == 2 for v in views)
    assert all(await asyncio.gather(*(m.finish(2) for m in makers[:2])))
    late = await makers[2].gather(2, expect=3)  # expects three: two of them finished
    assert late.peers == [ids[2].peer_id]


async def test_a_slow_reader_in_the_finished_peers_list_keeps_them() -> None:
    """A member whose reads lag behind the others' whole mix (they finished first) closes
    the list they closed, so its groups are theirs: gossip pairs stay matched."""
    board = MemoryBoard()
    ids = [Identity.generate() for _ in range(3)]
    makers = [Matchmaker(board, i, run_id="r", stage=0, config=LONG_WINDOW) for i in ids]
    slow = ids[2]
    key = outer_round_key("r", 0, 2)
    await board.publish(key, slow.peer_id, _signed_entry(slow, 2, time.time()), 1e12)
    views = await asyncio.gather(*(m.gather(2, expect=3) for m in makers[:2]))
    assert all(len(v.peers) == 3 for v in views)
    assert all(await asyncio.gather(*(m.finish(2) for m in makers[:2])))
    assert (await makers[2].gather(2, expect=3)).peers == views[0].peers


def _done(ident: Identity, round_no: int, joined_at: float, view: str) -> dict:
    e = RoundEntry(
        peer_id=ident.peer_id, run_id="r", stage=0, round=round_no, joined_at=joined_at,
        done=True, view=view,
    )  # fmt: skip
    return e.sign(ident)


async def test_a_list_one_done_member_closed_stands_though_another_closed_a_different_one():
    """A closed the list L = {A, C, X, Y} and finished; C finished on another list; Y is
    still mixing on L. The slow reader X closes L (as before marks), not a list without
    A and C that matches nobody's (a review's case: dropping C changed L's digest, then A
    no longer matched either)."""
    board = MemoryBoard()
    a, c, x, y = (Identity.generate() for _ in range(4))
    key, now = outer_round_key("r", 0, 5), time.time()
    every = [entry(p.peer_id, now) for p in (a, c, x, y)]
    await board.publish(key, a.peer_id, _done(a, 5, now, view_digest(every)), 1e12)
    await board.publish(key, c.peer_id, _done(c, 5, now, view_digest(every[:2])), 1e12)
    await board.publish(key, y.peer_id, _signed_entry(y, 5, now), 1e12)
    slow = Matchmaker(board, x, run_id="r", stage=0, config=LONG_WINDOW)
    view = await slow.gather(5, expect={p.peer_id for p in (a, c, x, y)})
    assert set(view.peers) == {p.peer_id for p in (a, c, x, y)}


async def test_a_stranger_marking_its_entry_done_changes_no_honest_list() -> None:
    """M's entry is in the list P closed; M then re-stores it done with a junk digest. Q,
    reading late, still closes P's list: P has not finished (it may be mixing with Q)."""
    board = MemoryBoard()
    m, p, q = (Identity.generate() for _ in range(3))
    key, now = outer_round_key("r", 0, 5), time.time()
    await board.publish(key, m.peer_id, _signed_entry(m, 5, now), 1e12)
    await board.publish(key, q.peer_id, _signed_entry(q, 5, now), 1e12)
    replicas = {p.peer_id, q.peer_id}
    early = await Matchmaker(board, p, run_id="r", stage=0, config=LONG_WINDOW).gather(
        5, expect=replicas
    )
    assert len(early.peers) == 3
    await board.publish(key, m.peer_id, _done(m, 5, now, "0" * 32), 1e12)
    late = await Matchmaker(board, q, run_id="r", stage=0, config=LONG_WINDOW).gather(
        5, expect=replicas
    )
    assert late.peers == early.peers


def test_entries_with_an_oversized_view_digest_are_refused() -> None:
    me = Identity.generate()
    body = {"peer_id": me.peer_id, "run_id": "r", "stage": 0, "round": 1, "joined_at": 1.0}
    for extra in ({"done": True, "view": "f" * 33}, {"done": "yes"}, {"view": 5}):
        data = json.dumps({**body, **extra}).encode()
        with pytest.raises(EntryError):
            RoundEntry.verified(
                {"r": data, "s": me.sign(data)}, peer_id=me.peer_id, run_id="r", stage=0, round_no=1
            )


def _decide(entries: list[RoundEntry], me: str, expect: set[str], now: float) -> list[str] | None:
    """A reader's list as `Matchmaker.gather` closes it (window 5 s, settle 1 s)."""
    mine = next(e for e in entries if e.peer_id == me)
    closed = close_view(
        entries, window=5.0, settle=1.0, now=now, expect=expect, since=mine.joined_at
    )
    if closed is not None and finished_apart(closed, me, expected_ids(expect)):
        return [me]
    return None if closed is None else sorted(e.peer_id for e in closed)


def _finished(peer: str, joined: float, on: list[str]) -> RoundEntry:
    digest = view_digest([entry(p, 0.0) for p in on])
    return dataclasses.replace(entry(peer, joined), done=True, view=digest)


def test_readers_of_the_same_entries_still_close_the_same_list() -> None:
    """A review's cases against a rule that closed again without done entries: honest
    readers whose expectations differ, a stranger's mark, and a late replica."""
    t = 1000.0
    # A closed alone and finished; P1 does not count the second joiner Y yet, Y counts P1
    entries = [_finished("A", t, ["A"]), entry("P1", t + 1), entry("Y", t + 1.5)]
    p1 = _decide(entries, "P1", {"A", "P1"}, t + 2)
    assert p1 == _decide(entries, "Y", {"A", "P1", "Y"}, t + 2) == ["A", "P1", "Y"]
    # a stranger S re-stores its entry done with a junk digest: P and Y keep one list
    entries = [entry("P", t), dataclasses.replace(entry("S", t), done=True, view="0" * 32)]
    entries.append(entry("Y", t + 0.5))
    assert _decide(entries, "P", {"P"}, t + 1) == _decide(entries, "Y", {"P", "Y"}, t + 1)
    # A and B finished on {A, B}; P entered 3 s later, Q after the close: both alone
    entries = [_finished("A", t, ["A", "B"]), _finished("B", t, ["A", "B"])]
    entries += [entry("P", t + 3), entry("Q", t + 9)]
    every = {"A", "B", "P", "Q"}
    assert _decide(entries, "P", every, t + 9.2) == ["P"]
    q = _decide(entries, "Q", every, t + 9.2)
    assert q is not None and "Q" not in q  # arrived after the close: alone (RoundView.group)
    # the joiner: its only partner finished without it
    entries = [_finished("A", t, ["A"]), entry("J", t + 1)]
    assert _decide(entries, "J", {"A", "J"}, t + 1.1) == ["J"]
    # a stranger's done entry claiming the joiner's list does not hold the joiner there
    claim = view_digest([entry("A", 0.0), entry("J", 0.0), entry("S", 0.0)])
    entries.append(dataclasses.replace(entry("S", t), done=True, view=claim))
    assert _decide(entries, "J", {"A", "J"}, t + 1.1) == ["J"]
    # a stranger whose entry is not done does: the list stands, as before marks existed
    entries[-1] = entry("S", t)
    assert _decide(entries, "J", {"A", "J"}, t + 1.1) == ["A", "J", "S"]
