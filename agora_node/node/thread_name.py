"""Name the calling thread for the operating system, so top -H, ps -L and
/proc/<pid>/task/<tid>/comm show what it is (Python 3.11 names threads for itself only).

The stage worker's compute thread is `agora-stageN`; bench/swarm.py tells its CPU time
from the rest of the daemon's by that name.
"""

from __future__ import annotations

import contextlib
import ctypes

_PR_SET_NAME = 15


def name_os_thread(name: str) -> None:
    """Linux only (at most 15 bytes are kept); elsewhere nothing happens."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
