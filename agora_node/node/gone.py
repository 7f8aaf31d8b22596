"""Requests waiting on peers, given up as soon as membership declares their peer gone.

A peer that crashed refuses at once, but one that froze, or whose link was cut (no
reset reaches us), would hold each request sent to it for its whole timeout; SWIM sees
it in seconds. `GoneWatch.call` awaits a request as a task of its own, filed under its
peer; `gone(peer)` cancels that peer's, and each of their callers gets a
`PeerGoneError` (a StreamError, so it is handled as any failed request and retried
elsewhere). Cancelling the caller itself stays a cancellation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from agora_node.comms import streams

T = TypeVar("T")


class PeerGoneError(streams.StreamError):
    """A request abandoned because membership declared its peer dead or gone."""


class GoneWatch:
    def __init__(self) -> None:
        self._waiting: dict[str, set[asyncio.Future]] = {}
        self._abandoned: set[asyncio.Future] = set()

    async def call(self, peer: str, request: Awaitable[T]) -> T:
        """`await request`, unless `gone(peer)` comes first (then PeerGoneError)."""
        task = asyncio.ensure_future(request)
        waiting = self._waiting.setdefault(peer, set())
        waiting.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if task in self._abandoned and (me is None or not me.cancelling()):
                raise PeerGoneError(f"{peer[-8:]} was declared dead while we waited") from None
            raise
        finally:
            waiting.discard(task)
            if not waiting:
                self._waiting.pop(peer, None)
            self._abandoned.discard(task)

    def gone(self, peer: str) -> None:
        """Membership declared `peer` dead or gone: end what is waiting on it now."""
        for task in self._waiting.get(peer, ()):
            if not task.done():
                self._abandoned.add(task)
                task.cancel()

    def idle(self) -> bool:
        """Nothing waiting, nothing kept."""
        return not self._waiting and not self._abandoned
