"""Groups and spans are pure functions of the shared view."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agora_node.comms.collective import GroupPlan, partition
from agora_node.comms.collective.plan import round_seed, span_bounds

pytestmark = pytest.mark.timeout(60)

peer_ids = st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=40, unique=True)


@given(peer_ids, st.integers(0, 9), st.binary(min_size=1, max_size=8))
def test_partition_covers_everyone_once_in_balanced_groups(peers, size, seed) -> None:
    groups = partition(peers, size, seed)
    flat = [p for g in groups for p in g]
    assert sorted(flat) == sorted(peers)
    sizes = [len(g) for g in groups]
    assert max(sizes) - min(sizes) <= 1
    if size == 0 or len(peers) < size:
        assert len(groups) == 1
    else:
        assert min(sizes) >= size


@given(peer_ids, st.integers(1, 5))
def test_partition_ignores_input_order(peers, size) -> None:
    seed = round_seed("run", 0, 3, "delta", peers)
    assert partition(peers, size, seed) == partition(list(reversed(peers)), size, seed)


def test_groups_change_from_round_to_round() -> None:
    peers = [f"p{i}" for i in range(12)]
    grouping = {
        tuple(partition(peers, 3, round_seed("run", 0, t, "delta", peers))) for t in range(5)
    }
    assert len(grouping) > 1


@given(st.integers(0, 100_000), st.integers(1, 9), st.sampled_from([1, 64, 256]))
def test_spans_are_block_aligned_and_cover_the_vector(numel, parts, block) -> None:
    spans = span_bounds(numel, parts, block)
    assert len(spans) == parts
    assert spans[0][0] == 0 and spans[-1][1] == numel
    for (lo, hi), (lo2, _) in zip(spans, spans[1:], strict=False):
        assert hi == lo2 and lo <= hi
        assert lo % block == 0 or lo == numel  # only empty tail spans start off-block


def test_owner_chain_visits_every_member() -> None:
    plan = GroupPlan(round=1, phase="delta", members=("a", "b", "c"), numel=1000, block=64)
    assert [plan.owner(1, a) for a in range(3)] == ["b", "c", "a"]


def test_group_id_depends_on_members_round_and_phase() -> None:
    base = dict(round=1, phase="delta", members=("a", "b"), numel=10, block=4)
    ids = {
        GroupPlan(**base).group_id,
        GroupPlan(**{**base, "round": 2}).group_id,
        GroupPlan(**{**base, "phase": "anchor"}).group_id,
        GroupPlan(**{**base, "members": ("b", "a")}).group_id,
    }
    assert len(ids) == 4
