"""A round entry's digest is an unverified claim: one liar claiming a random digest sent
every honest anchor (and momentum) of its group through the anchor mix (bf16 in the
daemon) every round. A strict majority of the group's entries agreeing now skips it,
for every member alike."""

import asyncio

import pytest
import torch

from tests.outer.test_outer import config, diloco_reference, inner_steps, play_round, swarm

pytestmark = pytest.mark.timeout(60)


def lie_about_digest(loop) -> None:
    loop.state.digest = lambda *_: "f" * 32  # what its entry claims, whatever it holds


@pytest.mark.parametrize("mix_momentum", [False, True])
async def test_a_false_digest_no_longer_forces_the_anchor_mix(mix_momentum) -> None:
    tokens = [1000, 1000, 1000]
    loops = swarm(3, config(mix_momentum=mix_momentum))
    lie_about_digest(loops[2])
    reports = [await play_round(loops, r, tokens) for r in range(2)]
    assert not any(r.anchor_mixed for rs in reports for r in rs)
    assert all(r.consistent and len(r.delta_group) == 3 for rs in reports for r in rs)
    expected = diloco_reference(3, 2, tokens)  # exact: no anchor went through the wire
    for loop in loops[:2]:
        torch.testing.assert_close(loop.state.weights(), expected, rtol=0, atol=1e-6)


async def test_the_minority_member_skips_the_mix_too() -> None:
    """Two of three agree, the third's anchor differs: nobody mixes anchors (the third
    mixing alone would wait out the mix's deadlines), the delta mix runs for all."""
    loops = swarm(3, config())
    with torch.no_grad():
        loops[2].state.anchor += 0.001
        loops[2].state.load_weights(loops[2].state.anchor)
    reports = await play_round(loops, 0, [1000, 1000, 1000])
    assert not any(r.anchor_mixed for r in reports)
    assert all(r.consistent and len(r.delta_group) == 3 for r in reports)
    assert torch.equal(loops[0].state.anchor, loops[1].state.anchor)
    assert not torch.equal(loops[0].state.anchor, loops[2].state.anchor)


def test_two_members_whose_digests_differ_still_mix() -> None:
    loops = swarm(2, config())
    with torch.no_grad():
        loops[1].state.anchor += 0.001

    async def play():
        for loop in loops:
            await loop.begin_round(expect=2)
        for i, loop in enumerate(loops):
            inner_steps(loop.state.params, i)
        return await asyncio.gather(*(lp.end_round(tokens=1000) for lp in loops))

    reports = asyncio.run(play())
    assert all(r.anchor_mixed for r in reports)
    assert torch.equal(loops[0].state.anchor, loops[1].state.anchor)
