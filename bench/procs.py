"""A daemon's processes, read from /proc: the daemon and every process it started.

A daemon's libp2p daemon, DHT process and reaper run in sessions of their own
(agora_node/comms/host.py, since c894cbf: a signal to the node's process group reaches the
node alone), so its process group no longer holds them. They are the daemon's
descendants by parent pid while it lives; once it dies they are re-parented, so a
benchmark that checks nothing was left behind notes them (`tree`) while the daemon
lives and looks for those same processes (pid and start time) at the end (`alive`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Proc:
    pid: int
    comm: str
    state: str
    ppid: int
    ticks: int
    """User + system CPU, in clock ticks."""
    start: int
    """Start time after boot, in clock ticks: with the pid, names one process for good."""


def parse_stat(pid: int, stat: str) -> Proc:
    """One /proc/PID/stat (or /proc/PID/task/TID/stat) line; comm may hold spaces and ')'."""
    comm, rest = stat.split(" (", 1)[1].rsplit(")", 1)
    f = rest.split()  # state ppid pgrp session tty tpgid flags minflt cminflt majflt ...
    return Proc(pid, comm, f[0], int(f[1]), int(f[11]) + int(f[12]), int(f[19]))


def read(pid: int) -> Proc | None:
    """The live process `pid` (None if gone, or a zombie)."""
    try:
        proc = parse_stat(pid, Path(f"/proc/{pid}/stat").read_text())
    except (OSError, IndexError, ValueError):
        return None
    return None if proc.state in ("Z", "X") else proc


def live() -> dict[int, Proc]:
    out = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (proc := read(int(entry.name))) is not None:
            out[proc.pid] = proc
    return out


def tree(roots: Iterable[int]) -> dict[int, Proc]:
    """The live processes among `roots` and their descendants, by pid."""
    procs = live()
    children: dict[int, list[int]] = {}
    for proc in procs.values():
        children.setdefault(proc.ppid, []).append(proc.pid)
    found: dict[int, Proc] = {}
    todo = [pid for pid in roots if pid in procs]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found[pid] = procs[pid]
            todo.extend(children.get(pid, ()))
    return found


def alive(seen: dict[int, Proc]) -> list[str]:
    """`pid:comm` of those of `seen` still running (the same process: same start time)."""
    out = []
    for pid, proc in sorted(seen.items()):
        now = read(pid)
        if now is not None and now.start == proc.start:
            out.append(f"{pid}:{proc.comm}")
    return out


def p2pd_sockets(procs: Iterable[Proc]) -> set[str]:
    """The unix sockets of the libp2p daemons among `procs` (theirs and their clients')."""
    found = set()
    for proc in procs:
        if proc.comm != "p2pd":
            continue
        with contextlib.suppress(OSError):
            for arg in Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0"):
                text = arg.decode(errors="replace")
                if "/unix/" in text and "p2pd-" in text:
                    path = text[text.index("/unix/") + len("/unix") :]
                    found |= {path, path.replace("p2pd-", "p2pclient-")}
    return found


def thread_ticks(pid: int) -> list[Proc]:
    """The threads of process `pid` (their comm is the thread's name)."""
    out = []
    with contextlib.suppress(OSError):
        for task in os.scandir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                out.append(parse_stat(int(task.name), Path(task.path, "stat").read_text()))
    return out
