"""A node stopped while it registers its handlers printed hivemind's control reader's
InvalidStateError as "Task exception was never retrieved": that one case is quiet now,
every other unretrieved task exception is still reported."""

import asyncio
import gc
import logging

import pytest

from agora_node.comms.host import quiet_hivemind_ack_race

pytestmark = pytest.mark.timeout(30)


async def _read_from_persistent_conn() -> None:  # the name of hivemind's reader coroutine
    raise asyncio.InvalidStateError("invalid state")


async def _something_else() -> None:
    raise asyncio.InvalidStateError("invalid state")


def unretrieved(coro_fn, caplog) -> list[str]:  # noqa: ANN001
    """Run a task that fails and whose exception nobody retrieves; the asyncio errors."""
    with asyncio.Runner() as runner:
        runner.get_loop().set_exception_handler(quiet_hivemind_ack_race)

        async def main() -> None:
            task = asyncio.create_task(coro_fn())
            await asyncio.wait([task])
            del task

        with caplog.at_level(logging.DEBUG):
            runner.run(main())
            gc.collect()
    return [r.getMessage() for r in caplog.records if r.name == "asyncio"]


def test_hivemind_readers_answer_to_a_cancelled_call_is_quiet(caplog):
    assert unretrieved(_read_from_persistent_conn, caplog) == []
    assert "cancelled call's answer" in caplog.text


def test_any_other_unretrieved_task_exception_is_still_reported(caplog):
    errors = unretrieved(_something_else, caplog)
    assert any("never retrieved" in e for e in errors)
