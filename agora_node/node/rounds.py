"""When a stage replica takes its outer steps: the one owner of the outer-round schedule.

`OuterLoop` (outer.py) knows how to run one round; this module decides when.
Replicas of a stage stay in step without a coordinator:

1. a round ends for every replica as soon as one of them has done its H inner
   steps and opened the round's matchmaking (`round_should_end`): the others
   join with the steps they have, weighted by their tokens;
2. a replica whose round number fell behind the rounds its stage's active
   replicas announce jumps to the largest of them (`target_round`);
3. the blocking part of a round (pseudo-gradient mix, Nesterov step, new
   weights) runs while the stage worker is frozen: inner steps wait, forwards
   and backwards go on, and the weights are read and written on the worker
   thread only.

The two decisions are pure functions, tested without a network.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from agora_node.node.outer import OuterLoop
from agora_node.node.worker import StageWorker

log = logging.getLogger(__name__)

KEPT_DIGESTS = 10


def target_round(own: int, replica_rounds: Iterable[int]) -> int:
    """The round to be in: the largest announced by this stage's active replicas, never
    lower than the own one (a lagging replica catches up, nobody goes back)."""
    return max([own, *replica_rounds])


def round_should_end(steps_done: int, every: int, opened_elsewhere: bool) -> bool:
    """End the round after `every` inner steps, or once another replica opened it and
    this one has at least one step to contribute."""
    return steps_done >= every or (steps_done > 0 and opened_elsewhere)


class OuterRounds:
    """Runs `outer`'s rounds every H inner steps of `worker`; see the module docstring.

    replica_rounds(): the outer rounds the stage's other active replicas announce.
    replica_count(): how many live replicas the stage has (this one included).
    """

    def __init__(
        self,
        outer: OuterLoop,
        worker: StageWorker,
        *,
        inner_steps: int,
        replica_rounds: Callable[[], list[int]],
        replica_count: Callable[[], int],
        poll_s: float = 0.5,
    ) -> None:
        self.outer, self.worker, self.every = outer, worker, inner_steps
        self.replica_rounds, self.replica_count, self.poll_s = (
            replica_rounds,
            replica_count,
            poll_s,
        )
        self.anchor_digests: dict[int, str] = {}
        """Digest of the anchor after each recent round: the stage's replicas compare equal."""
        self._lock = asyncio.Lock()

    @property
    def round(self) -> int:
        return self.outer.state.round

    @contextlib.asynccontextmanager
    async def consistent(self) -> AsyncIterator[None]:
        """No round ends inside: weights and outer state read here are from one moment."""
        async with self._lock:
            yield

    def state_dict(self) -> dict[str, Any]:
        return self.outer.state_dict()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self._catch_up()
            start_step = self.worker.optimizer.steps
            start_tokens = self.worker.stats.trained_tokens
            while not stop.is_set():
                done = self.worker.optimizer.steps - start_step
                if round_should_end(
                    done, self.every, done > 0 and await self.outer.opened_elsewhere()
                ):
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.poll_s)
            if stop.is_set():
                return
            await self.outer.begin_round(expect=self.replica_count())
            async with self._lock, self.worker.frozen() as weights:
                tokens = self.worker.stats.trained_tokens - start_tokens
                await self.outer.end_round(tokens=tokens, weights=weights)
            await self._note_digest()

    def _catch_up(self) -> None:
        target = target_round(self.round, self.replica_rounds())
        if target > self.round:
            log.info("outer round %d -> %d to meet this stage's replicas", self.round, target)
            self.outer.state.round = target

    async def _note_digest(self) -> None:
        state = self.outer.state
        self.anchor_digests[state.round] = await asyncio.to_thread(state.digest)
        for old in sorted(self.anchor_digests)[:-KEPT_DIGESTS]:
            del self.anchor_digests[old]

    def status(self) -> dict[str, Any]:
        status = self.outer.status()
        status["anchor_digests"] = {str(r): d for r, d in self.anchor_digests.items()}
        return status

    async def close(self) -> None:
        await self.outer.close()
