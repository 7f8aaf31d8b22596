"""Background loops of a node or a stage service: started, watched and cancelled together."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


class Loops:
    """Tasks that must not die silently: a loop that raises calls `on_failure` (the owner
    then leaves cleanly) unless `quiet()` says the failure is part of stopping."""

    def __init__(
        self, on_failure: Callable[[BaseException], None], quiet: Callable[[], bool]
    ) -> None:
        self.on_failure, self.quiet = on_failure, quiet
        self.tasks: list[asyncio.Task] = []

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.create_task(coro)
        task.add_done_callback(self._done)
        self.tasks.append(task)
        return task

    def _done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and not self.quiet():
            self.on_failure(task.exception())

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()

    async def cancel_and_wait(self) -> None:
        self.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def to_completion(work: Coroutine[Any, Any, T]) -> T:
    """Run `work` to its end even when the caller is cancelled meanwhile: the cancel waits
    for it and is raised after (the work's result is then dropped, its error logged). For
    a few seconds of work that must not stop half way, such as an outer step and the
    weights it writes."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():
                raise  # the work's own (nothing else holds it)
            cancelled = True  # the caller's, even where the work ended in the same tick
        except Exception:
            if not cancelled:
                raise
    if cancelled:
        if task.exception() is not None:
            log.error(
                "work finished after its caller was cancelled failed", exc_info=task.exception()
            )
        raise asyncio.CancelledError
    return task.result()
