"""Running one node in this process: the signals that stop it and its exit code.

`run_node` starts a `Node` (daemon.py), serves until a stop signal or `agora-node leave`,
then leaves and closes it. SIGTERM, SIGINT, SIGHUP and SIGQUIT mean "leave cleanly"
(while still joining: stop joining); a second one cuts the leave short; SIGUSR1 re-reads
a private swarm's allow list.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable
from typing import Any

from agora_node.node import datadir
from agora_node.node.config import NodeConfig
from agora_node.node.daemon import Node
from agora_node.node.errors import JoinError
from agora_node.stages.device import Compute

log = logging.getLogger(__name__)


async def run_node(config: NodeConfig, compute: Compute | None = None) -> int:
    """Run a node until it is told to leave; the exit code.

    SIGTERM, SIGINT, SIGHUP and SIGQUIT all mean: leave cleanly (while joining: stop
    joining, close). A second stop signal while the leave runs skips the rest of it and
    closes (a checkpoint being written is finished first, whole: Python joins the thread
    writing it before the process exits); one
    while joining is cancelled or while closing changes nothing (both are short and
    bounded). `agora-node leave` and the node's own reasons to stop are not signals:
    the first signal after them still leaves cleanly."""
    node = Node(config, compute)
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    signals, phase = 0, "joining"  # joining -> serving -> leaving -> closing

    def on_stop() -> None:
        nonlocal signals
        signals += 1
        if signals >= 2 and phase == "leaving" and main is not None:
            log.warning("second stop signal: skipping the rest of the leave")
            main.cancel()
        elif signals >= 2:
            log.info("stop signal: already stopping (%s)", phase)
        node.stop_event.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        loop.add_signal_handler(sig, on_stop)
    loop.add_signal_handler(signal.SIGUSR1, node.admittance.reload)
    try:
        if not await _unless_stopped(node.start(), node.stop_event):
            log.info("stopped while joining")
            print("agora-node: stopped while joining", flush=True)
            return _failed(node) if node.failure is not None else 0
        phase = "serving"
        print(f"agora-node: serving stage {node.service.index} as {node.peer_id}", flush=True)
        print(
            f"agora-node: status page http://{config.status_host}:{node._status.port}/", flush=True
        )
        await node.stop_event.wait()
        if node.refused is not None:  # nothing to hand over: the swarm ignores this node
            raise JoinError(node.refused)
        phase = "leaving"
        if signals < 2:  # else both came before the leave could begin
            await node.leave()
            datadir.note_left(config.data_dir, node.checkpoint_error)  # for `agora-node leave`
            if node.failure is not None:
                return _failed(node)
            return _unsaved(node) if node.checkpoint_error is not None else 0
        return _forced()
    except asyncio.CancelledError:
        if phase != "leaving" or signals < 2:
            raise
        if main is not None:
            main.uncancel()
        return _forced()
    finally:
        phase = "closing"
        await node.close()


def _unsaved(node: Node) -> int:
    print(
        f"agora-node: left without a checkpoint ({node.checkpoint_error}): what it trained"
        f" since {node.last_checkpoint or 'it started'} is not on disk",
        flush=True,
    )
    return EXIT_FAILED


def _failed(node: Node) -> int:
    print(
        f"agora-node: stopped after a failure of the node: {node.failure!r} (see the log)",
        flush=True,
    )
    return EXIT_FAILED


EXIT_FAILED = 1
"""Exit code after a background loop of the node failed (it left cleanly, then stopped):
a supervisor that restarts on failure (deploy/agora-node.service) restarts it."""


def _forced() -> int:
    print("agora-node: stopped without finishing the leave (second signal)", flush=True)
    return EXIT_FORCED


EXIT_FORCED = 130
"""Exit code after a second stop signal cut the leave short (as a shell reports SIGINT)."""


async def _unless_stopped(work: Awaitable[Any], stop: asyncio.Event) -> bool:
    """Run `work` unless `stop` is set first, then cancel it; whether it completed (its
    errors propagate)."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return False
    task.result()  # raises what `work` raised
    return True
