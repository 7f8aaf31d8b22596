"""Kill a node's helper processes when the node dies, even by SIGKILL.

hivemind's DHT process and the libp2p daemon are children of the node and keep
running (and answering peers) after the node is SIGKILLed. The reaper is a tiny
separate process that gets SIGTERM from the kernel when its parent dies
(PR_SET_PDEATHSIG) and then SIGKILLs every pid it was told to watch and removes
the unix socket files those children had open: a libp2p daemon killed this way
cannot remove its own, and every crash left two behind in /tmp. At a clean stop it
kills whatever the node failed to stop. A pid is killed only while it names the
process it was told of (same start time): a child that exited and was reaped may
have given its pid to another process.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import signal
import stat
import subprocess
import sys
from collections.abc import MutableMapping
from pathlib import Path

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
PARENT_CHECK_S = 1.0
"""How often the reaper also checks that its parent lives, should the kernel's death
signal not come (a reaper without it would wait for ever: the node's forked children
hold its stdin open). The signal is tied to the thread that started the reaper, which
must live as long as the node: Host.start runs on the event loop's, the main thread."""
_MODULE = "agora_node.comms.reaper"
"""What a reaper runs (`python -m`), and how `is_reaper` tells one."""


def set_parent_death_signal() -> None:
    """SIGTERM to this process when its parent (the thread that started it) dies, even by
    SIGKILL: called by the reaper itself, and by a node a demo started (`die_with_parent`)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


DIE_WITH_PARENT_ENV = "AGORA_DIE_WITH_PARENT"
"""Set by whoever starts a node that must leave when its starter dies (the demo, the test
harness): the starter's pid. Not a node option; the node removes it from its environment."""


def die_with_parent(environ: MutableMapping[str, str] = os.environ) -> None:
    """Arm this process's death signal when `DIE_WITH_PARENT_ENV` asks for it, then check
    that the parent named there still is ours (it may have died before the signal was
    armed: then SIGTERM now, whose default action ends it before anything started; a
    starter must exec the node in place, as `ip netns exec` does, not through a wrapper
    that forks, whose pid the node would see instead). Done by the node itself rather than in
    a preexec_fn: a process with threads, or serving gRPC, must not run Python between fork
    and exec (see Reaper.start)."""
    value = environ.pop(DIE_WITH_PARENT_ENV, None)
    if value is None or not sys.platform.startswith("linux"):
        return
    set_parent_death_signal()
    if not value.isdigit() or os.getppid() != int(value):
        os.kill(os.getpid(), signal.SIGTERM)


class Reaper:
    def __init__(self, proc: subprocess.Popen | None) -> None:
        self._proc = proc
        self._watched: list[tuple[int, int]] = []
        """(pid, start time) of each process told: `stop` kills those still running."""
        self._warned = False
        """Said once that the reaper exited (a node tells it up to four things)."""

    @classmethod
    def start(cls) -> Reaper:
        if not sys.platform.startswith("linux"):
            return cls(None)  # no PR_SET_PDEATHSIG: rely on process-group kills
        # No preexec_fn: with one, the child of this (threaded, gRPC-serving) process runs
        # Python and gRPC's fork handlers before exec, and gRPC aborted it there (SIGABRT,
        # 5-8 reapers of 100, tests/node/test_reaper.py): a node without a reaper
        # left its DHT process and libp2p daemon running when killed. Without one, Python
        # spawns by vfork, which runs no fork handlers; the reaper arms its death signal.
        proc = subprocess.Popen(
            [sys.executable, "-m", _MODULE, str(os.getpid())],
            stdin=subprocess.PIPE,
            close_fds=True,
            # its own session: a SIGKILL of the node's whole process group (an operator's
            # `kill -9 -PGID`, a service manager) must not take the reaper with it
            start_new_session=True,
        )
        return cls(proc)

    def watch(self, pid: int) -> None:
        """Kill `pid`, a child of this process, when this process dies or stops (a pid that
        names no child of ours any more, its process gone and the pid reused, is ignored)."""
        started = start_time(pid, parent=os.getpid())
        if started is None:
            return
        self._watched.append((pid, started))
        self._tell(f"{pid} {started}")

    def remove_on_death(self, path: str) -> None:
        """Have the reaper remove the unix socket at `path` (absolute, one line) if this
        process dies; a file that is not a socket is left alone."""
        if "\n" in path or not path.startswith("/"):
            raise ValueError(f"not an absolute one-line path: {path!r}")
        self._tell(f"file {path}")

    def _tell(self, line: str) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            try:
                self._proc.stdin.write(f"{line}\n".encode())
                self._proc.stdin.flush()
                return
            except BrokenPipeError:  # it exited (or closed its stdin) since the poll
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=1)  # for its exit code, if it has one
        if not self._warned:
            self._warned = True
            log.warning(
                "the reaper (pid %d) exited with code %s: if this node is killed, its DHT "
                "process and libp2p daemon may go on running",
                self._proc.pid,
                self._proc.returncode,
            )

    def stop(self) -> None:
        """Normal shutdown: the children were stopped; dismiss the reaper, which kills any
        that still run (a shutdown that did not stop one must not leave it behind). They are
        killed here, before the reaper is dismissed: a reaper too slow to answer is killed."""
        _kill(self._watched)
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(BrokenPipeError):  # it exited since the poll
                self._proc.stdin.write(b"exit\n")
                self._proc.stdin.flush()
            with contextlib.suppress(BrokenPipeError):
                self._proc.stdin.close()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # what it had to do is done: do not wait on it
                self._proc.kill()
                self._proc.wait(timeout=5)


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat from the state on (field 3: "R", "S", "Z", ...; the
    command name before it may hold spaces and ')'); None if the process is gone or there
    is no /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int, parent: int | None = None) -> int | None:
    """When `pid` started (clock ticks since boot), None if it is gone (or, with `parent`,
    is not that process's child): a pid and its start time name one process, even after
    the pid is reused."""
    fields = proc_stat(pid)
    try:
        if fields is None or (parent is not None and int(fields[1]) != parent):  # field 4
            return None
        return int(fields[19])  # field 22
    except (IndexError, ValueError):
        return None


def _main(parent: int) -> None:
    """Read "PID START" and "file PATH" lines until "exit" (a clean stop: kill only what
    still runs) or until the parent dies: SIGTERM (PR_SET_PDEATHSIG), the end of stdin, or
    another parent found at a check every PARENT_CHECK_S.
    Then kill and remove everything told, the lines the parent wrote just before it died
    included: the handler only makes stdin non-blocking, and the loop reads what is left
    before it acts (stdin may never end, as forked children of the parent hold the pipe's
    other end)."""
    watched: list[tuple[int, int]] = []
    files: list[str] = []
    dying = False

    def on_term(*_: object) -> None:
        nonlocal dying
        dying = True
        os.set_blocking(0, False)

    # a signal also writes a byte here, so the wait below ends at once (PEP 475 would
    # otherwise resume it for the rest of its timeout after the handler ran)
    woken, wake = os.pipe()
    for fd in (woken, wake):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the node; it shuts down cleanly
    set_parent_death_signal()  # the thread that started us: Host.start's, the event loop's
    if os.getppid() != parent:  # the parent died before the signal was armed
        on_term()
    pending = b""
    while True:
        if not dying:
            ready = select.select([0, woken], [], [], PARENT_CHECK_S)[0]
            if woken in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(woken, 512)
            elif not ready and os.getppid() != parent:  # it died; its signal did not come
                on_term()
            if not dying and 0 not in ready:
                continue
        try:
            chunk = os.read(0, 4096)
        except BlockingIOError:  # dying and nothing more was written
            break
        if not chunk:  # the parent is gone (or closed us)
            break
        *lines, pending = (pending + chunk).split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace").strip()
            if line == "exit":
                _kill(watched)
                return
            pid, _, started = line.partition(" ")
            if pid.isdigit() and started.isdigit():
                watched.append((int(pid), int(started)))
            elif line.startswith("file /"):
                files.append(line[len("file ") :])
    _kill(watched)
    for path in files:
        remove_socket(path)


def _kill(watched: list[tuple[int, int]]) -> None:
    """SIGKILL each watched process that still runs (its pid names the same process: the
    check and the signal go through one pidfd where the kernel has them, so the pid cannot
    change between them)."""
    for pid, started in watched:
        try:
            fd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # gone
            continue
        except (AttributeError, OSError):  # no pidfds (not Linux, or before 5.3)
            fd = None
        try:
            if start_time(pid) == started:
                if fd is None:
                    os.kill(pid, signal.SIGKILL)
                else:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        finally:
            if fd is not None:
                os.close(fd)


def is_reaper(pid: int) -> bool:
    """Is `pid` a node's reaper? One that kills a node's processes by hand must spare it:
    it removes the libp2p daemon's sockets once its node is gone."""
    try:
        return _MODULE.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def remove_socket(path: str) -> None:
    """Remove the file at `path` if it is a unix socket (anything else is left alone)."""
    with contextlib.suppress(OSError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            Path(path).unlink()


if __name__ == "__main__":
    _main(int(sys.argv[1]))
