"""Give freed memory back to the operating system after large, short-lived buffers.

glibc's allocator keeps what Python and torch free in its arenas (one per thread
that allocated: `asyncio.to_thread` workers, the stage worker) for reuse, and large
flat vectors freed in another order than they were made leave holes it does not
return. Measured (five in-process tiny replicas, `bench/byzantine.py`'s set-up, one
outer round each per step): resident memory grew from 2.1 to 5.1 GB over 11 rounds
while live tensors stayed at 1.75 GB; with `malloc_trim(0)` after each round it stayed
at 2.4 GB. MALLOC_ARENA_MAX=2 alone did not stop the growth.

A no-op where the C library has no `malloc_trim` (macOS, musl), or with
AGORA_MALLOC_TRIM=0 in the environment (to measure the difference:
docs/benchmarks.md, "Memory over outer rounds").

Before trimming, a full garbage collection (`collect_cycles`, on the event loop's own
thread: a cycle may hold coroutines, whose clean-up must not run on a worker thread).
A round's collective objects form
reference cycles (an all-reduce and its round state point at each other) that hold the
round's flat vectors, and Python's collector reaches its oldest generation rarely.
Measured on 2026-12-02 by instrumenting tests/outer/peer.py's replicas (two replicas of
`tiny`'s stage 1, 40 rounds): without it live tensors grew from 141 to 608 MB over 25
rounds (16 rounds' states alive where the book keeps 3) and resident memory from 455 to
915 MB over 40; with it resident memory stayed at 411-452 MB. The collection takes
about 100 ms with a stage of `tiny` loaded (209,000 objects), once per round.
(tests/outer/test_outer.py checks that the rounds' all-reduces no longer pile up.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
import time


@functools.cache
def _trim():  # noqa: ANN202 - a ctypes function or None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None)
    except OSError:
        return None


def collect_cycles() -> float:
    """A full collection of unreachable reference cycles; the seconds it took (tens of
    milliseconds: once per outer round)."""
    started = time.perf_counter()
    gc.collect()
    return time.perf_counter() - started


def release_freed_memory() -> bool:
    """Return the allocator's free pages to the OS (glibc); whether it could. Walks the
    heap: milliseconds for gigabytes, so call it once per outer round, not per step."""
    trim = _trim()
    if trim is None or os.environ.get("AGORA_MALLOC_TRIM") == "0":
        return False
    trim(0)
    return True
