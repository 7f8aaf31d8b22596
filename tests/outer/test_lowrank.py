"""Low-rank pseudo-gradients (node/lowrank.py): the factorization, and outer rounds that
mix factors instead of whole pseudo-gradients."""

import asyncio

import pytest
import torch

from agora_node.node.lowrank import LowRank
from agora_node.node.outer import OuterLoop
from tests.outer.test_outer import config, flat, model, set_grad, swarm

pytestmark = pytest.mark.timeout(60)
SHAPES = [(40, 48), (40,), (24, 40), (24,), (3, 2)]
SEED = b"run/0/0/factors"


def group_mix(ms: list[torch.Tensor], rank: int = 2) -> tuple[torch.Tensor, list[LowRank]]:
    """One low-rank round of equally weighted members, the two mixes as plain means."""
    members = [LowRank(SHAPES, rank) for _ in ms]
    firsts = [lr.first(m, SEED) for lr, m in zip(members, ms, strict=True)]
    seconds = [lr.second(torch.stack(firsts).mean(0)) for lr in members]
    outs = [lr.finish(torch.stack(seconds).mean(0)) for lr in members]
    assert all(torch.equal(outs[0], o) for o in outs)  # the same mixed factors, the same bits
    return outs[0], members


def low_rank_delta(column_seed: int, member_seed: int, rank: int = 2) -> torch.Tensor:
    """A flat delta whose matrices share their column space (`column_seed`) across members."""
    cols, own = (
        torch.Generator().manual_seed(column_seed),
        torch.Generator().manual_seed(member_seed),
    )
    parts = []
    for shape in SHAPES:
        if len(shape) == 2 and shape[0] > 3:
            u = torch.randn(shape[0], rank, generator=cols)
            parts.append((u @ torch.randn(rank, shape[1], generator=own)).reshape(-1))
        else:
            parts.append(torch.randn(shape, generator=own).reshape(-1))
    return torch.cat(parts)


def test_layout_factors_the_matrices_worth_it_and_sends_the_rest_whole() -> None:
    lr = LowRank(SHAPES, 2)
    assert [(m.rows, m.cols) for m in lr.matrices] == [(40, 48), (24, 40)]
    assert lr.whole == [(1920, 1960), (2920, 2944), (2944, 2950)]  # the (3, 2) matrix too
    assert lr.first_numel == 2 * (40 + 24)
    assert lr.second_numel == 2 * (48 + 40) + 40 + 24 + 6
    assert lr.numel == 2950 and lr.ratio == pytest.approx(2950 / (128 + 176 + 70))
    with pytest.raises(ValueError, match="rank"):
        LowRank(SHAPES, 0)


def test_deltas_sharing_a_column_space_mix_exactly() -> None:
    ms = [low_rank_delta(7, i) for i in range(3)]
    mixed, members = group_mix(ms)
    torch.testing.assert_close(mixed, torch.stack(ms).mean(0), rtol=0, atol=1e-5)
    for lr, m in zip(members, ms, strict=True):  # nothing left out
        assert float(lr.residual.norm() / m.norm()) < 1e-5  # float32 rounding


def test_members_starting_from_different_q_still_agree_on_a_projection_of_the_mean() -> None:
    """The next round starts from the group's mixed Q (warm start); a member whose Q is
    another (it missed a round, or mixed in another group) changes the subspace, not
    the agreement: all rebuild the same update, the mean projected onto one subspace."""
    ms = [torch.randn(2950, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    _, members = group_mix(ms)
    assert all(lr.warm is not None for lr in members)
    members[2].reset()  # this one draws Q from the seed again
    sent = [
        m + (0 if lr.residual is None else lr.residual) for lr, m in zip(members, ms, strict=True)
    ]
    firsts = [lr.first(m, SEED) for lr, m in zip(members, ms, strict=True)]
    seconds = [lr.second(torch.stack(firsts).mean(0)) for lr in members]
    outs = [lr.finish(torch.stack(seconds).mean(0)) for lr in members]
    assert all(torch.equal(outs[0], o) for o in outs)
    n = members[0].matrices[0].rows * members[0].matrices[0].cols
    update = outs[0][:n].view(40, 48).double()
    left = torch.stack(sent).mean(0)[:n].view(40, 48).double() - update
    assert torch.linalg.matrix_rank(update, atol=1e-6) == 2
    assert float((update.T @ left).abs().max()) < 1e-3 * float(update.norm() * left.norm())


def test_what_the_factors_leave_out_is_sent_in_later_rounds() -> None:
    """Error feedback: a lone member's update plus its residual is always what it had to
    send, and sending the same full-rank delta round after round, the residual stops
    growing (about 10x the delta for rank 2 of 40 x 48), so the mean update converges to
    the delta (like 1 / rounds)."""
    m = torch.randn(LowRank(SHAPES, 2).numel, generator=torch.Generator().manual_seed(3))
    lr, sent = LowRank(SHAPES, 2), torch.zeros_like(m)
    residuals, errors = [], []
    for t in range(60):
        before = torch.zeros_like(m) if lr.residual is None else lr.residual.clone()
        seed = f"run/0/{t}/factors".encode()
        out = lr.finish(lr.second(lr.first(m, seed)))
        torch.testing.assert_close(out + lr.residual, m + before, rtol=0, atol=1e-4)
        sent += out
        residuals.append(float(lr.residual.norm() / m.norm()))
        errors.append(float((sent / (t + 1) - m).norm() / m.norm()))
    assert max(residuals[-30:]) < 12, residuals
    assert errors[-1] < 0.2 and errors[-1] < errors[29] < errors[9], errors


def test_a_failed_round_keeps_the_residual_and_reset_forgets_it() -> None:
    lr = LowRank(SHAPES, 2)
    m = torch.randn(lr.numel)
    lr.finish(lr.second(lr.first(m, SEED)))
    kept = lr.residual.clone()
    lr.first(m, SEED)
    lr.abandon()
    assert torch.equal(lr.residual, kept)
    with pytest.raises(RuntimeError):
        lr.second(torch.zeros(lr.first_numel))
    lr.reset()
    assert lr.residual is None
    with pytest.raises(ValueError, match="values"):
        lr.first(torch.zeros(5), SEED)


def low_rank_inner_steps(params, round_no: int, member: int) -> None:
    """Stand-in for H inner steps whose move has a rank-2 column space shared by the stage,
    and a direction the members roughly agree on (as pseudo-gradients do; reducers refuse
    parts pointing away from the others)."""
    shared = torch.Generator().manual_seed(1000 + round_no)
    own = torch.Generator().manual_seed(100 * round_no + member)
    with torch.no_grad():
        for p in params:
            width = p.shape[1] if p.dim() == 2 else p.numel()
            v = torch.randn(2, width, generator=shared)
            v += 0.5 * torch.randn(v.shape, generator=own)
            if p.dim() == 2:
                u = torch.randn(p.shape[0], 2, generator=shared)
                p.add_(0.01 * u @ v)
            else:
                p.add_(0.01 * v[0])


def diloco_low_rank_reference(n: int, rounds: int) -> torch.Tensor:
    anchor = model()
    opt = torch.optim.SGD(anchor.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    for r in range(rounds):
        deltas = []
        for i in range(n):
            replica = model()
            replica.load_state_dict(anchor.state_dict())
            low_rank_inner_steps(replica.parameters(), r, i)
            deltas.append(flat(anchor) - flat(replica))
        set_grad(anchor, sum(deltas) / n)
        opt.step()
    return flat(anchor)


async def play(loops: list[OuterLoop], rounds: int):
    reports = []
    for r in range(rounds):
        for loop in loops:
            await loop.begin_round(expect=len(loops))
        for i, loop in enumerate(loops):
            low_rank_inner_steps(loop.state.params, r, i)
        ends = (lp.end_round(tokens=1000) for lp in loops)
        reports.append(list(await asyncio.gather(*ends)))
    return reports


async def test_outer_rounds_with_factors_are_diloco_when_deltas_are_low_rank() -> None:
    """Three replicas, rank 2, deltas whose matrices share a rank-2 column space: the two
    factor mixes rebuild the mean delta, so the rounds are DiLoCo's, for fewer bytes."""
    loops = swarm(3, config(rank=2))
    reports = await play(loops, 3)
    finals = [lp.state.weights() for lp in loops]
    assert all(torch.equal(finals[0], f) for f in finals)
    # equal up to float error, which the warm start amplifies here: these deltas' row spaces
    # are unrelated from round to round (a round's move is about 1e-2 of a weight)
    torch.testing.assert_close(finals[0], diloco_low_rank_reference(3, 3), rtol=0, atol=5e-4)
    flat_reports = [r for rs in reports for r in rs]
    assert all(r.consistent and not r.rejected and not r.anchor_mixed for r in flat_reports)
    dense = swarm(3, config())
    dense_reports = await play(dense, 3)
    sent = [sum(r.bytes_sent for rs in run for r in rs) for run in (dense_reports, reports)]
    assert sent[0] > 3 * sent[1], sent  # 2944 values against 368, plus frame headers


async def test_gossip_with_factors_keeps_groups_consistent() -> None:
    """Four replicas in groups of two, factors in bf16, every span's result checked by a
    witness (as in the daemon) in both mixes."""
    loops = swarm(4, config(rank=2, group_size=2, codec="bf16", verify_results=True))
    reports = await play(loops, 3)
    flat_reports = [r for rs in reports for r in rs]
    assert all(r.consistent and len(r.delta_group) == 2 for r in flat_reports)
    assert all(not r.mismatched and r.checked_spans > 0 for r in flat_reports)
    assert any(r.anchor_mixed for rs in reports[1:] for r in rs)
    assert all(bool(torch.isfinite(lp.state.weights()).all()) for lp in loops)


def test_a_sparse_codec_with_factors_is_refused() -> None:
    with pytest.raises(ValueError, match="rank"):
        config(rank=2, codec="topk4")
