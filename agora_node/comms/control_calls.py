"""hivemind's control client (its calls to the local libp2p daemon) made to survive a
caller cancelled while its answer was on the way: see `CallsAnsweredAfterCancel`.
`settle_cancelled_calls` installs it for every client made afterwards (comms/host.py's
`create_p2p` calls it)."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from hivemind.p2p.p2p_daemon_bindings.control import ControlClient


class CallsAnsweredAfterCancel(dict):
    """hivemind's control client's pending calls (`ControlClient._pending_calls`), by call
    id. Its reader sets a call's future when p2pd answers. A caller cancelled meanwhile (a
    SWIM send past its timeout, a node stopping while it registers its handlers) has
    cancelled that future already but removes it only a step later, and `set_result` on it
    raised InvalidStateError, which ended the reader: from then on every call and handler
    registration of the process waited forever and incoming unary requests (SWIM's) went
    unanswered. Seen as "Task exception was never retrieved" after a SIGHUP 6 s into a
    join. A cancelled call's answer, result or error, now goes nowhere (`_Discard`: a
    throwaway future set with an error would log "Future exception was never retrieved").
    Callers never get it: each reads its future right after putting it in."""

    def __getitem__(self, call_id: Any) -> asyncio.Future | _Discard:
        future = super().__getitem__(call_id)
        return _DISCARD if future.cancelled() else future


class _Discard:
    """Where hivemind's reader puts a cancelled call's answer."""

    def set_result(self, _result: Any) -> None:
        pass

    def set_exception(self, _exc: BaseException) -> None:
        pass


_DISCARD = _Discard()


def settle_cancelled_calls() -> None:
    """Every hivemind ControlClient made from now on keeps its pending calls in
    `CallsAnsweredAfterCancel`: this process's, and its DHT process's (forked later).
    Idempotent."""
    init = ControlClient.__init__
    if getattr(init, "settles_cancelled_calls", False):
        return

    @functools.wraps(init)
    def __init__(self: ControlClient, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        init(self, *args, **kwargs)
        self._pending_calls = CallsAnsweredAfterCancel()

    __init__.settles_cancelled_calls = True
    ControlClient.__init__ = __init__
