"""Where a stage's wall time goes, for the progress line and the status page.

Sampled every `SAMPLE_S`: the worker is computing (or has work queued on its
thread); or it holds forwards whose gradients have not come back (waiting on the
stages downstream); or it has nothing to do ("idle": beyond stage 0, waiting on
upstream for micro-batches). Time blocked in outer rounds is measured by the rounds
themselves (`seconds_blocked`) and reported beside, as a share of the same interval.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

SAMPLE_S = 0.1
KINDS = ("compute", "downstream", "idle")


@dataclass
class Waits:
    clock: Callable[[], float] = time.monotonic
    counts: Counter[str] = field(default_factory=Counter)
    last: dict[str, float] = field(default_factory=dict)
    """The split of the last interval taken (`take`), {} before the first."""
    _since: float | None = None
    _blocked_at_start: float = 0.0

    def sample(self, *, computing: bool, awaiting: bool) -> None:
        self.counts["compute" if computing else "downstream" if awaiting else "idle"] += 1

    def take(self, blocked_total_s: float) -> dict[str, float]:
        """Fractions of the samples since the last take, and `outer`: the share of the
        interval's wall time the rounds blocked (from their running total)."""
        now, total = self.clock(), sum(self.counts.values())
        split = {k: self.counts[k] / total for k in KINDS} if total else {}
        if split and self._since is not None and now > self._since:
            blocked = max(0.0, blocked_total_s - self._blocked_at_start)
            split["outer"] = min(1.0, blocked / (now - self._since))
        self._since, self._blocked_at_start = now, blocked_total_s
        self.counts.clear()
        self.last = split
        return split


def describe(split: dict[str, float], stage: int) -> str:
    """ "compute 42% downstream 51% upstream 7%, outer rounds blocked 3%" (stage 0's idle is
    "idle"). The first three add up to the interval; the blocked share overlaps them."""
    idle = "idle" if stage == 0 else "upstream"
    names = {"compute": "compute", "downstream": "downstream", "idle": idle}
    text = " ".join(f"{names[k]} {v:.0%}" for k, v in split.items() if k in names)
    return text + (f", outer rounds blocked {split['outer']:.0%}" if "outer" in split else "")
