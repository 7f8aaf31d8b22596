"""hivemind's control client's reader survives p2pd answering a call whose caller was
cancelled a moment before (comms/control_calls.py `CallsAnsweredAfterCancel`): before, the
InvalidStateError ended the reader, and every later call of the process waited forever."""

import asyncio
import gc
import logging
import uuid

import pytest
from hivemind.p2p.p2p_daemon_bindings.control import ControlClient, DaemonConnector
from hivemind.proto import p2pd_pb2 as p2pd_pb

from agora_node.comms.control_calls import CallsAnsweredAfterCancel, settle_cancelled_calls

pytestmark = pytest.mark.timeout(30)


def frame(msg) -> bytes:  # noqa: ANN001 - a protobuf message
    """A message as p2pd writes it: its length as an unsigned varint, then its bytes."""
    body, head = msg.SerializeToString(), bytearray()
    n = len(body)
    while True:
        byte, n = n & 0x7F, n >> 7
        head.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(head) + body


def ack(call_id: uuid.UUID) -> bytes:
    """p2pd's plain acknowledgement of a call (a handler's registration)."""
    return frame(p2pd_pb.PersistentConnectionResponse(callId=call_id.bytes))


def answer(call_id: uuid.UUID, data: bytes) -> bytes:
    response = p2pd_pb.CallUnaryResponse(response=data)
    return frame(
        p2pd_pb.PersistentConnectionResponse(callId=call_id.bytes, callUnaryResponse=response)
    )


async def read_answers(client: ControlClient, data: bytes) -> None:
    """Run the client's own reader over `data` from p2pd, to its end."""
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    await client._read_from_persistent_conn(reader)


async def cancelled_then_answered() -> tuple[ControlClient, asyncio.Future, asyncio.Future]:
    settle_cancelled_calls()
    client = await ControlClient.create(DaemonConnector(), use_persistent_conn=False)
    gone, live = uuid.uuid4(), uuid.uuid4()
    client._pending_calls[gone] = cancelled = asyncio.get_running_loop().create_future()
    client._pending_calls[live] = waiting = asyncio.get_running_loop().create_future()
    cancelled.cancel()  # its caller was cancelled; it removes the call a step later
    await read_answers(client, ack(gone) + answer(gone, b"late") + answer(live, b"on time"))
    return client, cancelled, waiting


def test_the_reader_reads_on_past_a_cancelled_calls_answers():
    client, cancelled, waiting = asyncio.run(cancelled_then_answered())
    assert isinstance(client._pending_calls, CallsAnsweredAfterCancel)
    assert cancelled.cancelled()
    assert waiting.result() == b"on time"  # the answer after them still arrived


def error(call_id: uuid.UUID, text: bytes) -> bytes:
    response = p2pd_pb.CallUnaryResponse(error=text)
    return frame(
        p2pd_pb.PersistentConnectionResponse(callId=call_id.bytes, callUnaryResponse=response)
    )


def test_an_error_for_a_cancelled_call_is_dropped_without_a_word(caplog):
    """Set on a throwaway future, the error was logged as never retrieved once collected."""

    async def errored() -> None:
        settle_cancelled_calls()
        client = await ControlClient.create(DaemonConnector(), use_persistent_conn=False)
        gone = uuid.uuid4()
        client._pending_calls[gone] = asyncio.get_running_loop().create_future()
        client._pending_calls[gone].cancel()
        await read_answers(client, error(gone, b"peer unreachable"))

    with caplog.at_level(logging.WARNING, logger="asyncio"):
        asyncio.run(errored())
        gc.collect()
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


def test_without_it_the_reader_ended_at_the_first_such_answer():
    """What the patch is for, shown on a client with hivemind's plain dict."""

    async def plain() -> None:
        client = await ControlClient.create(DaemonConnector(), use_persistent_conn=False)
        client._pending_calls = {}
        gone = uuid.uuid4()
        client._pending_calls[gone] = asyncio.get_running_loop().create_future()
        client._pending_calls[gone].cancel()
        await read_answers(client, ack(gone))

    with pytest.raises(asyncio.InvalidStateError):
        asyncio.run(plain())
