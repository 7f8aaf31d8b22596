"""Replayed delta parts (comms/collective/replay.py): flagged when a sender repeats an
earlier round's part, wherever the spans a reducer sees overlap; never for honest parts."""

import pytest
import torch

from agora_node.comms.collective.replay import ReplayMemory

pytestmark = pytest.mark.timeout(60)

NUMEL = 40_000


def _delta(seed: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))


def test_a_part_sent_again_in_a_later_round_is_flagged():
    memory = ReplayMemory(NUMEL, samples=4096, offset=3)
    first = _delta(0)
    assert not memory.check("liar", 0, 0, first[:10_000])
    assert memory.check("liar", 1, 0, first[:10_000])


def test_overlapping_spans_of_different_rounds_are_compared():
    """The reducer of round 1 holds another span than in round 0: the overlap decides."""
    memory = ReplayMemory(NUMEL, samples=4096, offset=0)
    first = _delta(0)
    assert not memory.check("liar", 0, 0, first[:20_000])
    assert memory.check("liar", 3, 10_000, first[10_000:30_000])
    # no overlap: nothing to compare, nothing flagged
    assert not memory.check("other", 0, 0, first[:10_000])
    assert not memory.check("other", 1, 20_000, first[20_000:30_000])


def test_codec_rounding_of_a_replay_is_still_a_replay():
    memory = ReplayMemory(NUMEL, samples=4096, offset=1)
    first = _delta(0)
    memory.check("liar", 0, 0, first)
    again = first.to(torch.bfloat16).float()  # what a bf16 wire makes of the same values
    assert memory.check("liar", 1, 0, again)


def test_honest_deltas_are_never_flagged_even_when_much_alike():
    """Consecutive honest deltas measured at cosine 0.86-0.95 (bench/byzantine.py, H=1);
    here 0.99, and a scaled copy (same direction, 5% longer): neither is a replay."""
    memory = ReplayMemory(NUMEL, samples=4096, offset=2)
    base = _delta(0)
    alike = base + 0.14 * _delta(1)  # cosine ~0.99
    assert float(torch.nn.functional.cosine_similarity(base, alike, dim=0)) > 0.98
    assert not memory.check("honest", 0, 0, base)
    assert not memory.check("honest", 1, 0, alike)
    assert not memory.check("honest", 2, 0, 1.05 * alike)
    for r in range(3, 10):
        assert not memory.check("honest", r, 0, _delta(r))


def test_the_same_round_and_zero_or_nonfinite_parts_are_not_replays():
    memory = ReplayMemory(NUMEL, samples=4096, offset=0)
    first = _delta(0)
    assert not memory.check("peer", 5, 0, first)
    assert not memory.check("peer", 5, 0, first)  # owner and witness of one round
    assert not memory.check("peer", 4, 0, first)  # an older round number: not "later"
    zeros = torch.zeros(NUMEL)
    assert not memory.check("warming", 0, 0, zeros) and not memory.check("warming", 1, 0, zeros)
    bad = first.clone()
    bad[0] = float("nan")
    assert not memory.check("junk", 0, 0, bad) and not memory.check("junk", 1, 0, bad)


def test_memory_is_bounded_in_peers_and_rounds():
    memory = ReplayMemory(NUMEL, samples=1024, rounds=3, max_peers=4, offset=0)
    first = _delta(0)
    memory.check("liar", 0, 0, first)
    for r in range(1, 4):
        memory.check("liar", r, 0, _delta(r))
    assert sorted(memory._seen["liar"]) == [1, 2, 3]
    assert not memory.check("liar", 4, 0, first)  # round 0 is forgotten: the stated limit
    for k in range(10):
        memory.check(f"stranger-{k}", 0, 0, _delta(100 + k))
    assert len(memory._seen) == 4
    samples_per_part = max(
        len(s.values) for h in memory._seen.values() for p in h.values() for s in p
    )
    assert samples_per_part <= NUMEL // memory.stride + 1


def test_a_part_repeating_an_earlier_round_s_mixed_delta_is_a_replay():
    """A free rider sends back the stage's last consensus instead of training."""
    memory = ReplayMemory(NUMEL, samples=4096, offset=5)
    mixed = _delta(7)
    memory.remember_mixed(3, mixed)
    assert not memory.check("honest", 4, 10_000, _delta(8)[10_000:20_000])
    assert memory.check("free-rider", 4, 10_000, mixed[10_000:20_000].to(torch.bfloat16).float())
    assert not memory.check("other", 3, 0, mixed[:10_000])  # the same round: not a replay
    for r in range(4, 20):
        memory.remember_mixed(r, _delta(100 + r))
    assert len(memory._mixed) == memory.rounds
