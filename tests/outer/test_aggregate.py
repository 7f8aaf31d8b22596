"""Aggregation rules: renormalized weighted mean, CenteredClip, trimmed mean."""

import dataclasses
import math

import pytest
import torch

from agora_node.comms.collective import Aggregation, AggregationSpec, aggregate

pytestmark = pytest.mark.timeout(60)

# without the norm screen, so that these tests see what each rule does on its own
CLIP = AggregationSpec(method=Aggregation.CENTERED_CLIP, max_norm_ratio=math.inf)
MEAN = AggregationSpec(max_norm_ratio=math.inf)


def honest(n: int, numel: int = 4096, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(numel, generator=g)
    return [base + 0.3 * torch.randn(numel, generator=g) for _ in range(n)]


def test_weighted_mean_renormalizes_over_what_arrived() -> None:
    xs = honest(3)
    got = aggregate(xs[:2], [3.0, 1.0], AggregationSpec()).value
    torch.testing.assert_close(got, 0.75 * xs[0] + 0.25 * xs[1])


def test_zero_weights_are_ignored_unless_all_are_zero() -> None:
    xs = honest(3)
    torch.testing.assert_close(
        aggregate(xs, [1.0, 0.0, 1.0], AggregationSpec()).value, (xs[0] + xs[2]) / 2
    )
    torch.testing.assert_close(aggregate(xs, [0.0, 0.0, 0.0], AggregationSpec()).value, sum(xs) / 3)


def test_weight_cap_limits_a_greedy_claim() -> None:
    xs = honest(2)
    spec = AggregationSpec(max_weight=10.0)
    torch.testing.assert_close(aggregate(xs, [1e12, 10.0], spec).value, (xs[0] + xs[1]) / 2)


@pytest.mark.parametrize("n_honest", [2, 3, 7])
def test_centered_clip_bounds_a_1000x_contribution(n_honest: int) -> None:
    xs = honest(n_honest)
    mean_h = sum(xs) / n_honest
    bad = 1000 * xs[0]
    out = aggregate([*xs, bad], [1.0] * (n_honest + 1), CLIP)
    assert out.clip_radius is not None and out.clip_radius > 0
    plain = aggregate([*xs, bad], [1.0] * (n_honest + 1), MEAN).value
    assert float((plain - mean_h).norm()) > 100 * out.clip_radius  # what the clip prevents
    assert float((out.value - mean_h).norm()) <= out.clip_radius


def test_centered_clip_leaves_agreeing_contributions_alone() -> None:
    xs = honest(4)
    out = aggregate(xs, [1.0] * 4, CLIP)
    # nothing is clipped when all are within tau of the start: the fixed point is near the mean
    assert float((out.value - sum(xs) / 4).norm()) < 0.05 * float(xs[0].norm())


def test_trimmed_mean_drops_extremes_per_coordinate() -> None:
    xs = torch.tensor([[0.0, 10.0], [1.0, 11.0], [2.0, 12.0], [1000.0, -1000.0]])
    spec = AggregationSpec(
        method=Aggregation.TRIMMED_MEAN, trim_fraction=0.25, max_norm_ratio=math.inf
    )
    got = aggregate(list(xs), [1.0] * 4, spec).value
    torch.testing.assert_close(got, torch.tensor([1.5, 10.5]))


def test_trimmed_mean_weights_the_kept_values() -> None:
    xs = [torch.tensor([0.0]), torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([3.0])]
    spec = AggregationSpec(
        method=Aggregation.TRIMMED_MEAN, trim_fraction=0.25, max_norm_ratio=math.inf
    )
    got = aggregate(xs, [3.0, 3.0, 1.0, 3.0], spec).value
    torch.testing.assert_close(got, torch.tensor([(3 * 1.0 + 2.0) / 4]))


def test_contributions_with_out_of_range_norms_are_refused_and_counted() -> None:
    xs = honest(4)
    for method in Aggregation:
        spec = AggregationSpec(method=method)
        out = aggregate([*xs, 1000 * xs[0]], [1.0] * 5, spec)
        assert out.refused == (4,)
        assert float((out.value - sum(xs) / 4).norm()) < 0.5 * float(xs[0].norm())
    # an absolute bound refuses whatever the others send; two cannot outvote each other
    assert aggregate(xs[:2], [1.0, 1.0], AggregationSpec(max_norm=1e-3)).refused == (0, 1)
    assert aggregate([xs[0], 1000 * xs[1]], [1.0, 1.0], AggregationSpec()).refused == ()
    # warming members (weight 0) are not counted towards the median
    zeros = [torch.zeros_like(xs[0])] * 3
    assert aggregate([*zeros, *xs[:2]], [0, 0, 0, 1, 1], AggregationSpec()).refused == ()


def test_no_claim_weighs_more_than_the_median_claim() -> None:
    xs = honest(4)
    trim = AggregationSpec(method=Aggregation.TRIMMED_MEAN, trim_fraction=0.0)
    out = aggregate(xs, [1.0, 1.0, 1.0, 1000.0], trim).value
    torch.testing.assert_close(out, sum(xs) / 4)
    # two claims: only the absolute cap applies (one cannot outvote the other)
    spec = dataclasses.replace(trim, max_weight=10.0)
    torch.testing.assert_close(aggregate(xs[:2], [1.0, 3.0], spec).value, (xs[0] + 3 * xs[1]) / 4)
    # the weighted mean keeps token weighting exact (plain DiLoCo)
    torch.testing.assert_close(
        aggregate(xs[:3], [1.0, 1.0, 2.0], MEAN).value, (xs[0] + xs[1] + 2 * xs[2]) / 4
    )
