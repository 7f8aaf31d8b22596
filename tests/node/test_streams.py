"""Raw-stream request/response: how a failed call is classified (by type, never by text)."""

import asyncio

import pytest

from agora_node.comms import streams
from agora_node.protocol.identity import Identity
from tests.node.stream_fakes import FakeP2P, frame

pytestmark = pytest.mark.timeout(30)


async def _call(reader: asyncio.StreamReader) -> bytes:
    peer = Identity.generate().peer_id
    return await streams.request(FakeP2P(reader), peer, "/test/1", b"ping", timeout=0.05)


async def test_a_peer_that_sends_nothing_is_silent() -> None:
    with pytest.raises(streams.SilentPeerError, match="sent nothing"):
        await _call(asyncio.StreamReader())


@pytest.mark.parametrize(
    "sent",
    [
        # the remote failed, even if its message happens to read like a timeout
        frame(streams.KIND_ERROR, b"RuntimeError: upstream sent nothing for 5s"),
        b"",  # closed without a frame
        frame(b"?"),  # broken framing
    ],
    ids=["error-frame", "closed", "bad-kind"],
)
async def test_other_failures_are_not_silence(sent: bytes) -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(sent)
    reader.feed_eof()
    with pytest.raises(streams.StreamError) as info:
        await _call(reader)
    assert not isinstance(info.value, streams.SilentPeerError)


async def test_one_response_frame_is_returned() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(frame(streams.KIND_DATA, b"pong") + frame(streams.KIND_END))
    assert await _call(reader) == b"pong"


async def test_a_second_response_frame_fails_a_unary_call_at_once() -> None:
    """A peer that answers with endless frames is cut at the second, not buffered until it
    stops (the reader here holds three frames and never ends)."""
    reader = asyncio.StreamReader()
    reader.feed_data(b"".join(frame(streams.KIND_DATA, b"x" * 2048) for _ in range(3)))
    with pytest.raises(streams.StreamError, match="more than one response frame"):
        await _call(reader)


async def test_a_streamed_answer_is_bounded_in_total() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(b"".join(frame(streams.KIND_DATA, b"x" * 100) for _ in range(5)))
    peer = Identity.generate().peer_id
    frames = streams.request_stream(
        FakeP2P(reader), peer, "/test/1", b"ping", timeout=0.05, max_total=250
    )
    got = []
    with pytest.raises(streams.StreamError, match="more than 250 bytes"):
        async for answer in frames:
            got.append(answer)
    assert len(got) == 2


class _ResetWriter:
    """A writer whose peer reset the connection (what drain raises then)."""

    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        raise ConnectionResetError("Connection lost")


class _ResetReader:
    async def readexactly(self, n: int) -> bytes:
        raise ConnectionResetError("Connection reset by peer")


async def test_a_reset_connection_is_a_stream_error_both_ways() -> None:
    """Callers catch StreamError for a peer that went away; a reset must be one too (a
    dial-back request to a peer SIGKILLed mid-write once ended a daemon's background task)."""
    with pytest.raises(streams.StreamError, match="lost while sending"):
        await streams.write_frame(_ResetWriter(), streams.KIND_DATA, b"x")
    with pytest.raises(streams.StreamError, match="stream closed"):
        await streams.read_frame(_ResetReader())
