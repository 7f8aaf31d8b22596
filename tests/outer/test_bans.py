"""A reducer drops the parts of members it banned (AllReduce(ignore=...)): the result
names the parts it used, so the witness agrees and every member ends equal."""

import pytest
import torch

from agora_node.comms.collective import Aggregation, AggregationSpec, GroupPlan
from tests.outer.helpers import all_equal, peers, random_values, run_group

pytestmark = pytest.mark.timeout(60)


async def test_a_banned_members_parts_are_dropped_by_the_reducer_that_banned_it() -> None:
    values = random_values(4, 1024, seed=3)
    bad = peers(4)[3]
    outs = await run_group(
        values,
        aggregation=AggregationSpec(method=Aggregation.MEAN),
        verify=True,
        ignore={"peer0": frozenset({bad})},
    )
    assert all_equal(outs) and all(o.consistent for o in outs.values())
    assert outs["peer0"].stats.ignored == {bad} and not outs["peer1"].stats.ignored
    plan = GroupPlan(round=0, phase="delta", members=tuple(values), numel=1024, block=64)
    lo, hi = plan.spans[plan.index("peer0")]
    honest = sum(values[p][lo:hi] for p in peers(3)) / 3
    everyone = sum(values[p][lo:hi] for p in peers(4)) / 4
    mixed = outs["peer1"].value[lo:hi]
    assert torch.allclose(mixed, honest, atol=1e-5) and not torch.allclose(mixed, everyone)
    lo, hi = plan.spans[plan.index("peer1")]  # a span whose reducer banned nobody
    assert torch.allclose(
        outs["peer1"].value[lo:hi], sum(values[p][lo:hi] for p in peers(4)) / 4, atol=1e-5
    )
