"""Real hivemind peers on 127.0.0.1, one process each (tests/outer/peer.py).

- three replicas complete rounds and end with equal anchors;
- one replica SIGKILLed inside the blocking mix: the other two finish that round
  within its deadline, with equal and finite weights;
- a replica whose delta is 1000x: CenteredClip keeps the mixed delta within the
  clip radius of the honest mean;
- a replica whose delta is 1000x or sign-flipped: refused and flagged in round 0, left
  out of round 1 by everyone;
- a replica replaying its round-0 delta: flagged in round 1, left out of round 2;
- a replica sending owners other parts than witnesses: flagged for it by its two
  signatures in round 0 (not the honest owners and witnesses), left out of round 1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.outer.harness import PeerProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
PEER = str(Path(__file__).with_name("peer.py"))
START_TIMEOUT = 60.0  # three DHTs start on 2 shared cores
ROUND_TIMEOUT = 45.0


@contextlib.contextmanager
def replicas(
    extra: list[list[str]], relayed: tuple[int, int, int] | None = None
) -> Iterator[list[PeerProcess]]:
    """Start one peer per argument list (the first is the others' entry point), then 'go'.
    `relayed` (a, b, relay): peers a and b send each other everything through the relay."""
    peers: list[PeerProcess] = []
    try:
        first = PeerProcess([PEER, *extra[0]])
        peers.append(first)
        ids = [first.expect("ready", START_TIMEOUT)]
        maddr = ids[0]["maddrs"][0]
        for args in extra[1:]:
            peers.append(PeerProcess([PEER, "--initial-peer", maddr, *args]))
        ids += [p.expect("ready", START_TIMEOUT) for p in peers[1:]]
        if relayed is not None:
            a, b, relay = (ids[i]["peer"] for i in relayed)
            peers[relayed[0]].send(f"route {b} {relay}")
            peers[relayed[1]].send(f"route {a} {relay}")
        for p in peers:
            p.send("go")
        yield peers
    finally:
        for p in peers:
            p.kill()


def test_replicas_that_reach_each_other_only_through_a_relay_agree() -> None:
    """Replicas 0 and 2 send each other every collective request through replica 1 as a
    relay of ours (comms/relay.py), as two replicas behind NAT would: the rounds complete
    with all three in the group and equal anchors, and the bytes went through the relay."""
    rounds = 2
    extra = [["--rounds", str(rounds), "--seed", str(i)] for i in range(3)]
    with replicas(extra, relayed=(0, 2, 1)) as peers:
        for r in range(rounds):
            events = [p.expect("round", ROUND_TIMEOUT, round=r) for p in peers]
            assert all(e["consistent"] and e["finite"] and e["group"] == 3 for e in events)
            assert len({e["digest"] for e in events}) == 1, f"anchors differ after round {r}"
        relay = events[1]["peer"][-8:]
        assert events[0]["relay"]["bytes_via"][relay] > 0, events[0]["relay"]
        assert events[2]["relay"]["bytes_via"][relay] > 0, events[2]["relay"]
        assert events[1]["relay"]["forwarded_requests"] > 0, events[1]["relay"]
        assert events[0]["relay"]["served_relayed"] > 0, events[0]["relay"]


def test_three_replicas_complete_rounds_with_equal_anchors() -> None:
    rounds = 3
    with replicas([["--rounds", str(rounds), "--seed", str(i)] for i in range(3)]) as peers:
        for r in range(rounds):
            events = [p.expect("round", ROUND_TIMEOUT, round=r) for p in peers]
            assert all(e["consistent"] and e["finite"] and e["group"] == 3 for e in events)
            assert len({e["digest"] for e in events}) == 1, f"anchors differ after round {r}"
            # every span fetched from its owner was confirmed by its witness (over libp2p
            # for one span of each replica: the daemon's configuration verifies results);
            # on a loaded machine an owner can be late, and its span then comes from its
            # backup owner (counted as late, never adopted unchecked)
            witnessed = [(e["checked"], e["late"], e["unchecked"]) for e in events]
            assert all(c + late == 2 and u == 0 for c, late, u in witnessed), (
                f"round {r}: (checked, late, unchecked) {witnessed}"
            )
            assert sum(c for c, _, _ in witnessed) >= 4, witnessed  # checks really ran
            assert all(not e["mismatched"] for e in events)


def test_survivors_finish_a_round_whose_member_was_killed_mid_mix() -> None:
    # 4 s per deadline step (2 s elsewhere): headroom on a loaded 2-core machine. The
    # digests differed twice in long runs (logs not captured); the likely cause, which
    # test_allreduce.py -k killed_mid_push reproduces: the victim's part reached one
    # survivor's span but its copy for that span's witness (the other survivor) was
    # lost with it, so the witness refused the result and kept its own values. The
    # witness copy now goes first (allreduce.py).
    args = [["--rounds", "2", "--seed", str(i), "--base-timeout", "4"] for i in range(3)]
    args[0] += ["--hold-round", "1"]
    args[1] += ["--hold-round", "1"]
    args[2] += ["--stall-round", "1"]  # enters round 1's mix first, delivers a part, freezes
    with replicas(args) as peers:
        for p in peers:
            p.expect("round", ROUND_TIMEOUT, round=0)
        victim = peers[2]
        victim.expect("pushed", ROUND_TIMEOUT, round=1)
        victim.kill()
        for p in peers[:2]:
            p.send("release")
        events = [p.expect("round", ROUND_TIMEOUT, round=1) for p in peers[:2]]
    assert len({e["digest"] for e in events}) == 1
    for e in events:
        assert e["finite"] and e["consistent"] and e["failed"] >= 1
        assert e["blocked"] <= e["deadline"]
    assert sum(e["repaired"] for e in events) == 1  # the dead member's span, re-reduced once


def test_centered_clip_bounds_a_member_sending_1000x(tmp_path: Path) -> None:
    args = [
        [
            "--rounds",
            "1",
            "--seed",
            str(i),
            "--aggregation",
            "centered_clip",
            "--codec",
            "fp32",
            "--out",
            str(tmp_path),
        ]
        for i in range(3)
    ]
    args[2] += ["--scale", "1000"]
    with replicas(args) as peers:
        events = [p.expect("round", ROUND_TIMEOUT, round=0) for p in peers]
        names = [p.expect("done", 5.0) and p for p in peers]
    assert len(names) == 3 and len({e["digest"] for e in events}) == 1
    saved = sorted(tmp_path.glob("*-0.pt"))
    data = [torch.load(f) for f in saved]
    by_norm = sorted(data, key=lambda d: float(d["delta"].norm()))
    honest_mean = (by_norm[0]["delta"] + by_norm[1]["delta"]) / 2
    mixed = by_norm[0]["mixed"]
    radius = sum(e["clip_radius"] ** 2 for e in events) ** 0.5
    plain_mean = sum(d["delta"] for d in data) / 3
    assert float((plain_mean - honest_mean).norm()) > 50 * radius  # what an unclipped mean does
    assert float((mixed - honest_mean).norm()) <= radius


@pytest.mark.parametrize(("scale", "refusal"), [("1000", "outliers"), ("-1", "direction_outliers")])
def test_a_member_sending_1000x_or_flipped_is_flagged_then_left_out_of_the_next_round(
    scale: str, refusal: str
) -> None:
    """Round 0: both honest reducers refuse the 1000x part (for its norm) or the
    sign-flipped one (for its direction) and ban its sender. Round 1: their entries name
    it, 2 of 3 is a strict majority, so every replica (the attacker too) leaves it out;
    the honest pair mixes alone together and their anchors stay equal."""
    args = [["--rounds", "2", "--seed", str(i), "--codec", "fp32"] for i in range(3)]
    args[2] += ["--scale", scale]
    with replicas(args) as peers:
        first = [p.expect("round", ROUND_TIMEOUT, round=0) for p in peers]
        second = [p.expect("round", ROUND_TIMEOUT, round=1) for p in peers]
    bad = first[2]["peer"]
    assert all(e[refusal] == [bad] and e["banned"] == [bad] for e in first[:2])
    other = "outliers" if refusal == "direction_outliers" else "direction_outliers"
    assert all(e[other] == [] for e in first)
    assert all(e["excluded"] == [bad] for e in second)
    honest = second[:2]
    assert all(e["group"] == 2 and e["consistent"] and e["finite"] for e in honest)
    assert second[2]["group"] == 1  # the attacker computed the same exclusion: alone
    assert len({e["digest"] for e in honest}) == 1
    assert len({e["digest"] for e in first}) == 1  # round 0 was still whole and equal


def test_a_member_replaying_its_first_delta_is_flagged_then_left_out() -> None:
    """Round 1: the liar sends round 0's delta again (int8 wire, as the daemon). The shared
    direction is the same every round, so the replay points where the others do and
    passes the norm and direction checks. Each honest replica reduces and witnesses two of
    the three spans per round, so it saw samples of the liar's round-0 part where its
    round-1 part lies: both flag it (`replayed`), and round 2 leaves it out."""
    # 4 s deadline steps: in a pair, a push that misses the owner's reduce deadline makes
    # its result name one part, which the witness check refuses (seen once in CI at 2 s)
    args = [
        ["--rounds", "3", "--seed", str(i), "--steady", "--base-timeout", "4"] for i in range(3)
    ]
    args[2] += ["--replay"]
    with replicas(args) as peers:
        rounds = [[p.expect("round", ROUND_TIMEOUT, round=r) for p in peers] for r in range(3)]
    bad = rounds[0][2]["peer"]
    assert all(e["rejected"] == {} for e in rounds[1])  # only the replay check caught it
    assert all(e["replayed"] == [] for e in rounds[0])
    assert all(e["replayed"] == [bad] and bad in e["banned"] for e in rounds[1][:2])
    assert all(e["excluded"] == [bad] for e in rounds[2])
    honest = rounds[2][:2]
    assert all(e["group"] == 2 and e["consistent"] and e["finite"] for e in honest), honest
    assert len({e["digest"] for e in honest}) == 1


def test_a_member_sending_two_parts_is_flagged_not_the_honest_owner_and_witness() -> None:
    """Round 0: the liar sends each owner a part 1.5x its witness copy, both signed. Every
    span it broke fails its check; the honest replicas compare the signed entries of the
    owner's result and the witness's answer (proofs.py) and flag the liar alone, whose
    two signatures disagree. Round 1 leaves it out; the honest pair agrees."""
    args = [["--rounds", "2", "--seed", str(i), "--codec", "fp32"] for i in range(3)]
    args[2] += ["--equivocate"]
    with replicas(args) as peers:
        first = [p.expect("round", ROUND_TIMEOUT, round=0) for p in peers]
        second = [p.expect("round", ROUND_TIMEOUT, round=1) for p in peers]
    bad = first[2]["peer"]
    for e in first[:2]:
        assert e["equivocated"] == [bad] and e["banned"] == [bad], e
        assert e["mismatched"] == [] and e["mismatch_witnesses"] == []
    assert all(e["excluded"] == [bad] for e in second)
    honest = second[:2]
    assert all(e["group"] == 2 and e["consistent"] and e["finite"] for e in honest)
    assert len({e["digest"] for e in honest}) == 1
