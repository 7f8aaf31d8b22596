"""Outer steps: the Nesterov step, exact DiLoCo with one group of everyone, newcomers."""

import asyncio

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from torch import nn

from agora_node.comms.collective import LocalNetwork, MatchmakingConfig, MemoryBoard, RoundEntry
from agora_node.comms.collective.entries import view_digest
from agora_node.comms.collective.payload import EF_NAME
from agora_node.node.outer import OuterLoop, part_signing
from agora_node.node.outer_state import OuterConfig, OuterState
from agora_node.node.round_report import RoundReport
from agora_node.protocol.identity import Identity
from agora_node.protocol.identity import verify as verify_signature
from agora_node.protocol.names import outer_round_key
from tests.outer.helpers import LOCAL

pytestmark = pytest.mark.timeout(60)
QUICK = MatchmakingConfig(window=0.5, settle=0.1, poll_interval=0.02)


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(48, 40), nn.Tanh(), nn.Linear(40, 24))


def config(**kw) -> OuterConfig:
    base = dict(group_size=0, codec="fp32", block=64, deadlines=LOCAL, matchmaking=QUICK)
    return OuterConfig(**{**base, **kw})


def swarm(n: int, cfg: OuterConfig) -> list[OuterLoop]:
    # members check parts' signatures where results are verified, as daemons do
    network = LocalNetwork(verify=verify_signature if cfg.verify_results else None)
    board = MemoryBoard()
    loops = []
    for i in range(n):
        # fixed keys: the random groups (a hash of peer ids) are the same on every run
        ident = Identity(Ed25519PrivateKey.from_private_bytes(bytes([i + 1]) * 32))
        loops.append(
            OuterLoop(
                model(), ident, run_id="run", stage=0, config=cfg,
                book=network.join(ident.peer_id, part_signing(ident, cfg)), transport=network.transport(ident.peer_id),
                board=board,
            )
        )  # fmt: skip
    return loops


def inner_steps(params, seed: int) -> None:
    """Stand-in for H inner steps: a deterministic move per replica and round."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(0.01 * torch.randn(p.shape, generator=g))


async def play_round(loops: list[OuterLoop], round_no: int, tokens: list[int]) -> list[RoundReport]:
    for loop in loops:
        await loop.begin_round(expect=len(loops))
    for i, loop in enumerate(loops):
        inner_steps(loop.state.params, 100 * round_no + i)
    return list(
        await asyncio.gather(*(lp.end_round(tokens=t) for lp, t in zip(loops, tokens, strict=True)))
    )


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def set_grad(module: nn.Module, flat_grad: torch.Tensor) -> None:
    """Give `module`'s parameters the gradient `flat_grad` (flat, in their order)."""
    offset = 0
    for p in module.parameters():
        p.grad = flat_grad[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def test_outer_state_step_is_torch_nesterov_sgd() -> None:
    ours, ref = model(), model()
    state = OuterState(ours, lr=0.7, momentum=0.9)
    opt = torch.optim.SGD(ref.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    for t in range(3):
        inner_steps(ours.parameters(), t)
        delta = state.pseudo_gradient()
        state.apply(delta)
        set_grad(ref, delta)
        opt.step()
        torch.testing.assert_close(flat(ours), flat(ref), rtol=0, atol=1e-6)
    assert state.round == 3


def test_consensus_folds_the_pull_toward_the_mean_into_the_momentum() -> None:
    """NoLoCo-style step: torch's Nesterov SGD from the own anchor, its gradient the mixed
    delta plus (anchor - mean) * g / lr; without momentum and g = 1 it is the default step
    (adopt the mean, then step)."""
    ours, ref, mean = model(0), model(0), flat(model(1))
    state = OuterState(ours, lr=0.7, momentum=0.9)
    opt = torch.optim.SGD(ref.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    for t in range(3):
        inner_steps(ours.parameters(), t)
        delta = state.pseudo_gradient()
        grad = delta + (state.anchor - mean) * (0.3 / 0.7)
        state.apply(delta, mean, consensus=0.3)
        set_grad(ref, grad)
        opt.step()
        torch.testing.assert_close(flat(ours), flat(ref), rtol=0, atol=1e-5)
    plain, pulled = (
        OuterState(model(0), lr=0.7, momentum=0),
        OuterState(model(0), lr=0.7, momentum=0),
    )
    delta = torch.randn(plain.numel)
    torch.testing.assert_close(plain.step(delta, mean), pulled.step(delta, mean, consensus=1.0))


def diloco_reference(n: int, rounds: int, tokens: list[int]) -> torch.Tensor:
    """DiLoCo computed directly: one anchor, the token-weighted mean of the replicas' deltas."""
    anchor = model()
    opt = torch.optim.SGD(anchor.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    w = torch.tensor(tokens, dtype=torch.float32) / sum(tokens)
    for r in range(rounds):
        deltas = []
        for i in range(n):
            replica = model()
            replica.load_state_dict(anchor.state_dict())
            inner_steps(replica.parameters(), 100 * r + i)
            deltas.append(flat(anchor) - flat(replica))
        mean = sum(wi * d for wi, d in zip(w, deltas, strict=True))
        set_grad(anchor, mean)
        opt.step()
    return flat(anchor)


async def run_swarm(n: int, rounds: int, cfg: OuterConfig, tokens: list[int]):
    loops = swarm(n, cfg)
    reports = [await play_round(loops, r, tokens) for r in range(rounds)]
    return loops, reports


@pytest.mark.parametrize("mix_momentum", [False, True])
async def test_one_group_of_everyone_without_compression_is_exactly_diloco(mix_momentum) -> None:
    tokens = [1000, 3000, 2000]
    loops, reports = await run_swarm(3, 2, config(mix_momentum=mix_momentum), tokens)
    expected = diloco_reference(3, 2, tokens)
    finals = [lp.state.weights() for lp in loops]
    assert all(torch.equal(finals[0], f) for f in finals)
    torch.testing.assert_close(finals[0], expected, rtol=0, atol=1e-6)
    for report in (r for rs in reports for r in rs):
        assert report.consistent and not report.anchor_mixed  # anchors agree: nothing sent
        assert len(report.delta_group) == 3 and report.bytes_sent > 0


@pytest.mark.parametrize("codec, bound", [("int8", 0.03), ("int4", 0.2)])
async def test_with_the_codec_the_update_stays_within_its_error(codec: str, bound: float) -> None:
    tokens = [1000, 1000, 1000]
    loops, _ = await run_swarm(3, 2, config(codec=codec), tokens)
    expected = diloco_reference(3, 2, tokens)
    start = flat(model())
    got = loops[0].state.weights()
    assert all(torch.equal(got, lp.state.weights()) for lp in loops)
    assert float((got - expected).norm() / (expected - start).norm()) < bound


async def test_sparse_parts_and_results_keep_replicas_identical_for_a_fraction_of_the_bytes():
    tokens = [1000, 1000, 1000]
    dense, dense_reports = await run_swarm(3, 3, config(block=256), tokens)
    sparse, sparse_reports = await run_swarm(3, 3, config(codec="topk4", block=256), tokens)
    got = sparse[0].state.weights()
    assert all(torch.equal(got, lp.state.weights()) for lp in sparse)  # one mixed result
    reports = [r for rs in sparse_reports for r in rs]
    assert all(r.consistent and not r.rejected and not r.direction_outliers for r in reports)
    sent = [sum(r.bytes_sent for rs in run for r in rs) for run in (dense_reports, sparse_reports)]
    assert sent[0] > 20 * sent[1], sent  # ~10 bytes per 256 values, plus frame headers
    start, expected = flat(model()), dense[0].state.weights()
    move, want = got - start, expected - start
    assert float(move @ want / (move.norm() * want.norm())) > 0.3  # the same way, roughly


async def test_unsent_kept_in_the_weights_is_error_feedback_whose_memory_is_the_weights():
    """With the same inner moves, a replica that keeps what its part left out in its weights
    sends the same parts as one with error feedback (each is the new move plus what is still
    unsent), so the anchors agree round by round; its weights are the anchor less that."""
    tokens = [1000, 1000, 1000]
    feedback = swarm(3, config(codec="topk4", block=256))
    kept = swarm(3, config(codec="topk4", block=256, unsent="weights"))
    for r in range(3):
        await play_round(feedback, r, tokens)
        reports = await play_round(kept, r, tokens)
        assert all(rep.consistent and not rep.rejected for rep in reports)
        for f, k in zip(feedback, kept, strict=True):
            torch.testing.assert_close(k.state.anchor, f.state.anchor, rtol=0, atol=1e-6)
            residual = f.delta_encoder.feedback.residual(EF_NAME)
            assert float(residual.norm()) > 0.5 * float((f.state.anchor - flat(model())).norm())
            torch.testing.assert_close(
                k.state.weights(), f.state.anchor - residual, rtol=0, atol=1e-6
            )
            assert k.delta_encoder.feedback.residual(EF_NAME) is None  # not sent twice
    assert not torch.equal(kept[0].state.weights(), kept[1].state.weights())  # each its own


async def test_a_replica_apart_is_pulled_back_though_a_liar_claims_the_others_digest() -> None:
    """Replica 1's anchor differs (an inconsistent or lone round); replica 2 claims replica
    0's digest. The digests differ, so the group of everyone mixes anchors and the two
    honest replicas agree again. (A rule that skipped the mix where a majority of the
    view claims one digest left them 2.71 apart every round: the liar's copied claim
    made the majority, and no state copy repaired replica 1.)"""
    loops = swarm(3, config())
    with torch.no_grad():
        loops[1].state.anchor += 0.05
        loops[1].state.load_weights(loops[1].state.anchor.clone())
    loops[2].state.digest = lambda *a: loops[0].state.digest(*a)
    reports = [await play_round(loops, r, [1000, 1000, 1000]) for r in range(2)]
    assert all(rep.anchor_mixed for rep in reports[0])
    assert float((loops[0].state.anchor - loops[1].state.anchor).norm()) < 1e-3


async def test_a_warming_newcomer_has_zero_weight_for_one_round() -> None:
    loops = swarm(3, config())
    newcomer = loops[2]
    newcomer.load_state_dict(loops[0].state_dict())  # a state transfer from replica 0
    assert newcomer.state.warming
    await play_round(loops, 0, [1000, 1000, 1000])
    expected = diloco_reference(2, 1, [1000, 1000])  # replicas 0 and 1 only
    torch.testing.assert_close(newcomer.state.weights(), expected, rtol=0, atol=1e-6)
    assert not newcomer.state.warming


async def test_a_group_of_one_applies_its_own_delta() -> None:
    loops, reports = await run_swarm(1, 2, config(), [500])
    torch.testing.assert_close(loops[0].state.weights(), diloco_reference(1, 2, [500]))
    assert reports[0][0].bytes_sent == 0


def spread(loops: list[OuterLoop]) -> float:
    """Mean distance between two replicas' weights."""
    ws = [lp.state.weights() for lp in loops]
    pairs = [float((a - b).norm()) for i, a in enumerate(ws) for b in ws[i + 1 :]]
    return sum(pairs) / len(pairs)


async def test_gossip_groups_keep_replicas_close() -> None:
    gossip, reports = await run_swarm(4, 3, config(group_size=2), [1000] * 4)
    alone, _ = await run_swarm(4, 3, config(group_size=1), [1000] * 4)
    assert all(r.consistent and len(r.delta_group) == 2 for rs in reports for r in rs)
    # after the first round the two groups disagree, so later rounds mix anchors
    assert any(r.anchor_mixed for rs in reports[1:] for r in rs)
    assert spread(gossip) < 0.35 * spread(alone)  # 0.26 with these keys (0.19 mixing momenta)


def test_state_dict_round_trip_and_shape_check() -> None:
    a, b = OuterState(model(0), lr=0.7, momentum=0.9), OuterState(model(1), lr=0.7, momentum=0.9)
    a.apply(torch.ones(a.numel) * 0.1)
    b.load_state_dict(a.state_dict(), warming=True)
    assert torch.equal(a.anchor, b.anchor) and torch.equal(a.momentum, b.momentum)
    assert b.round == 1 and b.warming
    small = OuterState(nn.Linear(2, 2), lr=0.7, momentum=0.9)
    with pytest.raises(ValueError):
        small.load_state_dict(a.state_dict())


def test_reset_to_weights_adopts_loaded_weights_as_the_anchor() -> None:
    (loop,) = swarm(1, config())
    loop.state.apply(torch.ones(loop.state.numel) * 0.01)
    inner_steps(loop.state.params, 5)  # e.g. a checkpoint without outer state was loaded
    loop.reset_to_weights()
    assert torch.equal(loop.state.pseudo_gradient(), torch.zeros(loop.state.numel))
    assert not loop.state.momentum.any()


@pytest.mark.parametrize("mix_momentum", [False, True])
def test_replicas_whose_momenta_drifted_apart_agree_again_only_when_momentum_is_mixed(
    mix_momentum,
):
    """A replica that mixed a round alone (start-up) carries another momentum; from then
    on its anchor differs after every round unless the anchor mix also mixes momenta
    (what the daemon's OuterConfig.from_manifest turns on)."""
    loops = swarm(2, config(mix_momentum=mix_momentum))
    loops[1].state.momentum += 0.01  # the drift one lonely round leaves
    asyncio.run(play_round(loops, 0, [500, 500]))
    agree = torch.equal(loops[0].state.anchor, loops[1].state.anchor)
    assert agree is mix_momentum


def _all_reduces() -> int:
    import gc

    return sum(type(o).__name__ == "AllReduce" for o in gc.get_objects())


async def test_a_rounds_collective_objects_are_freed_after_the_round() -> None:
    """An all-reduce and its round state point at each other, and hold the round's flat
    vectors; Python's collector reaches such cycles rarely, so they piled up (a replica
    in tests/outer/peer.py went from 455 to 915 MB resident over 40 rounds). The book
    breaks the cycle when it drops a round: what stays is the few rounds it keeps."""
    loops = swarm(3, config(verify_results=True))  # the witness makes the cycle
    counts = []
    for r in range(12):
        await play_round(loops, r, [500, 500, 500])
        counts.append(_all_reduces())
    assert max(counts[4:]) <= counts[3] + 3, counts


async def test_a_replica_marks_its_round_entry_done_once_its_mixes_are_over() -> None:
    """So a replica reaching the round later (a joiner) does not count or wait on it
    (groups.py, Matchmaker.finish)."""
    loops, _ = await run_swarm(2, 1, config(), [1000, 1000])
    board = loops[0].matchmaker.board
    key = outer_round_key("run", 0, 0)

    def entries() -> list[RoundEntry]:
        return [
            RoundEntry.verified(v, peer_id=p, run_id="run", stage=0, round_no=0)
            for p, v in board.data[key].items()
        ]

    deadline = asyncio.get_running_loop().time() + 10
    while not all(e.done for e in entries()) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)  # polling interval of a bounded wait
    both = entries()
    assert [e.done for e in both] == [True, True]
    assert all(e.view == view_digest(both) for e in both)  # the list they closed
