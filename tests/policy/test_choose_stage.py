"""choose_stage: simultaneous joiners agree and spread; empty and cheap-to-fill stages first."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from agora_node.protocol.manifest import Manifest, ModelSpec, StageSpec
from agora_node.protocol.records import NodeState
from agora_node.stages.manifest_files import load_manifest
from agora_node.stages.memory import MEMORY_HEADROOM, stage_device_bytes, stages_that_fit
from agora_node.stages.placement import choose_stage, stage_costs

from .helpers import counts, directory, record

pytestmark = pytest.mark.timeout(60)

EQUAL3 = [1.0, 1.0, 1.0]
peer_ids = st.lists(st.text("0123456789abcdef", min_size=6, max_size=12), unique=True)


def joiners(n: int, prefix: str = "peer") -> list[str]:
    return [f"{prefix}-{i}" for i in range(n)]


def settle(peers: list[str], costs: list[float], *fixed) -> dict[str, int]:
    """What the daemon does: choose on an empty view, announce joining, choose again on
    the full view. Returns the second (agreed) choice of each peer."""
    first = {p: choose_stage(directory(*fixed), costs, p).stage for p in peers}
    announced = [record(p, s, NodeState.JOINING) for p, s in first.items()]
    view = directory(*fixed, *announced)
    return {p: choose_stage(view, costs, p).stage for p in peers}


def test_six_simultaneous_joiners_end_two_two_two() -> None:
    assignment = settle(joiners(6), EQUAL3)
    assert counts(assignment, 3) == [2, 2, 2]


@given(peer_ids.filter(lambda ps: len(ps) == 6))
@settings(max_examples=50, deadline=None)
def test_any_six_peer_ids_end_two_two_two(peers: list[str]) -> None:
    assert counts(settle(peers, EQUAL3), 3) == [2, 2, 2]


def test_seven_joiners_with_one_active_node() -> None:
    existing = record("veteran", 1, NodeState.ACTIVE, throughput=120.0)
    assignment = settle(joiners(7), EQUAL3, existing)
    total = counts(assignment, 3)
    total[1] += 1
    assert sorted(total) == [2, 3, 3]


def test_joiners_committing_one_by_one_still_balance() -> None:
    """Nodes leave `joining` (commit) at different times; the rest re-plan around them."""
    rng = random.Random(7)
    peers = joiners(6, "n")
    committed: dict[str, int] = {}
    pending = list(peers)
    while pending:
        fixed = [record(p, s, NodeState.WARMING) for p, s in committed.items()]
        plan = {p: choose_stage(directory(*fixed), EQUAL3, p).stage for p in pending}
        view = directory(*fixed, *(record(p, s, NodeState.JOINING) for p, s in plan.items()))
        plan = {p: choose_stage(view, EQUAL3, p).stage for p in pending}
        peer = pending.pop(rng.randrange(len(pending)))
        committed[peer] = plan[peer]
    assert counts(committed, 3) == [2, 2, 2]


def test_same_view_gives_the_same_assignment_to_everyone() -> None:
    peers = joiners(9)
    view = directory(*(record(p, 0, NodeState.JOINING) for p in peers))
    # Every peer computes the whole fill; each one's own slot must match the others' view.
    choices = {p: choose_stage(view, EQUAL3, p) for p in peers}
    assert counts({p: c.stage for p, c in choices.items()}, 3) == [3, 3, 3]
    assert all("joining together" in c.reason for c in choices.values())


def test_an_empty_stage_is_chosen_first() -> None:
    view = directory(
        record("a", 0, throughput=50.0),
        record("b", 0, throughput=50.0),
        record("c", 2, throughput=1.0),
    )
    choice = choose_stage(view, EQUAL3, "new")
    assert choice.stage == 1
    assert choice.reason.startswith("stage 1 has the least capacity: 0 (0 replicas)")
    assert choice.replicas == (2, 0, 1)


@given(
    st.lists(st.tuples(st.integers(0, 3), st.floats(0, 1000)), max_size=12),
    st.integers(0, 3),
    st.text("xyz", min_size=1, max_size=5),
)
@example(placed=[(1, 5e-324), (3, 0.0)], hole=0, peer="xx")  # rates that round to 0
@settings(max_examples=100, deadline=None)
def test_a_lone_joiner_always_takes_an_empty_stage(
    placed: list[tuple[int, float]], hole: int, peer: str
) -> None:
    records = [record(f"p{i}", s, throughput=t) for i, (s, t) in enumerate(placed) if s != hole]
    choice = choose_stage(directory(*records), [1.0, 0.5, 2.0, 1.0], "new-" + peer)
    assert choice.replicas[choice.stage] == 0


def test_leaving_records_are_ignored() -> None:
    view = directory(
        record("a", 0),
        record("b", 1, NodeState.LEAVING),
        record("c", 2),
    )
    assert choose_stage(view, EQUAL3, "new").stage == 1


def test_a_peer_seen_twice_counts_once_at_its_newest_record() -> None:
    old = record("mover", 0, throughput=100.0)
    new = record("mover", 1, throughput=100.0)
    new.issued_at = old.issued_at + 10
    misfiled = record("ghost", 2, throughput=100.0)
    view = {0: [old, record("a", 0, throughput=100.0)], 1: [new, misfiled], 2: [], 5: [misfiled]}
    choice = choose_stage(view, EQUAL3, "new")
    assert choice.replicas == (1, 1, 0) and choice.stage == 2


def test_unknown_throughput_counts_as_the_median() -> None:
    # Stage 0: one fast node. Stage 1: two nodes that just joined (unknown) -> 2 x median.
    view = directory(
        record("fast", 0, throughput=300.0),
        record("slow", 2, throughput=100.0),
        record("j1", 1, NodeState.WARMING),
        record("j2", 1, NodeState.WARMING),
    )
    choice = choose_stage(view, EQUAL3, "new")
    assert choice.capacity == pytest.approx((300.0, 400.0, 100.0))
    assert choice.stage == 2


def test_a_twice_as_expensive_stage_gets_about_twice_the_replicas() -> None:
    peers = joiners(60)
    assignment = settle(peers, [1.0, 2.0, 1.0])
    c = counts(assignment, 3)
    assert c[1] == pytest.approx(2 * c[0], abs=1) and c[1] == pytest.approx(2 * c[2], abs=1)


def test_cost_weighting_with_known_throughputs() -> None:
    # A node's tokens/s on the expensive stage is half of what it does elsewhere,
    # so equal capacity means twice the replicas there.
    costs = [1.0, 2.0]
    view = directory(
        record("a", 0, throughput=100.0),
        record("b", 1, throughput=50.0),
        record("c", 1, throughput=50.0),
    )
    tie = choose_stage(view, costs, "new")
    assert tie.capacity == (100.0, 100.0) and "tied" in tie.reason
    view = directory(record("a", 0, throughput=100.0), record("b", 1, throughput=50.0))
    assert choose_stage(view, costs, "new").stage == 1  # 100 vs 50


def test_hash_tie_breaking_spreads_lone_joiners() -> None:
    """With nothing visible, joiners pick among tied stages by their own hash: all used."""
    stages = [choose_stage({}, [1.0] * 4, p).stage for p in joiners(200)]
    per_stage = counts(dict(enumerate(stages)), 4)
    assert min(per_stage) > 30


def test_own_throughput_is_used_for_the_caller() -> None:
    view = directory(record("a", 0, throughput=100.0), record("b", 1, throughput=100.0))
    fast = choose_stage(view, [1.0, 1.0, 1.0], "new", own_throughput=1000.0)
    assert fast.stage == 2 and fast.replicas == (1, 1, 0)


def test_manifest_and_costs_are_interchangeable() -> None:
    m = load_manifest("tiny")
    view = directory(record("a", 0, throughput=10.0))
    assert choose_stage(view, m, "new") == choose_stage(view, stage_costs(m), "new")


def test_costs_of_a_dense_uneven_cut() -> None:
    m = Manifest(
        model=ModelSpec(
            d_model=64,
            n_layers=6,
            n_heads=4,
            n_kv_heads=2,
            ffn_dim=128,
            subspace_rank=0,
            seq_len=32,
        ),
        stages=StageSpec(count=3, layers=(1, 4, 1)),
    )
    costs = stage_costs(m)
    assert sum(costs) / 3 == pytest.approx(1.0)
    assert costs[1] > 2 * max(costs[0], costs[2])
    assert costs[2] > costs[0]  # the head


def test_bad_costs_are_refused() -> None:
    with pytest.raises(ValueError):
        choose_stage({}, [1.0, 0.0], "p")


def test_a_joiner_takes_only_a_stage_its_device_can_hold() -> None:
    view = directory(record("a", 0, throughput=50.0), record("c", 2, throughput=1.0))
    assert choose_stage(view, EQUAL3, "new").stage == 1  # the empty stage ...
    held = choose_stage(view, EQUAL3, "new", can_hold=[0, 2])  # ... unless it cannot hold it
    assert held.stage == 2 and held.reason.startswith("stage 2 has the least capacity")
    assert choose_stage(view, EQUAL3, "new", can_hold=[0]).stage == 0
    with pytest.raises(ValueError, match="no stage"):
        choose_stage(view, EQUAL3, "new", can_hold=[])


def test_the_stages_a_device_can_hold_follow_the_memory_estimate() -> None:
    m = load_manifest("gpu-1b")
    need = [stage_device_bytes(m, s) / MEMORY_HEADROOM for s in range(m.num_stages)]
    assert stages_that_fit(m, None) is None  # memory not probed: every stage
    assert stages_that_fit(m, math.ceil(max(need))) == list(range(m.num_stages))
    assert stages_that_fit(m, int(min(need)) - 1) == []
    middle = math.ceil(sorted(need)[len(need) // 2])
    assert stages_that_fit(m, middle) == [s for s in range(m.num_stages) if need[s] <= middle]


def test_a_running_node_never_switches_to_a_stage_it_cannot_hold() -> None:
    from agora_node.node.joining import better_stage

    view = directory(*(record(p, 0, throughput=100.0) for p in "abc"), record("d", 1))
    movers = {p: better_stage(view, EQUAL3, p, 0) for p in "abc"}
    (mover,) = [p for p, d in movers.items() if d is not None]
    assert movers[mover].stage == 2
    assert better_stage(view, EQUAL3, mover, 0, can_hold=[0, 1]) is None
    assert better_stage(view, EQUAL3, mover, 0, can_hold=[2]).stage == 2
