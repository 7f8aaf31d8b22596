"""A liar in a group with at most one counting honest member (a stage of two, groups of
two, or the other honest members warming): it must not set the mixed delta or anchor.

Before: CenteredClip started from torch's lower median (of two rows, the minimum, so a
liar's -1e37 was the start and the result), and the outer step wrote whatever came out
into the weights. Now the adopting replica bounds what the mixes move it by, in its own
steps (node/outer_bounds.py)."""

import asyncio
import importlib
import logging
import math

import pytest
import torch

from agora_node.comms.collective import Aggregation, AggregationSpec, aggregate
from tests.outer.test_outer import config, inner_steps, swarm

pytestmark = pytest.mark.timeout(60)
# the module (the package exports its function `aggregate` under the same name)
aggregation = importlib.import_module("agora_node.comms.collective.aggregate")

CLIP = AggregationSpec(method=Aggregation.CENTERED_CLIP)


def honest(n: int, numel: int = 4096, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(numel, generator=g)
    return [base + 0.3 * torch.randn(numel, generator=g) for _ in range(n)]


def test_centered_clip_of_two_starts_between_them_not_at_the_lower() -> None:
    (h,) = honest(1)
    liar = torch.full_like(h, -1e36)
    out = aggregate([h, liar], [1.0, 1.0], CLIP)
    assert not torch.equal(out.value, liar)  # was exactly the liar's part (tau was 0)
    assert out.clip_radius is not None and out.clip_radius > 0
    assert bool((out.value > liar).all())
    torch.testing.assert_close(
        aggregation.coordinate_median(torch.stack([h, liar])), (h + liar) / 2
    )
    four = torch.stack([h, h + 1, h + 3, liar])
    torch.testing.assert_close(aggregation.coordinate_median(four), h + 0.5)  # the middle two


@pytest.mark.parametrize("counting", [1, 2])
def test_small_warming_parts_never_get_the_counting_ones_refused(counting: int) -> None:
    """Newcomers' deltas are small (they joined mid-round, their fresh optimizer is in its
    lr warmup). As references for the norm screen they set its median: every counting part
    was refused, the round's result was zeros, and the counting members were flagged."""
    xs = honest(counting)
    tiny = [0.01 * x for x in honest(2, seed=1)]
    weights = [1000.0] * counting + [0.0, 0.0]
    out = aggregate([*xs, *tiny], weights, CLIP)
    assert not out.refused and not out.misdirected
    torch.testing.assert_close(out.value, sum(xs) / counting)


def _liar_round(loops, liar_setup, tokens=(1000, 1000)):
    """One round of two replicas: the honest one (0) takes inner steps, `liar_setup`
    doctors the liar (1) before the round. Returns the anchor the honest replica's own
    delta alone would make from its own anchor."""

    async def play():
        liar_setup(loops[1])
        for loop in loops:
            await loop.begin_round(expect=2)
        inner_steps(loops[0].state.params, 7)
        own = loops[0].state.preview(loops[0].state.pseudo_gradient())
        await asyncio.gather(*(lp.end_round(tokens=t) for lp, t in zip(loops, tokens, strict=True)))
        return own

    return asyncio.run(play())


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "agora_node.node.outer" and r.levelno == logging.WARNING
    ]


def huge_delta(liar):  # delta = anchor - weights = -1e37 everywhere
    with torch.no_grad():
        for p in liar.state.params:
            p.fill_(1e37)


@pytest.mark.parametrize("method", [Aggregation.CENTERED_CLIP, Aggregation.MEAN])
def test_a_liars_huge_delta_in_a_group_of_two_is_refused(method, caplog) -> None:
    loops = swarm(2, config(aggregation=AggregationSpec(method=method)))

    with caplog.at_level(logging.WARNING, logger="agora_node.node.outer"):
        own = _liar_round(loops, huge_delta)
    got = loops[0].state.weights()
    assert bool(torch.isfinite(got).all())
    assert torch.equal(got, own) and torch.equal(loops[0].state.anchor, own)
    assert loops[0].state.round == 1
    (warning,) = _warnings(caplog)  # one, from the honest replica
    assert "mixed pseudo-gradient" in warning and "own" in warning


def test_unsent_kept_in_the_weights_is_dropped_where_the_own_delta_was_applied_whole() -> None:
    """With `unsent = "weights"` the weights are the new anchor less what the own part left
    out; when the mix is refused the own delta is applied whole, and keeping that residual
    too would apply it twice."""
    loops = swarm(2, config(codec="topk4", block=256, unsent="weights"))
    own = _liar_round(loops, huge_delta)
    honest_ = loops[0]
    assert torch.equal(honest_.state.anchor, own) and torch.equal(honest_.state.weights(), own)
    assert honest_.carried is None


def test_with_unsent_in_the_weights_the_bounds_measure_the_own_move_not_what_it_carries():
    from agora_node.node import outer_bounds

    (loop,) = swarm(1, config())
    g = torch.Generator().manual_seed(5)
    move = 1e-3 * torch.randn(loop.state.numel, generator=g)
    carried = 1e-1 * torch.randn(loop.state.numel, generator=g)  # 100x the move
    delta = carried + move
    mixed = 5 * delta  # within 10x the delta, far beyond 10x the move
    taken, *_ = outer_bounds.bound_mixes(loop.state, delta, mixed, None, None, 1.0)
    assert taken is mixed
    taken, *_, notes = outer_bounds.bound_mixes(loop.state, delta, mixed, None, None, 1.0, carried)
    assert taken is delta and "refused the mixed pseudo-gradient" in notes[0]


def test_a_liars_huge_anchor_in_a_group_of_two_is_cut_to_a_few_steps(caplog) -> None:
    """The anchor mix (no absolute norm bound, two members: no screen) averaged the liar's
    -1e37 anchor in; the step started from it."""
    loops = swarm(2, config())

    def huge_anchor(liar):  # delta 0 (float32 at 1e37 swallows the steps), anchor -1e37
        liar.state.anchor = torch.full_like(liar.state.anchor, -1e37)
        liar.state.load_weights(liar.state.anchor)

    with caplog.at_level(logging.WARNING, logger="agora_node.node.outer"):
        _liar_round(loops, huge_anchor)
    honest_ = loops[0]
    got = honest_.state.weights()
    assert bool(torch.isfinite(got).all())
    assert honest_.last_report is not None and honest_.last_report.anchor_mixed
    assert float(got.abs().max()) < 10
    assert sum("mixed anchor" in w for w in _warnings(caplog)) >= 1


def test_a_mixed_anchor_pulls_at_most_a_few_own_steps() -> None:
    """A finite anchor near minus the honest one (the mean of the two is about 0): with a
    bound of the anchor's own norm it was adopted, the weights wiped in one round. Now the
    pull is cut to ANCHOR_PULL_STEPS of this replica's own outer steps, in its direction;
    the step from there is the one it would have taken."""
    import copy

    from agora_node.node import outer_bounds

    (loop,) = swarm(1, config())
    state = loop.state
    delta = 1e-4 * torch.randn(state.numel, generator=torch.Generator().manual_seed(4))
    liar_mean = -0.999 * state.anchor
    state.momentum += 1e-4  # a run under way: its own step includes its momentum's
    own_step = float(delta.double().norm()) + state.mu * float(state.momentum.double().norm())
    reach = outer_bounds.ANCHOR_PULL_STEPS * state.lr * own_step
    alone = copy.deepcopy(state)
    stepped = alone.step(delta)
    new, applied = loop._outer_step(0, delta, delta, liar_mean, None, tokens=10**9)
    assert applied is delta
    assert float((new - stepped).double().norm()) == pytest.approx(reach, rel=1e-4)
    assert reach < 0.1 * float(alone.anchor.norm())
    # what the bounds cut goes into the round's report (it reached only the log before)
    assert loop.bounded and "anchor" in loop.bounded[0]


def test_within_cuts_the_pull_to_the_radius_in_its_direction(monkeypatch) -> None:
    from agora_node.node import outer_state

    monkeypatch.setattr(outer_state, "NORM_CHUNK", 100)  # several chunks
    own = torch.randn(1000)
    other = own + torch.full((1000,), 0.5)
    same, far = outer_state.within(other, own, 100.0)
    assert same is other and far == pytest.approx(0.5 * 1000**0.5)
    cut, _ = outer_state.within(other, own, 1.0)
    torch.testing.assert_close(cut - own, (other - own) / (0.5 * 1000**0.5))
    assert outer_state.within(torch.full((1000,), math.nan), own, 1.0)[0] is None
    assert outer_state.flat_norm(other) == pytest.approx(float(other.double().norm()), rel=1e-9)


def test_a_replica_that_did_few_steps_still_adopts_an_honest_mix() -> None:
    """The bound scales with the tokens a full round processes (`max_weight`): a replica
    whose delta is a twentieth of the other's (a twentieth of the steps) is not outvoted
    by its own check."""
    cap = 1000.0
    loops = swarm(2, config(aggregation=AggregationSpec(max_weight=cap)))

    async def play():
        for loop in loops:
            await loop.begin_round(expect=2)
        for i, loop in enumerate(loops):
            g = torch.Generator().manual_seed(i)
            with torch.no_grad():
                for p in loop.state.params:
                    p.add_((0.01 if i else 0.0005) * torch.randn(p.shape, generator=g))
        await asyncio.gather(loops[0].end_round(tokens=50), loops[1].end_round(tokens=1000))

    asyncio.run(play())
    report = loops[0].last_report
    assert report is not None and report.mixed_norm > 10 * report.delta_norm
    assert torch.equal(loops[0].state.anchor, loops[1].state.anchor)


def test_honest_pairs_never_refuse_each_other(caplog) -> None:
    loops = swarm(2, config(aggregation=CLIP, mix_momentum=True))
    loops[1].state.momentum += 0.01  # drifted: the anchor mix runs too

    async def play():
        for r in range(3):
            for loop in loops:
                await loop.begin_round(expect=2)
            for i, loop in enumerate(loops):
                inner_steps(loop.state.params, 100 * r + i)
            await asyncio.gather(*(lp.end_round(tokens=1000) for lp in loops))

    with caplog.at_level(logging.WARNING, logger="agora_node.node.outer"):
        asyncio.run(play())
    assert not _warnings(caplog)
    assert torch.equal(loops[0].state.anchor, loops[1].state.anchor)
    assert math.isfinite(float(loops[0].state.anchor.norm()))


def test_a_replica_without_an_own_delta_takes_nothing_from_its_group() -> None:
    """With no own steps it has no measure: a liar's 0.99x anchor as the mixed delta was
    taken (the bound fell back to the anchor's norm) and the anchor dropped to a third."""
    (loop,) = swarm(1, config())
    state = loop.state
    before = state.anchor.clone()
    zero = torch.zeros(state.numel)
    new, applied = loop._outer_step(0, zero, 0.99 * before, -before, None, tokens=10**9)
    assert applied is zero and torch.equal(new, before)


def test_a_replica_whose_own_delta_is_not_finite_steps_without_it() -> None:
    """Its own NaN delta was applied and its anchor and momentum stayed NaN for good."""
    (loop,) = swarm(1, config())
    state = loop.state
    nan = torch.full((state.numel,), math.nan)
    new, applied = loop._outer_step(0, nan, nan, None, None, tokens=10**9)
    assert bool(torch.isfinite(new).all()) and bool(torch.isfinite(state.momentum).all())
    assert not bool(applied.any())


@pytest.mark.parametrize("rounds_in", [0, 4])
def test_a_joiner_one_round_behind_is_pulled_a_runs_step(rounds_in: int) -> None:
    """A joiner whose momentum was not attested starts from zero momentum: measured by its
    own delta alone, the pull toward a group a round ahead (a run's step) was cut to a
    fifth, and for the rounds its momentum takes to build up (measured only while warming,
    the first round, it came back in the second). Until then it is measured as a running
    replica, which that pull is within."""
    import copy

    (loop,) = swarm(1, config())
    state = loop.state
    state.load_state_dict({**state.state_dict(), "momentum": torch.zeros(state.numel)})
    for _ in range(rounds_in):  # rounds ended since, each adding a little momentum
        state.step(1e-6 * torch.ones(state.numel))
    assert state.rebuilding > 0
    delta = 1e-4 * torch.randn(state.numel, generator=torch.Generator().manual_seed(5))
    run_step = state.lr * float(delta.double().norm()) / (1 - state.mu)
    ahead = state.anchor + run_step * delta / float(delta.norm())
    before, alone = state.anchor.clone(), copy.deepcopy(state)
    stepped = alone.step(delta)
    new, _ = loop._outer_step(0, delta, delta, ahead, None, tokens=10**9)
    torch.testing.assert_close(new - stepped, ahead - before, rtol=0, atol=1e-6)
