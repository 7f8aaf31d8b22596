"""to_completion (node/loops.py): work that a cancel of its caller must not stop half way."""

import asyncio
import logging

import pytest

from agora_node.node.loops import to_completion

pytestmark = pytest.mark.timeout(30)


async def test_a_cancelled_caller_waits_for_the_work_and_is_cancelled_after():
    started, release, finished = asyncio.Event(), asyncio.Event(), []

    async def work() -> int:
        started.set()
        await release.wait()
        finished.append(True)
        return 7

    caller = asyncio.create_task(to_completion(work()))
    await started.wait()
    caller.cancel()
    await asyncio.sleep(0)  # the cancel reaches the caller while the work still waits
    caller.cancel()  # a second cancel does not stop it either
    await asyncio.sleep(0)  # one turn of the loop (no time passes): that cancel is delivered
    assert not caller.done() and not finished
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert finished == [True]


async def test_the_works_result_and_errors_reach_an_uncancelled_caller():
    async def fine() -> int:
        return 3

    async def broken() -> int:
        raise ValueError("no")

    assert await to_completion(fine()) == 3
    with pytest.raises(ValueError, match="no"):
        await to_completion(broken())


async def test_an_error_after_the_callers_cancel_is_logged_and_the_cancel_raised(caplog):
    started, release = asyncio.Event(), asyncio.Event()

    async def breaks() -> int:
        started.set()
        await release.wait()
        raise ValueError("failed late")

    caller = asyncio.create_task(to_completion(breaks()))
    await started.wait()
    caller.cancel()
    await asyncio.sleep(0)  # one turn of the loop: the cancel is delivered before the error
    release.set()
    with (
        caplog.at_level(logging.ERROR, logger="agora_node.node.loops"),
        pytest.raises(asyncio.CancelledError),
    ):
        await caller
    assert any("failed late" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)


async def test_a_cancel_in_the_tick_the_work_ends_is_still_raised():
    """The work has returned, the caller has not resumed yet: its cancel is not lost."""
    ended = []

    async def quick() -> int:
        ended.append(True)
        return 5

    caller = asyncio.create_task(to_completion(quick()))
    while not ended:  # bounded by the test's timeout; each turn lets one step run
        await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
