"""Admission and deadlines for every request this node serves.

One `Guard` per served protocol (forward, state, collective, membership). A
request is admitted before anything of it is read, by the peer id libp2p
authenticated for the connection (never a claim inside the payload), if

- fewer than `max_streams` requests of this protocol are being served,
- fewer than `max_streams_per_peer` of them come from that peer,
- that peer's token bucket (`rate_per_s`, `burst`) has a token.

Once admitted, the request must arrive within its read deadline, each write must
drain within its drain deadline (both a fixed part plus the bytes at
`min_bytes_per_s`), and the whole exchange must end within `deadline_s`. A
refusal or a cut is counted by reason (`refused`, and `on_refuse(protocol,
reason)`, which the daemon points at its metrics).

Per-peer state is bounded: streams are tracked only while open (at most
`max_streams`), buckets for at most `MAX_TRACKED_PEERS` peers (least recently
seen forgotten first; a forgotten peer starts again with a full bucket).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_TRACKED_PEERS = 4096


class Reason(StrEnum):
    BUSY = "busy"
    """This protocol already serves `max_streams` requests."""
    PEER_STREAMS = "peer_streams"
    """This peer already holds `max_streams_per_peer` of them."""
    RATE = "rate"
    """This peer's token bucket is empty."""
    READ_DEADLINE = "read_deadline"
    DRAIN_DEADLINE = "drain_deadline"
    DEADLINE = "deadline"
    OVERSIZED = "oversized"
    """A message announced more bytes than the protocol's cap (refused before reading it)."""
    NO_RECORD = "no_record"
    """The peer asked for a stage's state, or sent a whole collective request through a
    relay, without a record at that stage (node/service.py, collective/p2p.py)."""


ADMISSION = (Reason.BUSY, Reason.PEER_STREAMS, Reason.RATE)
"""Refusals before anything was read: the peer may be told (it is cheap and bounded)."""


class Refused(ConnectionError):
    """A request refused or cut by its guard; `reason` says why."""

    def __init__(self, reason: Reason, detail: str = "") -> None:
        super().__init__(f"refused ({reason.value}){': ' + detail if detail else ''}")
        self.reason = reason


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What one protocol allows. Defaults fit a request/response protocol of small
    messages; each protocol states its own in the module that serves it."""

    max_streams: int = 64
    """Requests of this protocol served at once, from all peers."""
    max_streams_per_peer: int = 8
    """Requests served at once from one peer."""
    rate_per_s: float = 20.0
    """Sustained requests per second from one peer (token bucket refill)."""
    burst: float = 40.0
    """Requests one peer may send at once after being quiet (bucket size)."""
    read_deadline_s: float = 10.0
    """To receive a request (or one message of a streamed request), plus its bytes at
    `min_bytes_per_s`."""
    drain_deadline_s: float = 30.0
    """For one write to be taken by the peer, plus its bytes at `min_bytes_per_s`."""
    min_bytes_per_s: float = 256 << 10
    """The slowest link a request or response may use (2 Mbit/s)."""
    deadline_s: float = 120.0
    """The whole exchange: reading, handling and every write."""

    def __post_init__(self) -> None:
        for name in ("max_streams", "max_streams_per_peer"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("rate_per_s", "read_deadline_s", "drain_deadline_s", "min_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if not (self.burst >= 1 and math.isfinite(self.burst)):
            raise ValueError("burst must be at least 1")
        if not self.deadline_s > 0:
            raise ValueError("deadline_s must be positive")

    def read_s(self, nbytes: int = 0) -> float:
        return self.read_deadline_s + nbytes / self.min_bytes_per_s

    def drain_s(self, nbytes: int = 0) -> float:
        return self.drain_deadline_s + nbytes / self.min_bytes_per_s


class TokenBucket:
    """`burst` tokens, refilled at `rate` per second; one request takes one (`take`), or
    work of several units spends what it used (`left`, then `spend`)."""

    __slots__ = ("rate", "burst", "tokens", "at")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.at = burst, now

    def left(self, now: float) -> int:
        """Whole tokens there are now."""
        # a clock that went back refills nothing (and never drains the bucket)
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.at) * self.rate)
        self.at = max(self.at, now)
        return int(self.tokens)

    def spend(self, n: float) -> None:
        self.tokens -= n

    def take(self, now: float) -> bool:
        if self.left(now) >= 1:
            self.spend(1.0)
            return True
        return False


class Guard:
    """Admission, deadlines and refusal counts of one protocol (module docstring)."""

    def __init__(
        self,
        protocol: str,
        limits: Limits | None = None,
        *,
        on_refuse: Callable[[str, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.protocol = protocol
        self.limits = limits or Limits()
        self.refused: Counter[str] = Counter()
        self.active = 0
        self._on_refuse, self._clock = on_refuse, clock
        self._streams: dict[str, int] = {}  # peer -> open streams (only while > 0)
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    # ---- admission (pure bookkeeping, no I/O) ---------------------------------------------
    def admit(self, remote: str) -> None:
        """Take one stream slot for `remote`, or raise Refused (counted). Pair with `release`."""
        lim = self.limits
        if self.active >= lim.max_streams:
            raise self.refuse(Reason.BUSY, remote)
        if self._streams.get(remote, 0) >= lim.max_streams_per_peer:
            raise self.refuse(Reason.PEER_STREAMS, remote)
        if not self._bucket(remote).take(self._clock()):
            raise self.refuse(Reason.RATE, remote)
        self.active += 1
        self._streams[remote] = self._streams.get(remote, 0) + 1

    def release(self, remote: str) -> None:
        self.active -= 1
        left = self._streams[remote] - 1
        if left:
            self._streams[remote] = left
        else:
            del self._streams[remote]

    def streams_of(self, remote: str) -> int:
        return self._streams.get(remote, 0)

    def _bucket(self, remote: str) -> TokenBucket:
        bucket = self._buckets.get(remote)
        if bucket is None:
            if len(self._buckets) >= MAX_TRACKED_PEERS:
                self._buckets.popitem(last=False)
            bucket = self._buckets[remote] = TokenBucket(
                self.limits.rate_per_s, self.limits.burst, self._clock()
            )
        else:
            self._buckets.move_to_end(remote)
        return bucket

    def refuse(self, reason: Reason, remote: str = "", detail: str = "") -> Refused:
        """Count a refusal and return the exception to raise."""
        self.refused[reason.value] += 1
        if self._on_refuse is not None:
            self._on_refuse(self.protocol, reason.value)
        log.debug("%s: refused %s (%s) %s", self.protocol, remote[-8:], reason.value, detail)
        return Refused(reason, detail)

    # ---- deadlines ------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def serving(self, remote: str) -> AsyncIterator[None]:
        """Admit `remote` and bound the whole exchange by `deadline_s`."""
        self.admit(remote)
        deadline = asyncio.timeout(self.limits.deadline_s)
        try:
            async with deadline:
                yield
        except TimeoutError:
            if not deadline.expired():
                raise  # the handler's own timeout, not ours
            raise self.refuse(Reason.DEADLINE, remote) from None
        finally:
            self.release(remote)

    async def read(self, step: Awaitable[T], nbytes: int = 0, remote: str = "") -> T:
        """Await one read of `nbytes` (0: a header) under the read deadline."""
        return await self._within(step, self.limits.read_s(nbytes), Reason.READ_DEADLINE, remote)

    async def drain(self, step: Awaitable[T], nbytes: int = 0, remote: str = "") -> T:
        """Await one write of `nbytes` (queued and drained) under the drain deadline."""
        return await self._within(step, self.limits.drain_s(nbytes), Reason.DRAIN_DEADLINE, remote)

    async def _within(self, step: Awaitable[T], seconds: float, reason: Reason, remote: str) -> T:
        try:
            async with asyncio.timeout(seconds):
                return await step
        except TimeoutError:
            raise self.refuse(reason, remote) from None

    def check_size(self, nbytes: int, cap: int, remote: str = "") -> None:
        if nbytes > cap:
            raise self.refuse(Reason.OVERSIZED, remote, f"{nbytes} bytes > {cap}")
