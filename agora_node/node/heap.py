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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os


@functools.cache
def _trim():  # noqa: ANN202 - a ctypes function or None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None)
    except OSError:
        return None


def release_freed_memory() -> bool:
    """Return the allocator's free pages to the OS (glibc); whether it could. Walks the
    heap: milliseconds for gigabytes, so call it once per outer round, not per step."""
    trim = _trim()
    if trim is None or os.environ.get("AGORA_MALLOC_TRIM") == "0":
        return False
    trim(0)
    return True
