"""Kill a node's helper processes when the node dies, even by SIGKILL.

hivemind's DHT process and the libp2p daemon are children of the node and keep
running (and answering peers) after the node is SIGKILLed. The reaper is a tiny
separate process that gets SIGTERM from the kernel when its parent dies
(PR_SET_PDEATHSIG) and then SIGKILLs every pid it was told to watch.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal() -> None:
    """In a child, before exec (preexec_fn): SIGTERM when the parent dies, even by SIGKILL."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Reaper:
    def __init__(self, proc: subprocess.Popen | None) -> None:
        self._proc = proc

    @classmethod
    def start(cls) -> Reaper:
        if not sys.platform.startswith("linux"):
            return cls(None)  # no PR_SET_PDEATHSIG: rely on process-group kills
        proc = subprocess.Popen(
            [sys.executable, "-m", "agora_node.comms.reaper", str(os.getpid())],
            stdin=subprocess.PIPE,
            preexec_fn=set_parent_death_signal,  # noqa: PLW1509 - must run in the child
            close_fds=True,
        )
        return cls(proc)

    def watch(self, pid: int) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.write(f"{pid}\n".encode())
            self._proc.stdin.flush()

    def stop(self) -> None:
        """Normal shutdown: the children were stopped cleanly; dismiss the reaper."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.write(b"exit\n")
            self._proc.stdin.flush()
            self._proc.stdin.close()
            self._proc.wait(timeout=5)


def _main(parent: int) -> None:
    watched: list[int] = []

    def kill_all(*_: object) -> None:
        for pid in watched:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os._exit(0)

    signal.signal(signal.SIGTERM, kill_all)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the node; it shuts down cleanly
    if os.getppid() != parent:  # parent died before the signal was armed
        kill_all()
    for line in sys.stdin:
        line = line.strip()
        if line == "exit":
            return
        if line.isdigit():
            watched.append(int(line))
    # stdin closed without "exit": the parent is gone (or closed us) -> clean up
    kill_all()


if __name__ == "__main__":
    _main(int(sys.argv[1]))
