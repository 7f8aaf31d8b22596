"""Aggregation rules: renormalized weighted mean, CenteredClip, trimmed mean."""

import dataclasses
import math

import pytest
import torch

from agora_node.comms.collective import Aggregation, AggregationSpec, aggregate
from agora_node.comms.collective.aggregate import loo_cosines

pytestmark = pytest.mark.timeout(60)

# without the norm and direction screens, so that these tests see what each rule does alone
CLIP = AggregationSpec(method=Aggregation.CENTERED_CLIP, max_norm_ratio=math.inf, min_cosine=-1)
MEAN = AggregationSpec(max_norm_ratio=math.inf, min_cosine=-1)


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
        method=Aggregation.TRIMMED_MEAN, trim_fraction=0.25, max_norm_ratio=math.inf, min_cosine=-1
    )
    got = aggregate(list(xs), [1.0] * 4, spec).value
    torch.testing.assert_close(got, torch.tensor([1.5, 10.5]))


def test_trimmed_mean_weights_the_kept_values() -> None:
    xs = [torch.tensor([0.0]), torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([3.0])]
    spec = AggregationSpec(
        method=Aggregation.TRIMMED_MEAN, trim_fraction=0.25, max_norm_ratio=math.inf, min_cosine=-1
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


def noisy(n: int, seed: int, noise: float = 2.0) -> list[torch.Tensor]:
    """Pairwise cosine about 1 / (1 + noise^2): 0.2 at the default, far below the honest
    pseudo-gradients measured on tiny (leave-one-out cosines >= 0.64, docs/security.md)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(4096, generator=g)
    return [base + noise * torch.randn(4096, generator=g) for _ in range(n)]


@pytest.mark.parametrize("n_honest", [2, 3, 4, 7])
def test_a_sign_flipped_member_is_refused_for_its_direction_and_counted(n_honest: int) -> None:
    for seed in range(5):
        xs = noisy(n_honest + 1, seed)
        bad = -xs[-1]  # its own delta, flipped
        for method in Aggregation:
            out = aggregate([*xs[:-1], bad], [1.0] * (n_honest + 1), AggregationSpec(method=method))
            assert out.misdirected == (n_honest,) and out.refused == ()


def test_a_flip_aimed_at_one_honest_member_gets_only_the_liar_refused() -> None:
    # sending minus an honest member's part drags that member's reference towards minus
    # itself; leaving one more out of the median clears it
    for seed in range(5):
        xs = noisy(4, seed)
        assert min(loo_cosines([*xs, -xs[0]])[:4]) < 0.05  # what the plain rule would judge
        assert aggregate([*xs, -xs[0]], [1.0] * 5, AggregationSpec()).misdirected == (4,)


def test_a_random_direction_of_a_normal_norm_is_refused() -> None:
    xs = honest(4)
    noise = torch.randn(xs[0].shape, generator=torch.Generator().manual_seed(9))
    bad = noise * (xs[0].norm() / noise.norm())
    assert aggregate([bad, *xs], [1.0] * 5, AggregationSpec()).misdirected == (0,)


def test_the_reference_leaves_the_judged_member_out() -> None:
    # three agree, one flips: with itself in the median (2 of 4 flipped) the reference
    # would be pulled to zero; left out, the others' median says it points away
    xs = honest(3, seed=4)
    cos = loo_cosines([*xs, -xs[1]])
    assert all(c > 0.5 for c in cos[:3]) and cos[3] < -0.5


def test_honest_noisy_correlated_members_are_never_refused() -> None:
    for n in (3, 4, 5, 8):
        for seed in range(10):
            xs = noisy(n, seed)
            assert aggregate(xs, [1.0] * n, AggregationSpec()).misdirected == ()
            assert min(loo_cosines(xs)) > 0.1


def test_no_direction_decision_below_three_or_against_a_majority() -> None:
    xs = honest(2)
    assert aggregate([xs[0], -xs[0]], [1.0, 1.0], AggregationSpec()).misdirected == ()
    # four unrelated directions: most disagree with the rest, there is nothing to refuse for
    g = torch.Generator().manual_seed(3)
    unrelated = [torch.randn(4096, generator=g) for _ in range(4)]
    assert aggregate(unrelated, [1.0] * 4, AggregationSpec(min_cosine=0.5)).misdirected == ()
    # zero vectors carry no direction; -1 turns the check off
    zero = torch.zeros_like(xs[0])
    assert aggregate([*honest(3), zero], [1.0] * 4, AggregationSpec()).misdirected == ()
    off = AggregationSpec(min_cosine=-1)
    assert aggregate([*honest(4), -xs[0]], [1.0] * 5, off).misdirected == ()
    with pytest.raises(ValueError):
        AggregationSpec(min_cosine=1.0)


def test_the_direction_decision_does_not_depend_on_the_order_of_parts() -> None:
    # a span's owner and its witness see the same parts in different orders
    xs = [*honest(4, seed=7), -honest(1, seed=8)[0]]
    cos = loo_cosines(xs)
    perm = [3, 0, 4, 2, 1]
    assert loo_cosines([xs[i] for i in perm]) == [cos[i] for i in perm]
    assert loo_cosines(xs, chunk=1000) == pytest.approx(cos, abs=1e-12)


def test_the_min_max_network_sorts_columns_exactly() -> None:
    from agora_node.comms.collective.aggregate import _sorted_columns

    g = torch.Generator().manual_seed(1)
    for m in range(1, 11):
        x = torch.randn(m, 257, generator=g, dtype=torch.float64)
        x[:, :5] = 0.0  # ties
        assert torch.equal(torch.stack(_sorted_columns(list(x))), x.sort(dim=0).values)
