"""The suspects ledger (node/suspects.py) and the round-exclusion rule (groups.excluded):
pure, with an injected clock."""

import asyncio

import pytest

from agora_node.comms.collective import Matchmaker, MatchmakingConfig, MemoryBoard, RoundEntry
from agora_node.comms.collective.entries import MAX_FLAGS, EntryError
from agora_node.comms.collective.groups import excluded
from agora_node.node.suspects import ROUND_EVIDENCE, STATUS_ROWS, NormWatch, Reason, Suspects
from agora_node.protocol.identity import Identity
from tests.node.clock import Clock

pytestmark = pytest.mark.timeout(30)
QUICK = MatchmakingConfig(window=0.3, settle=0.1, poll_interval=0.02)


def test_a_flag_bans_for_the_ban_period_and_then_expires() -> None:
    clock = Clock(1000.0)
    s = Suspects(me="me", ban_s=60, clock=clock)
    assert s.flag("bad", Reason.NORM_OUTLIER, "round 3")
    assert s.is_banned("bad") and not s.is_banned("good")
    clock.now += 59
    assert s.is_banned("bad")
    clock.now += 2
    assert not s.is_banned("bad") and s.banned() == frozenset()
    assert s.status()["banned"] == []
    assert s.flagged_total["norm_outlier"] == 1  # the total stays


def test_a_new_flag_restarts_the_ban_and_counts() -> None:
    clock = Clock(1000.0)
    s = Suspects(ban_s=60, clock=clock)
    s.flag("bad", Reason.NONFINITE)
    clock.now += 50
    assert not s.flag("bad", Reason.MISMATCH)  # already banned
    clock.now += 50
    assert s.is_banned("bad")
    (row,) = s.status()["banned"]
    assert row["flags"] == 2 and row["reason"] == "mismatch" and row["flagged_s_ago"] == 100
    assert s.flagged_total == {
        r.value: (1 if r in (Reason.NONFINITE, Reason.MISMATCH) else 0) for r in Reason
    }


def test_nobody_flags_itself_or_an_empty_id() -> None:
    s = Suspects(me="me")
    assert not s.flag("me", Reason.NORM_OUTLIER) and not s.flag("", Reason.NORM_OUTLIER)
    assert s.banned() == frozenset() and sum(s.flagged_total.values()) == 0


def test_the_ledger_is_bounded_and_forgets_the_soonest_to_expire() -> None:
    clock = Clock(1000.0)
    s = Suspects(ban_s=100, max_peers=8, clock=clock)
    for i in range(1000):
        clock.now += 0.01
        s.flag(f"p{i}", Reason.NORM_OUTLIER)
    assert 7 <= len(s.banned()) <= 8 and s.is_banned("p999") and not s.is_banned("p0")
    assert s.newest_banned(3) == ["p999", "p998", "p997"]


def test_the_status_page_lists_the_newest_bans_and_counts_them_all() -> None:
    clock = Clock(1000.0)
    s = Suspects(ban_s=1000, clock=clock)
    for i in range(300):
        clock.now += 0.01
        s.flag(f"p{i}", Reason.NONFINITE)
    status = s.status()
    assert status["banned_count"] == 300 and len(status["banned"]) == STATUS_ROWS
    assert status["banned"][-1]["peer"] == "p299"


def test_sybils_flagged_once_apiece_do_not_push_a_ban_out_below_the_bound() -> None:
    """A lying replica banned for its pipeline answers, then 1000 fresh identities flagged
    once each: with a ledger of 256 the liar's ban went, and the router used it again."""
    clock = Clock(1000.0)
    s = Suspects(ban_s=600, clock=clock)
    s.flag("liar", Reason.CANARY)
    for i in range(1000):
        clock.now += 0.01
        s.flag(f"sybil{i}", Reason.NONFINITE)
    assert s.is_banned("liar")


def test_a_flood_of_pipeline_flags_does_not_flush_round_evidence() -> None:
    """Sybils each sending one non-finite micro-batch (a flag apiece) evicted the bans on
    outer-round evidence, the ones round entries name; now those go last."""
    clock = Clock(1000.0)
    s = Suspects(ban_s=100, max_peers=8, clock=clock)
    s.flag("liar", Reason.DIRECTION_OUTLIER)
    for i in range(1000):
        clock.now += 0.01
        s.flag(f"sybil{i}", Reason.NONFINITE)
    assert s.is_banned("liar") and s.newest_banned(8, ROUND_EVIDENCE) == ["liar"]
    assert 7 <= len(s.banned()) <= 8 and s.is_banned("sybil999")


def test_round_entries_name_only_peers_banned_on_round_evidence() -> None:
    s = Suspects()
    s.flag("next-stage", Reason.CANARY)
    s.flag("same-stage", Reason.NORM_OUTLIER)
    assert s.newest_banned(8, ROUND_EVIDENCE) == ["same-stage"]
    assert sorted(s.newest_banned(8)) == ["next-stage", "same-stage"]


def test_a_ban_period_must_be_finite() -> None:
    with pytest.raises(ValueError):
        Suspects(ban_s=float("inf"))


def test_norm_watch_flags_only_far_outliers_once_it_has_seen_enough() -> None:
    w = NormWatch(factor=100, window=64, min_samples=16)
    assert not w.outlier(1e6)  # nothing to compare with yet
    w = NormWatch(factor=100, window=64, min_samples=16)
    for i in range(16):
        assert not w.outlier(1.0 + 0.01 * i)
    assert not w.outlier(50.0)
    assert w.outlier(1000.0) and w.outlier(float("nan")) and w.outlier(float("inf"))


def _watch_fed_by(senders: str, rounds: int = 8) -> NormWatch:
    """A watch that accepted norms near 1 from each of `senders`, in turn."""
    w = NormWatch(factor=100, window=64, min_samples=16)
    for _ in range(rounds):
        for p in senders:
            assert not w.outlier(1.0, p)
    return w


def test_a_stale_norm_watch_rebases_when_most_senders_moved_together() -> None:
    # the level moved 500x while this node was idle: every sender is refused at first
    w = _watch_fed_by("abc")
    assert w.outlier(500.0, "a") and w.rebased == []
    assert not w.outlier(520.0, "b")  # a second of three: a strict majority moved
    assert sorted(w.rebased) == ["a", "b"]
    assert not w.outlier(480.0, "c") and w.rebased == []  # judged on the new level
    assert w.outlier(480.0 * 200, "c")  # and still judging


def test_a_lone_liar_or_a_minority_of_liars_cannot_rebase_the_watch() -> None:
    w = _watch_fed_by("abcxy")
    for _ in range(50):  # a liar, however often it sends: refused every time
        for _ in range(5):
            assert w.outlier(1e4, "x")
        assert not w.outlier(1.0, "a")
    for _ in range(50):  # two colluding liars in a row: 2 of 5 senders is no majority
        assert w.outlier(1e4, "x") and w.outlier(1e4, "y")
        assert all(not w.outlier(1.0, p) for p in "abc")
    for _ in range(3):  # fresh identities, however many, in a row: never accepted before
        assert all(w.outlier(1e4, f"sybil-{i}") for i in range(100))
    assert w.rebased == []
    assert w.outlier(1e4)  # a norm without a sender never re-bases


def test_a_sole_sender_is_refused_a_few_times_then_rebased_on() -> None:
    w = _watch_fed_by("a", rounds=20)
    for _ in range(3):
        assert w.outlier(300.0, "a")
    assert not w.outlier(300.0, "a") and w.rebased == ["a"]


def test_senders_gone_quiet_do_not_count_against_the_one_still_sending() -> None:
    # a cell's helper left alone: both heads sent to it once, then one became a helper
    # itself and sends nothing; the other head's norms moved meanwhile
    now = [0.0]
    w = NormWatch(factor=100, window=64, min_samples=16, active_s=60, clock=lambda: now[0])
    for _ in range(8):
        now[0] += 0.5
        assert not w.outlier(1.0, "a") and not w.outlier(1.0, "b")
    now[0] += 9.0
    assert all(w.outlier(300.0, "a") for _ in range(4))  # b active: 1 of 2 is no majority
    now[0] += 2.0  # b, which sent every 0.5 s, not heard from for 11 s (> 10 s): a, refused
    assert not w.outlier(300.0, "a") and w.rebased == ["a"]  # 4 times, is the only one


def test_a_slower_sender_keeps_its_vote_for_8_of_its_gaps_and_no_longer() -> None:
    # "slow" sends every 3 s (active for 24 s after its last norm), "fast" every 0.5 s;
    # silent for 20 s "slow" still holds the level against "fast" alone (a fixed 10 s
    # window would have let "fast" re-base), silent for 30 s it does not (a fixed 60 s
    # window would have kept it)
    now = [0.0]
    w = NormWatch(factor=100, window=64, min_samples=16, active_s=60, clock=lambda: now[0])
    for i in range(96):
        now[0] = i * 0.5
        assert not w.outlier(1.0, "fast")
        if i % 6 == 0:
            assert not w.outlier(1.0, "slow")
    last_slow = now[0] = 96 * 0.5
    assert not w.outlier(1.0, "slow")
    now[0] = last_slow + 20.0
    assert all(w.outlier(300.0, "fast") for _ in range(8)) and w.rebased == []
    now[0] = last_slow + 30.0
    assert not w.outlier(300.0, "fast") and w.rebased == ["fast"]


def test_a_norm_taken_but_too_far_to_count_is_heard_once() -> None:
    # heard twice (the second time with a gap of 0), its usual gap shrank to 0.43x of
    # the true one, and with it the time it keeps its vote
    now = [0.0]
    w = NormWatch(factor=100, window=64, min_samples=16, clock=lambda: now[0])
    for i in range(32):
        now[0] = i * 3.0
        assert not w.outlier(1.0, "a") and not w.outlier(1.0, "b")
    for i in range(32, 48):
        now[0] = i * 3.0
        assert not w.outlier(30.0, "a")  # within the bound, too far to count
        assert not w.outlier(1.0, "b")
    assert w._heard["a"][1] == pytest.approx(3.0)


def test_a_replica_frozen_mid_stream_stops_holding_the_level_within_seconds() -> None:
    # two senders every 0.3 s; "frozen" stops (SIGSTOP, a laptop asleep) while "awake"'s
    # norms grow past the bound: "awake" was refused for 60 s and more before (its two
    # micro-batches in flight retried after 2, 8, 32 s), now it is re-based on once the
    # frozen one is 10 s silent
    now = [0.0]
    w = NormWatch(factor=100, window=64, min_samples=16, clock=lambda: now[0])
    for _ in range(32):
        now[0] += 0.3
        assert not w.outlier(1.0, "frozen") and not w.outlier(1.0, "awake")
    frozen_at = now[0]
    refused_at = []
    for t in (4.0, 4.0, 6.0, 6.0, 14.0, 14.0, 46.0, 46.0):
        now[0] = frozen_at + t
        if w.outlier(300.0, "awake"):
            refused_at.append(t)
        elif w.rebased == ["awake"]:
            break
    assert refused_at == [4.0, 4.0, 6.0, 6.0] and now[0] - frozen_at == 14.0


def test_a_norm_watch_that_accepted_nothing_for_max_age_starts_over() -> None:
    now = [0.0]
    w = NormWatch(factor=100, window=64, min_samples=16, max_age_s=300, clock=lambda: now[0])
    for _ in range(16):
        assert not w.outlier(1.0, "old")
    now[0] = 299.0
    assert w.outlier(500.0, "old")  # within max_age: refused
    now[0] = 301.0  # 300 s passed since it accepted anything
    assert all(not w.outlier(500.0, "old") for _ in range(16))
    assert w.outlier(500.0 * 200, "old")  # judging again, on the new level


def test_a_new_sender_after_a_minute_of_silence_sets_the_level_and_is_judged_on() -> None:
    """The only replica of the stage before left; a node moved there and started from
    scratch: its norms, far from the old ones, were refused (and it was flagged) for
    max_age_s, the stage's training stopped meanwhile. A pause shorter than active_s (a
    blocking round) lets nobody reset the level, and the new level is judged on at once."""
    now = [0.0]
    w = NormWatch(factor=100, window=64, min_samples=16, active_s=60, clock=lambda: now[0])
    for _ in range(16):
        now[0] += 0.5
        assert not w.outlier(1.0, "old")
    now[0] += 11.0  # a pause of a blocking round: a stranger's huge norm is still refused
    assert w.outlier(1e6, "stranger") and w.outlier(500.0, "new")
    now[0] += 60.0  # "old" silent for over a minute: the stage before changed hands
    assert not w.outlier(500.0, "new")
    assert not w.outlier(600.0, "new") and w.outlier(500.0 * 200, "new")  # judged on
    for _ in range(2):  # a sole sender with long gaps keeps being judged (4 in a row re-base)
        now[0] += 70.0
        assert w.outlier(500.0 * 200, "new")


@pytest.mark.parametrize("then", [Reason.NONFINITE, Reason.PIPELINE_OUTLIER, Reason.CANARY])
def test_a_pipeline_flag_does_not_wash_out_round_evidence(then: Reason) -> None:
    """A liar banned on round evidence sent one non-finite micro-batch: its flag became
    `nonfinite`, round entries stopped naming it and the majority that left it out of
    rounds dissolved (and a `pipeline_outlier` flag could then be pardoned away)."""
    clock = Clock()
    s = Suspects(ban_s=600, clock=clock)
    s.flag("liar", Reason.MISMATCH, "span 2")
    clock.now += 100
    s.flag("liar", then, "one micro-batch")
    assert s.newest_banned(8, ROUND_EVIDENCE) == ["liar"]
    s.pardon(["liar"], Reason.PIPELINE_OUTLIER)
    (row,) = s.status()["banned"]
    assert s.is_banned("liar") and row["reason"] == "mismatch"
    assert row["ban_left_s"] == 500.0  # nor does a pipeline flag lengthen it


def test_a_pardon_lifts_only_bans_for_that_reason() -> None:
    s = Suspects(ban_s=600)
    s.flag("a", Reason.PIPELINE_OUTLIER, "norm")
    s.flag("b", Reason.NONFINITE, "nan")
    s.pardon(["a", "b", "c"], Reason.PIPELINE_OUTLIER)
    assert not s.is_banned("a") and s.is_banned("b")


def entry(peer: str, flags: tuple[str, ...] = ()) -> RoundEntry:
    return RoundEntry(peer_id=peer, run_id="r", stage=0, round=1, joined_at=1.0, flags=flags)


def test_a_strict_majority_of_entries_excludes_a_peer_and_a_minority_does_not() -> None:
    honest = [entry(p, ("x",)) for p in "abc"]
    assert excluded([*honest, entry("x"), entry("y")]) == {"x"}  # 3 of 5
    assert excluded([*honest[:2], entry("c"), entry("x")]) == frozenset()  # 2 of 4
    liars = [entry("x", ("a",)), entry("y", ("a",))]
    assert excluded([*liars, entry("a"), entry("b"), entry("c")]) == frozenset()
    # self-accusation does not count; absent peers are not "excluded"
    assert excluded([entry("a", ("a",)), entry("b", ("a",))]) == frozenset()
    assert excluded([entry("a", ("z",)), entry("b", ("z",))]) == frozenset()


def test_entry_flags_are_signed_bounded_and_optional() -> None:
    me = Identity.generate()
    e = RoundEntry(
        peer_id=me.peer_id, run_id="r", stage=0, round=1, joined_at=1.0, flags=("12D3KooWx",)
    )
    back = RoundEntry.verified(e.sign(me), peer_id=me.peer_id, run_id="r", stage=0, round_no=1)
    assert back == e
    too_many = RoundEntry(
        peer_id=me.peer_id,
        run_id="r",
        stage=0,
        round=1,
        joined_at=1.0,
        flags=tuple(f"p{i}" for i in range(MAX_FLAGS + 1)),
    )
    with pytest.raises(EntryError):
        RoundEntry.verified(too_many.sign(me), peer_id=me.peer_id, run_id="r", stage=0, round_no=1)


async def test_peers_that_agree_on_a_ban_compute_the_same_groups_without_the_banned() -> None:
    board = MemoryBoard()
    ids = [Identity.generate() for _ in range(5)]
    bad = ids[4].peer_id
    makers = [Matchmaker(board, i, run_id="r", stage=0, config=QUICK) for i in ids]
    # three of five name the bad peer; one honest peer missed it (it never saw the outlier)
    flags = [(bad,), (bad,), (bad,), (), ()]
    views = await asyncio.wait_for(
        asyncio.gather(
            *(m.gather(2, expect=5, flags=f) for m, f in zip(makers, flags, strict=True))
        ),
        20,
    )
    honest = views[:4]
    assert len({tuple(v.peers) for v in honest}) == 1 and bad not in honest[0].peers
    assert all(v.excluded == (bad,) for v in views)
    assert len({v.group("delta", 0) for v in honest}) == 1 and len(honest[0].group("delta", 0)) == 4
    assert views[4].group("delta", 0) == (bad,)  # the excluded peer mixes alone


async def test_a_banned_peers_entry_does_not_open_a_round_for_others() -> None:
    board = MemoryBoard()
    me, bad = Identity.generate(), Identity.generate()
    mine = Matchmaker(board, me, run_id="r", stage=0, config=QUICK)
    theirs = Matchmaker(board, bad, run_id="r", stage=0, config=QUICK)
    gathering = asyncio.create_task(theirs.gather(7, expect=1))
    try:
        await asyncio.wait_for(gathering, 10)
        assert await mine.opened_by_others(7, expect=3)
        assert not await mine.opened_by_others(7, expect=3, ignore={bad.peer_id})
    finally:
        gathering.cancel()
