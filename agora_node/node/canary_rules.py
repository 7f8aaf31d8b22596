"""What the canaries decide, pure: how far two replicas' answers are, who departs from a
strict majority (`departing`), whose gradients are noise over several checks
(`best_cosines`, `NoiseWatch`), and the thresholds, each with what it was measured on.
The checks that gather the answers are node/canary.py's."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor


def distance(a: Tensor, b: Tensor) -> float:
    """||a - b|| relative to the larger of the two norms (inf if either is not finite)."""
    a, b = a.float().reshape(-1), b.float().reshape(-1)
    if a.shape != b.shape or not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return math.inf
    scale = max(float(a.norm()), float(b.norm()), 1e-12)
    return float((a - b).norm()) / scale


def grad_distance(a: Tensor, b: Tensor) -> float:
    """How far apart two replicas' gradients for one micro-batch are: 1 - their cosine, or
    0.82 x log10 of their norms' ratio (GRAD_TOLERANCE at a ratio of 30), whichever is
    larger (inf if either is not finite, or one is zero and the other not). Honest replicas
    of `demo` from one anchor on real data measured cosines of 0.96-0.99 after 5 inner
    steps, 0.62-0.65 after 20 and 0.2-0.6 after 10-60 (one pair at 10 steps: 0.196):
    0.01-0.8 here. A sign-flipped gradient is about 1.6-2."""
    a, b = a.float().reshape(-1), b.float().reshape(-1)
    if a.shape != b.shape or not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return math.inf
    na, nb = float(a.norm()), float(b.norm())
    if max(na, nb) <= 1e-30:
        return 0.0
    if min(na, nb) <= 1e-30:
        return math.inf
    cosine = float(a @ b) / (na * nb)
    return max(1.0 - cosine, 0.82 * math.log10(max(na, nb) / min(na, nb)))


LOSS_TOLERANCE = 0.6
"""Relative difference of two replicas' losses for one micro-batch beyond which they
disagree. Honest replicas from one anchor measured under 0.01 (above), but a replica that
just loaded the round's anchor (a joiner, a resync) beside others a round ahead, early in
a run, may be 0.4 apart (5.5 against 3.3); a made-up loss of 0.01 is about 1."""
GRAD_TOLERANCE = 1.2
"""`grad_distance` beyond which two replicas' gradients disagree: pointing against each
other (a cosine under -0.2), or one norm 30x the other (replicas a round apart early in a
run differ by a few times). A gradient of noise with a plausible norm (cosine near 0) is
not caught by one check (honest replicas come near 0.2 themselves): `NoiseWatch`."""
HEAD_TOLERANCE = 0.85
"""`grad_distance` beyond which a head's activations depart from other heads' for the same
tokens: a cosine under 0.15, or norms 11x apart. Honest heads of `demo` in the first
minutes of a run (each trains on its own batches between outer rounds, fast early on)
measured up to 0.57 by this measure (cosines down to 0.43) and relative distances
(`distance`) up to 0.84, too far for `canary_tolerance`'s 0.5; after the first outer
rounds, 0.04-0.06. Noise of a plausible norm is 1 from everyone (a cosine of 0)."""
HEAD_STRIKES = 2
"""Departures in a row that flag a head (one could be a head's own fast early steps, or
weights this node's threshold was not measured with)."""
NOISE_COSINE = 0.05
"""A replica whose gradients' best cosine with another replica's, averaged over its last
`NOISE_CHECKS` checks, stays under this answers noise: a random direction has a cosine of
about 1/sqrt(batch x seq x width) (0.008 for `demo`'s 8 x 128 x 16 coefficients), while
the lowest honest pair measured 0.196 (`grad_distance`)."""
NOISE_CHECKS = 4


def best_cosines(grads: dict[str, Tensor], need: int = 2) -> dict[str, float]:
    """Each answer's best cosine with another answer, for the answers whose others hold
    `need` that agree among themselves (each with a cosine above 2 x NOISE_COSINE with
    `need` - 1 of the others): a strict majority of the stage's trusted replicas, as
    `departing` asks. Without it (two noisy liars of three; two colluders answering one
    made-up vector while the honest replicas asked were busy) there is nothing to judge
    against."""
    flat = {p: g.float().reshape(-1) for p, g in grads.items()}
    unit = {}
    for p, g in flat.items():
        norm = float(g.norm())
        if math.isfinite(norm) and norm > 1e-30:
            unit[p] = g / norm
    peers = sorted(unit)
    cos = {(p, q): float(unit[p] @ unit[q]) for p in peers for q in peers if p < q}

    def c(p: str, q: str) -> float:
        return cos[(p, q) if p < q else (q, p)]

    out = {}
    for p in peers:
        others = [q for q in peers if q != p]
        agreeing = [
            q
            for q in others
            if sum(c(q, r) > 2 * NOISE_COSINE for r in others if r != q) >= need - 1
        ]
        if others and len(agreeing) >= need:
            out[p] = max(c(p, q) for q in others)
    return out


@dataclass
class NoiseWatch:
    """Each replica's best cosines in its last NOISE_CHECKS checks (`best_cosines`); who
    stays under NOISE_COSINE on average sends noise. Bounded: MAX_WATCHED replicas."""

    seen: dict[str, list[float]] = field(default_factory=dict)

    def noisy(self, cosines: dict[str, float]) -> list[str]:
        found = []
        for peer, cosine in cosines.items():
            last = [*self.seen.pop(peer, []), cosine][-NOISE_CHECKS:]
            self.seen[peer] = last  # (re-inserted: the dict keeps the most recent last)
            if len(last) == NOISE_CHECKS and sum(last) / NOISE_CHECKS < NOISE_COSINE:
                found.append(peer)
                del self.seen[peer]
        while len(self.seen) > MAX_WATCHED:
            del self.seen[next(iter(self.seen))]
        return found


MAX_WATCHED = 256


def departing(
    outputs: dict[str, Tensor],
    tolerance: float,
    of: int | None = None,
    far: Callable[[Tensor, Tensor], float] | None = None,
) -> list[str]:
    """The answers' authors to flag: those farther than `tolerance` from every member of
    some strict majority that agree among themselves: a strict majority of `of` (the
    stage's replicas that were asked from) if given, else of the answers.

    Needs 3 answers or more (with two, neither outvotes the other). If no strict
    majority agrees (all far apart), nobody is flagged: there is nothing to depart from.
    `far`: how distance is measured (default `distance`)."""
    far = far or distance
    peers = sorted(outputs)
    n = len(peers)
    if n < 3:
        return []
    close = {
        p: {q for q in peers if q != p and far(outputs[p], outputs[q]) <= tolerance} for p in peers
    }
    need = max(n, of or 0) // 2 + 1  # a strict majority, counting the peer itself
    majority = {p for p in peers if len(close[p]) + 1 >= need}
    if not majority:
        return []
    return [p for p in peers if p not in majority and not close[p] & majority]
