"""Placement and routing under a stranger's numbers and identities (pure logic)."""

from __future__ import annotations

import math
import random

import pytest

from agora_node.comms.routing import Router, RouterConfig
from agora_node.stages import placement

from .helpers import directory, record

pytestmark = pytest.mark.timeout(60)


# ---- placement and routing never believe infinity -----------------------------------------


@pytest.mark.parametrize("hostile", [math.inf, math.nan, -math.inf, -5.0])
def test_placement_treats_a_non_finite_rate_as_unknown(hostile):
    honest = directory(record("a", 0, throughput=100.0), record("b", 1, throughput=100.0))
    base = placement.choose_stage(honest, [1.0, 1.0], "joiner")
    attacked = directory(
        record("a", 0, throughput=100.0),
        record("b", 1, throughput=100.0),
        record("evil", 0, throughput=hostile),
    )
    choice = placement.choose_stage(attacked, [1.0, 1.0], "joiner")
    assert all(math.isfinite(c) for c in choice.capacity), choice
    # evil counts as one replica of median power at most, never as infinite capacity.
    assert choice.capacity[0] <= 2 * base.capacity[0] + 1e-9


@pytest.mark.parametrize("hostile", [math.inf, math.nan, 1e308])
def test_routing_never_prefers_a_peer_for_an_impossible_rate(hostile):
    r = Router(RouterConfig(tokens_per_item=1024), random.Random(0))
    r.update_announced(
        [record("honest", 1, throughput=4000.0), record("evil", 1, throughput=hostile)]
    )
    if hostile == 1e308:  # finite: believed by the router, refused by verify_record upstream
        return
    assert r.item_time("evil") is None  # unknown, like a new peer: probed, not flooded
    r.on_sent("evil", now=0.0)  # one probe out
    picks = {r.choose(["honest", "evil"], now=0.0) for _ in range(20)}
    assert picks == {"honest"}


def test_routing_caps_an_absurd_queue_and_survives_a_non_finite_latency():
    r = Router(RouterConfig(tokens_per_item=1024), random.Random(0))
    r.update_announced([record("evil", 1, throughput=1000.0, queue=10**400)])
    assert math.isfinite(r.expected_time("evil"))
    r.on_sent("evil", 0.0)
    r.on_success("evil", math.nan, 0.0)
    assert math.isfinite(r.expected_time("evil"))


def test_router_table_stays_bounded_under_thousands_of_identities():
    r = Router(RouterConfig(tokens_per_item=1024, max_peers=64), random.Random(0))
    r.update_announced([record("honest", 1, throughput=4000.0)])
    r.on_sent("honest", 0.0)  # work in flight: never forgotten
    for batch in range(50):
        r.update_announced([record(f"sybil-{batch}-{i}", 1, throughput=1.0) for i in range(200)])
        for i in range(5):
            r.on_failure(f"probe-{batch}-{i}", 0.0, "error")
    assert len(r.snapshot()) <= 64
    assert "honest" in r.snapshot()
