"""Property: with message loss up to 10% and no real failure, nobody is ever
declared dead, however long the (simulated) run."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from swim_helpers import cluster, dead_events

from agora_node.comms.membership.messages import Status

pytestmark = pytest.mark.timeout(120)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    loss=st.floats(min_value=0.0, max_value=0.10),
    members=st.integers(min_value=3, max_value=24),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
    rtt_ms=st.sampled_from([2, 20, 80]),
)
def test_no_false_deaths_under_loss(loss: float, members: int, seed: int, rtt_ms: int) -> None:
    net = cluster(members, loss=loss, seed=seed, rtt_s=rtt_ms / 1000)
    net.run_until(300.0)
    assert dead_events(net) == []
    # and the views stay whole: everyone still counts everyone
    for node in net.nodes:
        assert len(node.alive_members()) == members - 1
        assert all(v.status in (Status.ALIVE, Status.SUSPECT) for v in node.members())
