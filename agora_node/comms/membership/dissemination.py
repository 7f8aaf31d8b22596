"""Piggy-back dissemination: a queue of gossip items, each sent a bounded number
of times (~ lambda * log n), least-sent first and newest first among equals, so
fresh news overtakes old news."""

from __future__ import annotations


class GossipQueue:
    """Items keyed by subject: newer news about a member replaces the older.

    Items sit in buckets by how often they were sent, so picking the items for
    one message costs O(items picked), even with thousands queued (after a
    partition heals every member has news about many others)."""

    __slots__ = ("_buckets", "_where", "_extra")

    def __init__(self) -> None:
        self._buckets: list[dict[str, bytes]] = [{}]  # index = times sent; insertion = age
        self._where: dict[str, int] = {}  # subject -> bucket index
        self._extra: dict[str, int] = {}  # subject -> sends allowed beyond the limit

    def __len__(self) -> int:
        return len(self._where)

    def push(self, subject: str, raw: bytes, *, extra: int = 0) -> None:
        """Queue `raw` as the news about `subject`, to be sent `extra` more times
        than the limit given to `take`."""
        sent = self._where.get(subject)
        if sent is not None:
            del self._buckets[sent][subject]
        self._buckets[0][subject] = raw
        self._where[subject] = 0
        if extra:
            self._extra[subject] = extra
        else:
            self._extra.pop(subject, None)

    def get(self, subject: str) -> bytes | None:
        sent = self._where.get(subject)
        return None if sent is None else self._buckets[sent][subject]

    def take(self, count: int, limit: int) -> list[bytes]:
        """Up to `count` items for one message; drop those sent `limit` times."""
        if not self._where or count <= 0:
            return []
        chosen: list[tuple[int, str]] = []
        for sent, bucket in enumerate(self._buckets):
            for subject in reversed(bucket):
                if len(chosen) == count:
                    break
                chosen.append((sent, subject))
            if len(chosen) == count:
                break
        out = []
        for sent, subject in chosen:
            raw = self._buckets[sent].pop(subject)
            out.append(raw)
            if sent + 1 >= limit + self._extra.get(subject, 0):
                del self._where[subject]
                self._extra.pop(subject, None)
                continue
            if sent + 1 == len(self._buckets):
                self._buckets.append({})
            self._buckets[sent + 1][subject] = raw
            self._where[subject] = sent + 1
        return out
