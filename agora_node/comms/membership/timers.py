"""A heap of timers for the state machine: it asks for the next deadline and
pops due timers; cancelled timers are dropped lazily."""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator


class Timer:
    __slots__ = ("when", "kind", "key", "cancelled")

    def __init__(self, when: float, kind: int, key: Hashable) -> None:
        self.when = when
        self.kind = kind
        self.key = key
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class TimerQueue:
    __slots__ = ("_heap", "_count")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Timer]] = []
        self._count = 0

    def add(self, when: float, kind: int, key: Hashable = None) -> Timer:
        timer = Timer(when, kind, key)
        self._count += 1
        heapq.heappush(self._heap, (when, self._count, timer))
        return timer

    def next_deadline(self) -> float:
        heap = self._heap
        while heap and heap[0][2].cancelled:
            heapq.heappop(heap)
        return heap[0][0] if heap else float("inf")

    def pop_due(self, now: float) -> Iterator[Timer]:
        """Yield due timers in deadline order; timers added meanwhile are seen too."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            timer = heapq.heappop(heap)[2]
            if not timer.cancelled:
                yield timer
