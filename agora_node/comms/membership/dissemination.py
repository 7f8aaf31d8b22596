"""Piggy-back dissemination: a queue of gossip items, each sent a bounded number
of times (~ lambda * log n), least-sent first so news overtakes old news."""

from __future__ import annotations

import heapq


class GossipQueue:
    """Items keyed by subject: newer news about a member replaces the older."""

    __slots__ = ("_items", "_order")

    def __init__(self) -> None:
        # subject -> [transmits, -order, raw]; the list is mutated in place
        self._items: dict[str, list] = {}
        self._order = 0

    def __len__(self) -> int:
        return len(self._items)

    def push(self, subject: str, raw: bytes) -> None:
        self._order += 1
        self._items[subject] = [0, -self._order, raw]

    def get(self, subject: str) -> bytes | None:
        entry = self._items.get(subject)
        return None if entry is None else entry[2]

    def take(self, count: int, limit: int) -> list[bytes]:
        """Up to `count` items for one message; drop those sent `limit` times."""
        if not self._items or count <= 0:
            return []
        items = self._items
        if len(items) <= count:
            chosen = list(items.items())
        else:
            chosen = heapq.nsmallest(count, items.items(), key=lambda kv: (kv[1][0], kv[1][1]))
        out = []
        for subject, entry in chosen:
            out.append(entry[2])
            entry[0] += 1
            if entry[0] >= limit:
                del items[subject]
        return out
