"""Replay protection: each sender numbers its messages; a receiver accepts each
number once, within a sliding window that tolerates reordering in flight.

The sender is the peer id libp2p authenticated for the connection, so only a
sender can replay its own messages; windows are kept for at most `max_senders`
peers, the least recently heard forgotten first (it would then get one replay of
each old message accepted, which precedence makes harmless)."""

from __future__ import annotations


class ReplayGuard:
    """Per-sender highest sequence number plus a bitmap of the `window` below it."""

    __slots__ = ("_seen", "_window", "_max")

    def __init__(self, window: int = 64, max_senders: int = 16384) -> None:
        self._seen: dict[str, tuple[int, int]] = {}  # least recently heard first
        self._window, self._max = window, max_senders

    def accept(self, sender: str, seq: int) -> bool:
        """True the first time (sender, seq) is seen and seq is not too old."""
        last = self._seen.pop(sender, None)
        if last is None:
            if len(self._seen) >= self._max:
                del self._seen[next(iter(self._seen))]
            self._seen[sender] = (seq, 1)
            return True
        self._seen[sender] = last  # most recently heard last
        top, mask = last
        if seq > top:
            shift = seq - top
            mask = ((mask << shift) | 1) & ((1 << self._window) - 1) if shift < self._window else 1
            self._seen[sender] = (seq, mask)
            return True
        offset = top - seq
        if offset >= self._window or mask & (1 << offset):
            return False
        self._seen[sender] = (top, mask | (1 << offset))
        return True

    def forget(self, sender: str) -> None:
        self._seen.pop(sender, None)
