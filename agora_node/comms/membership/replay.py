"""Replay protection: each sender numbers its messages; a receiver accepts each
number once, within a sliding window that tolerates reordering in flight."""

from __future__ import annotations


class ReplayGuard:
    """Per-sender highest sequence number plus a bitmap of the `window` below it."""

    __slots__ = ("_seen", "_window")

    def __init__(self, window: int = 64) -> None:
        self._seen: dict[str, tuple[int, int]] = {}
        self._window = window

    def accept(self, sender: str, seq: int) -> bool:
        """True the first time (sender, seq) is seen and seq is not too old."""
        last = self._seen.get(sender)
        if last is None:
            self._seen[sender] = (seq, 1)
            return True
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
