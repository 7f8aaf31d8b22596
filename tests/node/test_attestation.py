"""Which state a joiner trusts (node/attestation.py): strict majorities, never one claim."""

import pytest

from agora_node.node import attestation
from agora_node.node.attestation import (
    Verdict,
    check,
    live_replicas,
    plan_sources,
    prefer_replicas,
)
from agora_node.protocol.records import NodeRecord

pytestmark = pytest.mark.timeout(30)

HONEST, OTHER = "a" * 32, "b" * 32


def rec(peer: str, digest: str = HONEST, round_no: int = 4, **kw) -> NodeRecord:
    fields = {"state": "active", "inner_step": 100, "queue": 1, "outer_digest": "c" * 32}
    fields.update(kw)
    return NodeRecord(
        run_id="r", peer_id=peer, stage=1, anchor_round=round_no, anchor_digest=digest, **fields
    )


def test_the_highest_inner_step_decides_nothing():
    hostile = rec("zz-hostile", OTHER, round_no=99, inner_step=10**9, queue=0)
    plan = plan_sources([rec("p1"), rec("p2"), hostile])
    assert plan.majority == attestation.Attestation(4, HONEST)
    assert plan.votes == 2 and plan.replicas == 3
    assert "zz-hostile" not in plan.sources


def test_a_liar_that_attests_the_majority_is_a_source_but_only_of_that_digest():
    hostile = rec("zz-hostile", inner_step=10**9, queue=0, throughput=1e6)
    plan = plan_sources([rec("p1"), rec("p2"), hostile])
    assert plan.sources == ("zz-hostile", "p1", "p2")  # idle, fast first: claims order only
    assert check(plan, 4, OTHER) == Verdict.REJECT  # what it sends must hash to the majority's
    assert check(plan, 4, HONEST) == Verdict.ADOPT
    assert plan_sources([rec("p1"), rec("p2"), hostile], exclude={"zz-hostile"}).sources == (
        "p1",
        "p2",
    )


@pytest.mark.parametrize(
    "records",
    [
        [rec("p1"), rec("p2", OTHER)],  # one against one: no strict majority
        [rec("p1"), rec("p2"), rec("p3", ""), rec("p4", "")],  # 2 of 4 attest
        [rec("p1"), rec("p2", round_no=5)],  # same digest, different rounds
        [rec("p1", "not-hex" * 4 + "zzzz"), rec("p2", "A" * 31)],  # malformed digests
        [],
    ],
    ids=["tie", "half", "rounds", "malformed", "none"],
)
def test_no_strict_majority_no_source(records):
    plan = plan_sources(records)
    assert plan.majority is None and plan.sources == ()


def test_one_replica_is_its_own_majority():
    plan = plan_sources([rec("p1")])
    assert plan.majority == attestation.Attestation(4, HONEST) and plan.sources == ("p1",)


def test_live_replicas_are_the_stage_active_or_warming_once_per_peer_and_not_me():
    records = [
        rec("p1"),
        rec("p1", OTHER),  # a second record of the same peer counts once
        rec("p2", state="warming"),
        rec("loading", "", state="warming"),  # still loading its state: attests nothing
        rec("p3", state="joining"),
        rec("p4", state="leaving"),
        rec("me"),
        NodeRecord(run_id="r", peer_id="p5", stage=2, state="active"),
    ]
    assert [r.peer_id for r in live_replicas(records, 1, "me")] == ["p1", "p2"]
    # an active replica that attests nothing still counts (against any majority)
    assert [r.peer_id for r in live_replicas([rec("old", "")], 1, "me")] == ["old"]


def test_momentum_needs_its_own_strict_majority():
    plan = plan_sources([rec("p1"), rec("p2"), rec("p3", outer_digest="d" * 32)])
    assert plan.momentum_attested("c" * 32)
    assert not plan.momentum_attested("d" * 32)
    assert not plan.momentum_attested(None)
    split = plan_sources([rec("p1"), rec("p2", outer_digest="d" * 32), rec("p3", OTHER)])
    assert split.majority is not None and not split.momentum_attested("c" * 32)


@pytest.mark.parametrize(
    ("checkpoint_round", "majority_round", "expected"),
    [(None, 4, True), (3, 4, True), (4, 4, False), (9, 4, False), (3, None, False)],
)
def test_the_own_checkpoint_wins_unless_a_majority_attests_newer(
    checkpoint_round, majority_round, expected
):
    records = [rec("p1", round_no=majority_round or 4), rec("p2", OTHER)]
    if majority_round is not None:
        records.append(rec("p3", round_no=majority_round))
    assert prefer_replicas(plan_sources(records), checkpoint_round) is expected


def test_one_replica_alone_never_replaces_the_own_checkpoint():
    """The only other replica (a stage of two) attesting a newer round is a strict
    majority of the others, but may be a stranger: the node keeps what it wrote itself.
    Without a checkpoint there is nothing better to keep."""
    alone = plan_sources([rec("p1", round_no=7)])
    assert alone.majority is not None and alone.votes == 1
    assert not prefer_replicas(alone, 6)
    assert prefer_replicas(alone, None)
    assert prefer_replicas(plan_sources([rec("p1", round_no=7), rec("p2", round_no=7)]), 6)
    # a partner of when the checkpoint was saved is believed after a long absence (it
    # trained on meanwhile); a restart after a crash resumes its own
    away = attestation.AWAY_S + 1
    assert prefer_replicas(alone, 6, partners={"p1"}, away_s=away)
    assert not prefer_replicas(alone, 6, partners={"p1"}, away_s=60)
    assert not prefer_replicas(alone, 6, partners={"p2"}, away_s=away)
    assert not prefer_replicas(alone, 7, partners={"p1"}, away_s=away)


def test_a_source_ahead_of_the_attestations_is_stale_not_adopted():
    plan = plan_sources([rec("p1"), rec("p2")])
    assert check(plan, 5, OTHER) == Verdict.STALE
    assert check(plan, 3, HONEST) == Verdict.REJECT
