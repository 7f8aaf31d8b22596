"""should_switch and switch_delay: clear gains only, a stage's last replica stays, no swinging."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agora_node.protocol.records import NodeState
from agora_node.stages.placement import peer_rank, should_switch, switch_delay

from .helpers import directory, record

pytestmark = pytest.mark.timeout(60)

EQUAL3 = [1.0, 1.0, 1.0]


def test_moves_from_an_over_replicated_stage_to_an_empty_one() -> None:
    view = directory(
        record("a", 0, throughput=100.0),
        record("b", 0, throughput=100.0),
        record("c", 0, throughput=100.0),
        record("d", 1, throughput=100.0),
    )
    decisions = {p: should_switch(view, EQUAL3, p, 0) for p in "abc"}
    movers = [p for p, d in decisions.items() if d.stage is not None]
    assert len(movers) == 1, "peers with the same view elect one mover"
    moved = decisions[movers[0]]
    assert moved.stage == 2 and moved.bottleneck == 0 and moved.bottleneck_after == 100
    stayed = [d for p, d in decisions.items() if p not in movers]
    assert all("moves first" in d.reason for d in stayed)
    assert should_switch(view, EQUAL3, "d", 1).stage is None


def test_refuses_when_the_node_is_its_stages_only_active_replica() -> None:
    view = directory(
        record("a", 0, throughput=100.0),
        record("w", 0, NodeState.WARMING, throughput=100.0),
        record("b", 1, throughput=100.0),
    )
    decision = should_switch(view, EQUAL3, "a", 0)
    assert decision.stage is None
    assert "only active replica of stage 0" in decision.reason


def test_a_stranger_s_record_does_not_stand_in_for_a_stage_s_last_replica() -> None:
    """A record is one signed DHT store: a stranger's (pinned, never elected) at stage 0
    made the last honest replica there leave it. Given what this node's probes verified,
    only replicas with a host behind them keep a stage from losing its last one."""
    view = directory(
        record("a", 0, throughput=100.0),
        record("stranger", 0, throughput=1e6),
        record("b", 1, throughput=100.0),
        record("c", 1, throughput=100.0),
        record("d", 2, throughput=100.0),
    )
    movable = {"a", "b", "c", "d"}
    assert should_switch(view, EQUAL3, "a", 0, movable=movable).stage is not None  # the defect
    real = {"a", "b", "c", "d"}.__contains__
    decision = should_switch(view, EQUAL3, "a", 0, movable=movable, verified=real)
    assert decision.stage is None and "only active replica of stage 0" in decision.reason


def test_a_record_under_a_ground_key_does_not_win_the_election() -> None:
    """The node to move is the lowest-ranked of those that could: a record under a key
    ground to the lowest rank, that never moves, stopped every move of the swarm."""
    ground = min((f"z{i}" for i in range(64)), key=lambda p: (peer_rank(p), p))
    honest = sorted(f"h{i}" for i in range(3))
    assert all(peer_rank(ground) < peer_rank(p) for p in honest)
    view = directory(
        *(record(p, 0, throughput=100.0) for p in honest),
        record(ground, 0, throughput=100.0),
        record("d", 1, throughput=100.0),
    )
    stay = [should_switch(view, EQUAL3, p, 0) for p in honest]
    assert all(d.stage is None and ground[:12] in d.reason for d in stay)  # the defect
    real = set(honest + ["d"]).__contains__
    decisions = {p: should_switch(view, EQUAL3, p, 0, verified=real) for p in honest}
    assert sum(d.stage == 2 for d in decisions.values()) == 1  # one honest node moves


def test_non_active_nodes_do_not_switch() -> None:
    view = directory(
        record("w", 0, NodeState.WARMING, throughput=100.0),
        record("a", 0, throughput=100.0),
    )
    assert "only active nodes" in should_switch(view, EQUAL3, "w", 0).reason


def test_stays_when_the_gain_is_below_the_margin() -> None:
    # Bottleneck 200 (stage 1). Moving a 100 node from stage 0 (300) gives 200/300: no gain.
    view = directory(
        *(record(f"a{i}", 0, throughput=100.0) for i in range(3)),
        *(record(f"b{i}", 1, throughput=100.0) for i in range(2)),
    )
    for peer, stage in [("a0", 0), ("a1", 0), ("b0", 1)]:
        decision = should_switch(view, [1.0, 1.0], peer, stage)
        assert decision.stage is None and "no move raises" in decision.reason


def test_margin_is_respected() -> None:
    # Capacities 200/100; a 20-node moving gives 180/120: +20%, below 1.25, above 1.1.
    view = directory(
        record("big", 0, throughput=100.0),
        record("small", 0, throughput=20.0),
        record("mid", 0, throughput=80.0),
        record("b", 1, throughput=100.0),
    )
    costs = [1.0, 1.0]
    assert should_switch(view, costs, "small", 0).stage is None
    assert should_switch(view, costs, "small", 0, margin=1.1).stage in (None, 1)
    elected = [
        p for p in ("big", "small", "mid") if should_switch(view, costs, p, 0, margin=1.1).stage
    ]
    assert len(elected) == 1


def test_after_a_move_the_reverse_does_not_look_good() -> None:
    view = directory(
        record("a", 0, throughput=100.0),
        record("b", 0, throughput=100.0),
        record("c", 1, throughput=50.0),
    )
    movers = [p for p in "ab" if should_switch(view, [1.0, 1.0], p, 0).stage == 1]
    assert len(movers) == 1
    mover = movers[0]
    other = "b" if mover == "a" else "a"
    after = directory(
        record(other, 0, throughput=100.0),
        record(mover, 1, throughput=100.0),
        record("c", 1, throughput=50.0),
    )
    for peer, stage in [(mover, 1), ("c", 1), (other, 0)]:
        assert should_switch(after, [1.0, 1.0], peer, stage).stage is None


def _simulate(placement: dict[str, tuple[int, float]], costs: list[float], rounds: int):
    """Synchronous rounds: every node decides on the same view, all moves apply at once.
    placement: peer -> (stage, power). Yields (sorted stage capacities, moves) per round."""
    for _ in range(rounds):
        view = directory(
            *(record(p, s, throughput=w / costs[s]) for p, (s, w) in placement.items())
        )
        decisions = {p: should_switch(view, costs, p, s) for p, (s, _) in placement.items()}
        moves = {p: d.stage for p, d in decisions.items() if d.stage is not None}
        caps = [0.0] * len(costs)
        for s, w in placement.values():
            caps[s] += w / costs[s]
        yield tuple(sorted(round(c, 6) for c in caps)), moves
        if not moves:
            return
        for p, target in moves.items():
            placement[p] = (target, placement[p][1])


@given(
    st.lists(st.tuples(st.integers(0, 2), st.floats(1.0, 100.0)), min_size=3, max_size=12),
    st.lists(st.floats(0.5, 2.0), min_size=3, max_size=3),
)
@settings(max_examples=60, deadline=None)
def test_no_oscillation_when_everyone_decides_at_once(
    nodes: list[tuple[int, float]], costs: list[float]
) -> None:
    placement = {f"n{i}": node for i, node in enumerate(nodes)}
    history = list(_simulate(placement, costs, rounds=40))
    assert not history[-1][1], "the swarm settles"
    scores = [score for score, _ in history]
    # Each move lifts the sorted capacities (worst first), so no configuration comes back.
    assert all(later > earlier for earlier, later in zip(scores, scores[1:], strict=False))
    assert all(len(moves) <= 1 for _, moves in history)


def test_two_nearly_equal_configurations_do_not_swap() -> None:
    # Stage capacities 190 vs 180: moving anyone makes the bottleneck worse.
    placement = {"a": (0, 100.0), "b": (0, 90.0), "c": (1, 95.0), "d": (1, 85.0)}
    history = list(_simulate(placement, [1.0, 1.0], rounds=5))
    assert len(history) == 1 and not history[0][1]


def test_unbalanced_swarm_converges_to_even() -> None:
    placement = {f"n{i}": (0, 10.0) for i in range(6)}
    history = list(_simulate(placement, [1.0, 1.0, 1.0], rounds=10))
    assert not history[-1][1]
    per_stage = [sum(1 for s, _ in placement.values() if s == k) for k in range(3)]
    assert per_stage == [2, 2, 2]


def test_switch_delay_is_bounded_deterministic_and_per_peer() -> None:
    delays = [switch_delay(f"p{i}", 42, 30.0) for i in range(50)]
    assert all(0 <= d < 30.0 for d in delays)
    assert len(set(delays)) == 50
    assert switch_delay("p1", 42, 30.0) == switch_delay("p1", 42, 30.0)
    assert switch_delay("p1", 42, 30.0) != switch_delay("p1", 43, 30.0)
    rng = random.Random(1)
    assert 0 <= switch_delay("p", rng, 5.0) < 5.0
    assert switch_delay("p", 1, 0.0) == 0.0


def test_pinned_nodes_do_not_win_the_mover_election():
    # Stage 2 is empty; stages 0 and 1 each have two replicas, so any of the four
    # could move. Whoever the hash elects, a movable node must move when the
    # others are pinned (--stage N): the election only counts movable nodes.
    peers = [f"peer-{i}" for i in range(4)]
    view = directory(*(record(p, i // 2, throughput=100.0) for i, p in enumerate(peers)))
    costs = [1.0, 1.0, 1.0]
    for movable in peers:
        decision = should_switch(view, costs, movable, peers.index(movable) // 2, movable={movable})
        assert decision.stage == 2, (movable, decision.reason)
