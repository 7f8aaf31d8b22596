"""Lifeguard's two refinements of SWIM (Dadgar et al., 2018), as small pure objects.

- `Awareness`, the local-health multiplier: a member that misses its own
  deadlines (probes with neither an ack nor the expected nacks, suspicions about
  itself, timers that fire late) is probably the slow one, so it stretches its
  own probe interval and timeouts instead of accusing healthy peers.
- `Suspicion`, a suspicion timeout that starts long and shrinks as independent
  members confirm it: a real failure is confirmed by many probers quickly, a
  false one (one lossy path) is not, which leaves the suspect time to refute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class Awareness:
    """Local health score in [0, max_multiplier - 1]; timeouts scale by score + 1."""

    __slots__ = ("score", "_max")

    def __init__(self, max_multiplier: int) -> None:
        self.score = 0
        self._max = max_multiplier - 1

    def apply(self, delta: int) -> None:
        self.score = min(self._max, max(0, self.score + delta))

    def scale(self, seconds: float) -> float:
        return seconds * (self.score + 1)


@dataclass(slots=True)
class Suspicion:
    """One suspicion of one member at one incarnation.

    timeout(C) = max(low, high - (high - low) * log(C + 1) / log(K + 1)) where C
    counts accusers besides the first, K is how many are expected.
    """

    subject: str
    incarnation: int
    start: float
    low: float
    high: float
    expected: int
    accusers: set[str] = field(default_factory=set)
    regossiped: bool = False

    def confirm(self, accuser: str) -> bool:
        """Count a new independent accuser; False if known or enough already."""
        if accuser in self.accusers or self.confirmations >= self.expected:
            return False
        self.accusers.add(accuser)
        return True

    @property
    def confirmations(self) -> int:
        return max(0, len(self.accusers) - 1)

    def timeout(self) -> float:
        if self.expected < 1:
            return self.low
        frac = math.log(self.confirmations + 1) / math.log(self.expected + 1)
        return max(self.low, self.high - (self.high - self.low) * frac)

    @property
    def deadline(self) -> float:
        return self.start + self.timeout()
