"""A stranger with a record at the stage before cannot walk `NormWatch`'s level (the bound
on the norms of the activations and gradients peers send) down or up, nor hold it still
against the honest senders' drift, so it cannot get honest senders refused (and flagged
`pipeline_outlier`); the watch still follows what most senders agree on."""

import random

import pytest

from agora_node.node.suspects import NormWatch

pytestmark = pytest.mark.timeout(60)

HONEST = "abc"


def _noisy(rng: random.Random, level: float) -> float:
    return level * rng.uniform(0.9, 1.1)


def _watch_fed_by(senders: str, rng: random.Random, rounds: int = 8) -> NormWatch:
    """A watch that took norms near 1 from each of `senders`, in turn."""
    w = NormWatch(factor=100, window=64, min_samples=16)
    for _ in range(rounds):
        for p in senders:
            assert not w.outlier(_noisy(rng, 1.0), p)
    return w


def _walk(w: NormWatch, x: float, step: float) -> float:
    """The attacker's move: `x` x `step` if the watch takes it, else `x` again (greedy,
    always at the edge of what is taken); the attacker's norm afterwards."""
    if not w.outlier(x * step, "x"):
        return x * step
    w.outlier(x, "x")
    return x


@pytest.mark.parametrize("step", [0.5, 2.0], ids=["down", "up"])
def test_a_fast_walker_gets_no_honest_sender_refused_and_its_far_norms_are(step: float):
    rng = random.Random(1)
    w = _watch_fed_by(HONEST + "x", rng)
    x, refused = 1.0, []
    for i in range(500):  # the attacker sends 5 norms for each honest micro-batch
        for _ in range(5):
            x = _walk(w, x, step)
        sender = HONEST[i % 3]
        if w.outlier(_noisy(rng, 1.0), sender):
            refused.append(sender)
    assert refused == []
    assert 1 / 100 / 1.1 <= x <= 100 * 1.1  # within the bound of the honest norms
    assert w.outlier(step**20, "x")  # a millionth, or a million times, the honest ones


@pytest.mark.parametrize("step", [0.5, 2.0], ids=["down", "up"])
def test_a_stranger_facing_a_single_honest_sender_gets_it_refused_never(step: float):
    rng = random.Random(2)
    w = NormWatch(factor=100, window=64, min_samples=16)
    for _ in range(16):
        assert not w.outlier(_noisy(rng, 1.0), "a")
    x = 1.0
    for _ in range(400):
        for _ in range(5):
            x = _walk(w, x, step)
        assert not w.outlier(_noisy(rng, 1.0), "a")
    assert w.outlier(step**20, "x")


def test_honest_drift_is_followed_while_a_fast_sender_holds_its_norms_still():
    # norms move 10^4 up and then 10^8 down over thousands of micro-batches; the attacker
    # repeats the starting level, 5 times for each honest micro-batch
    rng = random.Random(3)
    w = _watch_fed_by(HONEST + "x", rng)
    levels = [10 ** (4 * i / 3000) for i in range(3000)]
    levels += [10 ** (4 - 8 * i / 6000) for i in range(6000)]
    refused = []
    for i, level in enumerate(levels):
        for _ in range(5):
            w.outlier(1.0, "x")
        sender = HONEST[i % 3]
        if w.outlier(_noisy(rng, level), sender):
            refused.append((i, sender))
    assert refused == []
    assert 1e-5 < w.level() < 1e-3
    assert w.outlier(1.0, "x")  # 10^4 above where the honest senders are now


def test_a_sender_whose_norms_are_taken_cannot_hold_off_a_rebase():
    # the level moved 500x for the honest senders while this node was idle; the attacker
    # keeps sending the old level in between their norms
    rng = random.Random(4)
    w = _watch_fed_by(HONEST + "x", rng)
    assert not w.outlier(1.0, "x")
    assert w.outlier(500.0, "a")
    assert not w.outlier(1.0, "x")
    assert w.outlier(510.0, "b")  # 2 of 4 active senders is no majority
    assert not w.outlier(1.0, "x")
    assert not w.outlier(490.0, "c")  # 3 of 4 are
    assert sorted(w.rebased) == list(HONEST)
    assert all(not w.outlier(_noisy(rng, 500.0), p) for p in HONEST * 5)
    assert w.outlier(1.0, "x")


def test_a_norm_far_below_the_level_is_an_outlier_too():
    w = _watch_fed_by(HONEST, random.Random(5))
    assert not w.outlier(0.02, "a") and not w.outlier(50.0, "b")
    assert w.outlier(1e-3, "a") and not w.outlier(1.0, "a")
    assert w.outlier(0.0, "b")
    assert w.outlier(1e-3)  # without a sender


def test_honest_norms_that_all_jump_more_than_the_counting_band_move_the_level():
    """After an idle spell training had moved every sender's norms 20x: taken, but too far
    to count, they froze the level until the faster sender's passed the bound and it was
    refused (and flagged) nine times."""
    now = [0.0]
    watch = NormWatch(clock=lambda: now[0])
    level = 1.0
    for _ in range(64):
        for sender, k in (("A", 1.0), ("B", 1.5)):
            now[0] += 0.1
            assert not watch.outlier(level * k, sender)
    now[0] += 100.0
    level *= 20
    refused = 0
    for _ in range(80):
        for sender, k in (("A", 1.0), ("B", 1.5)):
            now[0] += 0.1
            refused += watch.outlier(level * k, sender)
        level *= 1.05
    assert refused == 0 and watch.level() > 100


def test_a_stranger_cannot_rebase_on_its_own_norm_beside_a_far_honest_one():
    """Held 10x above the honest norms, the level left about half of them just outside the
    counting band ("far"); one huge refused norm of the stranger's then made two of two
    active senders off, and the watch re-based on 1e12 beside the honest norm."""
    rng, now = random.Random(7), [0.0]
    w = NormWatch(factor=100, window=64, min_samples=16, clock=lambda: now[0])

    def honest() -> bool:
        now[0] += 0.1
        return w.outlier(_noisy(rng, 1.0), "a")

    for _ in range(16):
        assert not honest()
    for _ in range(4):
        now[0] += 0.1
        assert not w.outlier(1.0, "x")
    for i in range(200):  # the stranger walks its own median to the top of the band
        now[0] += 0.1
        w.outlier(w.level() * 10, "x")
        if i % 5 == 0:
            assert not honest()
    for _ in range(200):
        now[0] += 0.1
        assert w.outlier(1e12, "x")  # refused, every time
        assert not honest()
        assert not w.rebased and w.level() < 100
