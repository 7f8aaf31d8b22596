"""Placement on tiny with compute rates as the worker measures them: two replicas per
stage stay put, and only a measurably slower stage draws a node.

A record's throughput is a node's compute rate on its own stage (tokens per
compute-second, each micro-batch once); placement turns it into power = rate x
stage cost, and a stage's capacity = the sum of its replicas' rates. Equal nodes
then have equal power on every stage, whatever stage they serve.
"""

from __future__ import annotations

import pytest

from agora_node.stages.manifest_files import load_manifest
from agora_node.stages.placement import Directory, should_switch, stage_costs

from .helpers import directory, record

pytestmark = pytest.mark.timeout(60)

TINY = load_manifest("tiny")

# Compute rates of the four tiny stages, one core of the 2-vCPU dev machine, micro-batch
# 8 x 128, 20 micro-batches through StageWorkers chained in one process.
MEASURED = [7531.0, 7425.0, 8083.0, 5669.0]
# The same run as the worker counted before: tokens in forward and again in backward at
# every stage but the last, an EMA of per-call rates (the 7,000-10,000 "tok/s").
DOUBLE_COUNTED = [15448.0, 14905.0, 15639.0, 5723.0]


def two_per_stage(rates: list[float]) -> tuple[Directory, list[tuple[str, int]]]:
    nodes = [(f"s{stage}r{k}", stage) for stage in range(len(rates)) for k in range(2)]
    return directory(*(record(p, s, throughput=rates[s]) for p, s in nodes)), nodes


def moves(rates: list[float]) -> dict[str, int]:
    view, nodes = two_per_stage(rates)
    decisions = {p: should_switch(view, TINY, p, s) for p, s in nodes}
    return {p: d.stage for p, d in decisions.items() if d.stage is not None}


def test_measured_rates_are_equal_power_on_every_stage() -> None:
    powers = [rate * cost for rate, cost in zip(MEASURED, stage_costs(TINY), strict=True)]
    assert max(powers) / min(powers) < 1.15, powers  # the cost model matches the measurement


def test_equal_nodes_two_per_stage_do_not_move() -> None:
    assert moves(MEASURED) == {}


def test_double_counted_rates_moved_a_node_to_the_last_stage() -> None:
    # The bug: stages 0-2 looked twice as fast, so the last stage drew their replicas.
    assert list(moves(DOUBLE_COUNTED).values()) == [3]


@pytest.mark.parametrize("slow", range(4))
def test_a_measurably_slower_stage_draws_one_node(slow: int) -> None:
    rates = list(MEASURED)
    rates[slow] /= 3  # both replicas of `slow` are three times slower machines
    moved = moves(rates)
    assert list(moved.values()) == [slow], moved


def test_a_slightly_slower_stage_does_not() -> None:
    # Moving a replica halves its stage: that only pays when a stage is ~2.5x behind.
    rates = list(MEASURED)
    rates[1] /= 1.8
    assert moves(rates) == {}
