"""What a stop signal does while an `agora-node` command has no event loop handling it.

A daemon's event loop handles SIGTERM, SIGINT, SIGHUP and SIGQUIT as a clean leave
(node/run.py, node/bootstrap.py). Before that loop runs, the command spends seconds in its
imports (torch, hivemind) and checks; a SIGTERM, SIGHUP or SIGQUIT then met Python's
default (killed, exit -15, silent). Nothing has started then that needs cleaning up, so
such a signal ends the command at once, saying so, with exit 0 (`while_starting`; a
SIGINT is a KeyboardInterrupt, exit 130). After the loop has closed, the node has left,
and Python's own shutdown takes seconds more (it also waits for a checkpoint still being
written): a second Ctrl-C or SIGTERM then killed the process, exit -2 or -15, the
documented exit code lost (`ignore_while_exiting`). A signal the caller ignores (nohup's
SIGHUP) stays ignored throughout.

Standard library only: `agora_node.__main__` installs these before importing the rest.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

STOP = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def _stopped(signum: int, _frame: object) -> None:
    print(f"agora-node: stopped while starting ({signal.Signals(signum).name})", file=sys.stderr)
    raise SystemExit(0)


def stop_while_starting() -> dict:
    """Make SIGTERM, SIGHUP and SIGQUIT end the command (exit 0, saying so), except those
    the caller ignores; what each had, for `restore`."""
    inherited = {sig: signal.getsignal(sig) for sig in STOP}
    for sig, handler in inherited.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, _stopped)
    return inherited


def restore(inherited: dict) -> None:
    for sig, handler in inherited.items():
        signal.signal(sig, handler)


@contextlib.contextmanager
def while_starting() -> Iterator[None]:
    """Around a daemon command: `stop_while_starting` until its event loop installs its
    own handlers (and while it runs none, as a dry run); what was there before, after.
    Nothing off the main thread (only it may set handlers: a caller running the command
    in a thread of its own keeps its signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    inherited = stop_while_starting()
    try:
        yield
    finally:
        restore(inherited)


def ignore_while_exiting() -> None:
    """The command is done: stop signals are ignored while the process exits."""
    for sig in (*STOP, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
