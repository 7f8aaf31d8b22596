"""The weights of an overlapped outer round (manifest `outer.overlap`; rounds.py runs it).

At a round's end the stage worker is frozen once to read the weights and set them to the
eager step; inner steps go on from there while the round mixes. `OverlappedWeights` is
what `OuterLoop.end_round` reads and writes meanwhile (an `outer.Weights`).
"""

from __future__ import annotations

import asyncio
import time

from torch import Tensor

from agora_node.node.worker import StageWorker


class OverlappedWeights:
    """outer.Weights for a round whose mixes run while inner steps go on.

    `read` gives the weights taken (frozen) at the round's end, `at_end`. The inner steps
    went on from `start`: the outer step this replica's own pseudo-gradient makes
    (`OuterState.preview`, an eager step; `at_end` itself works too). `write(new)`
    freezes the worker only to set `new + (now - start)`: the mixed round's anchor (less
    what stays unsent, with `unsent = "weights"`) plus whatever the inner steps added
    since. `blocked_s` is how long the worker was frozen.
    A round abandoned before its write (`restore`) sets `at_end + (now - start)`: the
    weights go back to what the unchanged anchor and momentum belong to, progress kept."""

    def __init__(
        self, worker: StageWorker, at_end: Tensor, start: Tensor, blocked_s: float
    ) -> None:
        self.worker, self.at_end, self.start, self.blocked_s = worker, at_end, start, blocked_s

    async def read(self) -> Tensor:
        return self.at_end

    async def write(self, new: Tensor) -> None:
        started = time.monotonic()
        async with self.worker.frozen() as weights:
            now = await weights.read()
            landed = await asyncio.to_thread(_plus_progress, new, now, self.start)
            await weights.write(landed)
        self.blocked_s += time.monotonic() - started

    async def restore(self) -> None:
        """Undo the eager step of a round that will not land (its progress stays); only
        before `write` (OuterRounds calls it when no outer step was taken)."""
        await self.write(self.at_end)


def _plus_progress(new: Tensor, now: Tensor, start: Tensor) -> Tensor:
    """`new + (now - start)`, stage-sized: run on a thread, off the event loop."""
    return (now - start).add_(new)
