"""How a reducer combines the contributions to its span: pure tensor functions.

- weighted mean (default): sum w_i x_i / sum w_i over the contributions that
  arrived, so a missing member's weight simply drops out (renormalization);
- CenteredClip (Karimireddy et al. 2021): start at the coordinate-wise median and
  repeatedly move towards every contribution, each pull clipped to radius tau. A
  single contribution can then move the result by at most its weight share of
  tau per iteration, however large it is. tau defaults to `clip_scale` times the
  median distance of the contributions from the median, so it adapts to the
  current size of pseudo-gradients without a tuned constant;
- trimmed mean: per coordinate drop the k largest and k smallest values
  (k = floor(trim_fraction * n)), weighted mean of the rest.

Before any of them, contributions whose L2 norm is out of range are refused (and
counted): above `max_norm_ratio` times the median norm of the span's
contributions (only with three or more, so the median is not one of two), or
above the absolute `max_norm`. A 1000x-scaled delta never reaches the mean.
Then, with three or more left, contributions pointing away from what the others
agree on are refused too: the cosine of each with the coordinate-wise median of
the *others* (leave-one-out, so a liar cannot pull its own reference) must exceed
`min_cosine`, or exceed it once any one other contribution is left out of that median
too (so a liar among the others cannot get an honest member refused;
`direction_outliers`). A sign-flipped or random delta of a normal
norm is caught here. Both checks depend only on the set of parts, not on their
order, so a span's owner and its witness refuse the same parts.

Weights are capped at `max_weight` here, by the reducer, since a sender's claim
cannot be trusted, and for the robust rules (with three or more claims) at the
median claim, so one member claiming the most tokens it could have processed
outweighs nobody (the weighted mean keeps exact token weighting: plain DiLoCo).
Contributions with weight 0 (warming newcomers) are ignored unless every weight
is 0, in which case all count equally (a group of newcomers still mixes). They are
no reference for the screens either: a newcomer's delta is legitimately small (it
joined mid-round, its fresh optimizer is in its lr warmup), and as references they
set the median norm below the counting members', which were all refused and flagged.
So a group of one counting member, warming ones and a liar has two parts to screen,
none, and what bounds the liar there is the adopting replica (node/outer_bounds.py).

CenteredClip starts from the true coordinate-wise median: of an even count, the mean
of the two middle values. (torch's `median` takes the lower one: of two parts, the
coordinate-wise minimum, so a liar sending very negative values was the start, at
distance 0, tau was 0 and the result was the liar's part.) With two parts nothing is
robust: the median is their mean, and the best the caller can do is bound how far the
result may lie from its own part (node/outer_bounds.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum

import torch
from torch import Tensor

from agora_node.protocol.manifest import DEFAULT_MIN_COSINE


class Aggregation(StrEnum):
    MEAN = "mean"
    CENTERED_CLIP = "centered_clip"
    TRIMMED_MEAN = "trimmed_mean"


@dataclass(frozen=True, kw_only=True)
class AggregationSpec:
    method: Aggregation = Aggregation.MEAN
    clip_scale: float = 2.0
    """CenteredClip radius tau = clip_scale * median distance from the coordinate-wise median."""
    clip_radius: float | None = None
    """A fixed tau instead of the adaptive one."""
    clip_iters: int = 5
    trim_fraction: float = 0.2
    max_weight: float = math.inf
    """Cap on one contribution's weight (tokens a member could have processed in a round)."""
    max_norm_ratio: float = 10.0
    """Refuse a contribution whose norm exceeds this times the median norm (3+ of them)."""
    max_norm: float = math.inf
    """Refuse a contribution whose norm exceeds this, whatever the others send."""
    min_cosine: float = DEFAULT_MIN_COSINE
    """Refuse a contribution whose cosine with the median of the others (3+ of them in
    all) is at most this (`direction_outliers`); -1: no direction check."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", Aggregation(self.method))
        if self.clip_scale <= 0 or self.clip_iters < 1:
            raise ValueError("clip_scale must be > 0 and clip_iters >= 1")
        if not self.max_norm_ratio > 1 or not self.max_norm > 0:
            raise ValueError("max_norm_ratio must be > 1 and max_norm > 0")
        if not 0 <= self.trim_fraction < 0.5:
            raise ValueError("trim_fraction must be in [0, 0.5)")
        if not -1 <= self.min_cosine < 1:
            raise ValueError("min_cosine must be in [-1, 1) (-1: no direction check)")


@dataclass(frozen=True)
class Aggregate:
    value: Tensor
    clip_radius: float | None = None
    """tau used by CenteredClip (None for the other methods)."""
    refused: tuple[int, ...] = ()
    """Indices of the contributions refused for an out-of-range norm."""
    misdirected: tuple[int, ...] = ()
    """Indices of the contributions refused for their direction (`direction_outliers`)."""


def norm_outliers(values: list[Tensor], spec: AggregationSpec) -> set[int]:
    """Indices of contributions whose norm is out of range (see the module docstring)."""
    norms = [float(torch.linalg.vector_norm(v.float(), dtype=torch.float64)) for v in values]
    limit = spec.max_norm
    if len(norms) >= 3:
        median = sorted(norms)[(len(norms) - 1) // 2]
        limit = min(limit, spec.max_norm_ratio * median) if median > 0 else limit
    return {i for i, n in enumerate(norms) if not n <= limit}


def loo_cosines(values: list[Tensor], chunk: int = 1 << 20) -> list[float | None]:
    """Each contribution's cosine with the coordinate-wise median of the others (None where
    either vector is zero: no direction to judge)."""
    return median_cosines(values, [(i, frozenset()) for i in range(len(values))], chunk)


def median_cosines(
    values: list[Tensor], jobs: list[tuple[int, frozenset[int]]], chunk: int = 1 << 20
) -> list[float | None]:
    """For each job (i, left_out): the cosine of values[i] with the coordinate-wise median
    of the values other than i and `left_out` (of an even count: the mean of the two middle
    ones). Columns go `chunk` at a time, so memory stays a few chunks whatever the span's
    size. Order-independent: sorted columns and float64 sums over fixed chunks give the
    same bits for any order of `values` (a span's owner and witness list parts differently)."""
    flat = [v.reshape(-1) for v in values]
    dot, own_sq, ref_sq = [0.0] * len(jobs), [0.0] * len(jobs), [0.0] * len(jobs)
    for lo in range(0, flat[0].numel(), chunk):
        cols = torch.stack([v[lo : lo + chunk].double() for v in flat])
        for k, (i, left_out) in enumerate(jobs):
            rest = [r for r in range(len(values)) if r != i and r not in left_out]
            others = _sorted_columns([cols[r] for r in rest])
            m = len(rest)
            ref = others[m // 2] if m % 2 else (others[m // 2 - 1] + others[m // 2]) / 2
            dot[k] += float(cols[i] @ ref)
            own_sq[k] += float(cols[i] @ cols[i])
            ref_sq[k] += float(ref @ ref)
    return [
        d / math.sqrt(a * b) if a > 0 and b > 0 else None
        for d, a, b in zip(dot, own_sq, ref_sq, strict=True)
    ]


def _sorted_columns(rows: list[Tensor]) -> list[Tensor]:
    """Each column of `rows` sorted (row k holds the k-th smallest): an odd-even
    transposition network of elementwise min/max for a few rows (several times faster
    than `sort` along a short axis), `sort` beyond."""
    if len(rows) > 8:
        return list(torch.stack(rows).sort(dim=0).values)
    rows = list(rows)
    for step in range(len(rows)):
        for k in range(step % 2, len(rows) - 1, 2):
            rows[k], rows[k + 1] = (
                torch.minimum(rows[k], rows[k + 1]),
                torch.maximum(rows[k], rows[k + 1]),
            )
    return rows


def direction_outliers(values: list[Tensor], spec: AggregationSpec) -> set[int]:
    """Indices of contributions pointing away from what the others agree on, among three
    or more: the cosine with the median of the others is at most `min_cosine`, and stays
    so with any one other contribution also left out of the median (a single liar in the
    reference cannot get an honest member refused: with three members the median of two
    is their mean, half of it the liar's). Refused only while they are a minority (when
    most disagree with the rest there is no agreement to measure against; CenteredClip
    still bounds them)."""
    n = len(values)
    if spec.min_cosine <= -1 or n < 3:
        return set()

    def away(c: float | None) -> bool:
        return c is not None and c <= spec.min_cosine

    suspects = [i for i, c in enumerate(loo_cosines(values)) if away(c)]
    jobs = [(i, frozenset({j})) for i in suspects for j in range(n) if j != i]
    second = median_cosines(values, jobs) if jobs else []
    cleared = {i for (i, _), c in zip(jobs, second, strict=True) if not away(c)}
    refused = set(suspects) - cleared
    return refused if 2 * len(refused) < n else set()


def aggregate(values: list[Tensor], weights: list[float], spec: AggregationSpec) -> Aggregate:
    """Combine equally shaped float32 tensors; `values` must not be empty."""
    if not values:
        raise ValueError("nothing to aggregate")
    if len(values) != len(weights):
        raise ValueError("one weight per value")
    capped = [min(float(w), spec.max_weight) for w in weights]
    claims = sorted(w for w in capped if w > 0)
    robust = spec.method is not Aggregation.MEAN
    if robust and len(claims) >= 3:  # nobody weighs more than the median claim
        median_claim = claims[(len(claims) - 1) // 2]
        capped = [min(w, median_claim) for w in capped]
    live = [i for i, w in enumerate(capped) if w > 0] or list(range(len(values)))
    outliers = norm_outliers([values[i] for i in live], spec)
    refused = tuple(live[j] for j in sorted(outliers))
    if len(refused) == len(live):  # nothing in range (only with an absolute bound): no update
        return Aggregate(torch.zeros_like(values[0], dtype=torch.float32), None, refused)
    in_range = [i for i in live if i not in refused]
    away = direction_outliers([values[i] for i in in_range], spec)
    misdirected = tuple(in_range[j] for j in sorted(away))
    kept = [(values[i], capped[i]) for i in in_range if i not in misdirected]
    if all(w <= 0 for _, w in kept):  # all newcomers: count everyone equally
        kept = [(v, 1.0) for v, _ in kept]
    if len(kept) == 1:
        value = kept[0][0].float().clone()
        return Aggregate(value, 0.0 if _clips(spec) else None, refused, misdirected)
    stacked = torch.stack([v.float() for v, _ in kept])
    w = torch.tensor([float(w) for _, w in kept], dtype=torch.float64)
    w = (w / w.sum()).to(torch.float32)
    if spec.method is Aggregation.CENTERED_CLIP:
        return replace(centered_clip(stacked, w, spec), refused=refused, misdirected=misdirected)
    if spec.method is Aggregation.TRIMMED_MEAN:
        value = trimmed_mean(stacked, w, spec.trim_fraction)
        return Aggregate(value, refused=refused, misdirected=misdirected)
    return Aggregate(weighted_mean(stacked, w), refused=refused, misdirected=misdirected)


def _clips(spec: AggregationSpec) -> bool:
    return spec.method is Aggregation.CENTERED_CLIP


def weighted_mean(stacked: Tensor, w: Tensor) -> Tensor:
    """sum_i w_i x_i with w already normalized; one row per contribution."""
    return torch.tensordot(w, stacked, dims=1)


def coordinate_median(stacked: Tensor) -> Tensor:
    """The coordinate-wise median of the rows; of an even count, the mean of the two middle
    values (torch's `median` gives the lower one: of two rows, their minimum)."""
    n = stacked.shape[0]
    lower = stacked.median(dim=0).values  # the ((n - 1) // 2)-th smallest, counting from 0
    if n % 2:
        return lower
    upper = stacked.kthvalue(n // 2 + 1, dim=0).values
    return lower / 2 + upper / 2  # halves first: no overflow near the float32 limit


def centered_clip(stacked: Tensor, w: Tensor, spec: AggregationSpec) -> Aggregate:
    v = coordinate_median(stacked)
    tau = spec.clip_radius
    if tau is None:
        tau = spec.clip_scale * float(_distances(stacked, v).median())
    for _ in range(spec.clip_iters):
        diff = stacked - v
        dist = _distances(stacked, v)
        scale = torch.where(dist > tau, tau / dist.clamp_min(1e-30), torch.ones_like(dist))
        v = v + torch.tensordot(w * scale, diff, dims=1)
    return Aggregate(v, tau)


def _distances(stacked: Tensor, center: Tensor) -> Tensor:
    # float64 accumulation: squares of 10^7 values drift in float32
    return torch.linalg.vector_norm(stacked - center, dim=1, dtype=torch.float64).float()


def trimmed_mean(stacked: Tensor, w: Tensor, trim_fraction: float) -> Tensor:
    n = stacked.shape[0]
    k = int(trim_fraction * n)
    if k == 0:
        return weighted_mean(stacked, w)
    values, order = stacked.sort(dim=0)
    kept_values = values[k : n - k]
    kept_w = w[order[k : n - k]]
    return (kept_values * kept_w).sum(0) / kept_w.sum(0).clamp_min(1e-30)
