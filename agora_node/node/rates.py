"""Rates over a sliding window of recent events: compute rate, utilization, tokens/s;
and `WorkerStats`, what a stage worker's compute did (counts and those windows).

A lifetime average hides a node that slowed down an hour ago; an EMA of
per-call rates averages ratios (a fast forward and a slow backward do not
average to the rate of the pair). A window keeps the sums of the last
`span_s` seconds and divides them.

Written from the stage worker's thread and read from the event loop, so every
method takes a lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

SPAN_S = 60.0
"""Seconds the windows of a node cover (about one rebalance interval)."""
MIN_EVENTS = 8
"""Events a window needs for `per_second` to measure anew."""


class RateWindow:
    """Events (amount, seconds) of the last `span_s` seconds, and their sums.

    - `per_second()`: amount per second of the events' own `seconds` (e.g. tokens
      per compute-second); while the window holds fewer than `MIN_EVENTS` events (a
      node lightly loaded, or idle: the window drains), over the last `MIN_EVENTS`
      events however old, so an idle node keeps its measured speed. (Measured over the
      last few micro-batches of a draining window, an idle node's announced rate
      climbed from 12.5k to 22.7k tokens per compute-second, and placement took it;
      frozen at the last rate of a full window, a node with fewer micro-batches a
      minute never measured again.)
    - `per_wall_second()`: amount per second of wall time (e.g. completed tokens/s,
      or busy seconds per second = utilization). The window counts from its
      creation, so a node that just started is not credited with a full span.
    """

    def __init__(self, span_s: float = SPAN_S, clock: Callable[[], float] = time.monotonic) -> None:
        if span_s <= 0:
            raise ValueError(f"span_s must be positive, got {span_s}")
        self.span_s, self._clock = span_s, clock
        self._created = clock()
        self._events: deque[tuple[float, float, float]] = deque()  # (at, amount, seconds)
        self._amount = self._seconds = 0.0
        self._last: deque[tuple[float, float]] = deque(maxlen=MIN_EVENTS)
        """The last MIN_EVENTS events (amount, seconds), whatever their age."""
        self._lock = threading.Lock()

    def add(self, amount: float, seconds: float = 0.0) -> None:
        with self._lock:
            now = self._clock()
            self._events.append((now, amount, seconds))
            self._last.append((amount, seconds))
            self._amount += amount
            self._seconds += seconds
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.span_s:
            _, amount, seconds = self._events.popleft()
            self._amount -= amount
            self._seconds -= seconds
        if not self._events:  # no drift from float subtraction across an empty window
            self._amount = self._seconds = 0.0

    def per_second(self) -> float:
        with self._lock:
            self._trim(self._clock())
            if len(self._events) >= MIN_EVENTS:
                amount, seconds = self._amount, self._seconds
            else:
                amount, seconds = sum(a for a, _ in self._last), sum(s for _, s in self._last)
            return amount / seconds if seconds > 0 else 0.0

    def per_wall_second(self) -> float:
        with self._lock:
            now = self._clock()
            self._trim(now)
            elapsed = min(self.span_s, now - self._created)
            return self._amount / elapsed if elapsed > 0 else 0.0


@dataclass
class WorkerStats:
    """What this node's compute did. Each micro-batch's tokens count once, when its
    backward ends; its compute time is its forward and backward together."""

    microbatches: int = 0
    """Micro-batches whose forward and backward both ran here."""
    compute_s: float = 0.0
    """Seconds the worker spent computing (training and validation, wasted forwards too)."""
    recomputed: int = 0
    """Backwards that recomputed their forward (more micro-batches in flight than graphs)."""
    expired: int = 0
    out_of_memory: int = 0
    """Micro-batches refused because the device ran out of memory (`StageWorker.out_of_memory`)."""
    steps: int = 0
    stale_grads: int = 0
    """Micro-batches whose gradient was computed on an older weight version than the step used."""
    trained_tokens: int = 0
    """Tokens of micro-batches whose gradient this stage accumulated (the outer-step weight)."""
    completed: RateWindow = field(default_factory=RateWindow)
    """Recent micro-batches: (tokens, their forward + backward seconds)."""
    busy: RateWindow = field(default_factory=RateWindow)
    """Recent compute seconds, for utilization."""

    @property
    def compute_rate(self) -> float:
        """Tokens per compute-second over the window: this node's speed on its stage when
        busy, comparable across stages (not the swarm's tokens/s)."""
        return self.completed.per_second()

    @property
    def utilization(self) -> float:
        """Fraction of wall time the worker computed, over the window."""
        return min(1.0, self.busy.per_wall_second())

    @property
    def throughput(self) -> float:
        """What the node announces in its record: the compute rate."""
        return self.compute_rate

    @property
    def tokens(self) -> int:
        """Tokens this node trained (each micro-batch once); the record's tokens_seen."""
        return self.trained_tokens
