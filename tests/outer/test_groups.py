"""Matchmaking: signed entries, the closing rule, identical views and groups."""

import asyncio
import dataclasses
import json

import pytest

from agora_node.comms.collective import Matchmaker, MatchmakingConfig, MemoryBoard, RoundEntry
from agora_node.comms.collective.groups import EntryError, close_view
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
