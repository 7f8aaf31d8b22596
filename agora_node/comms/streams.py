"""Request/response over raw libp2p streams, with bounded frames and deadlines.

hivemind's protobuf RPC costs a protobuf copy per message and caps unary
messages at 4 MiB; raw stream handlers are ~2x faster here (HIVEMIND_NOTES.md).
A frame is a 1-byte kind, an 8-byte length and the payload. A reader refuses a
length above its limit before reading the body, so a hostile peer cannot make
us buffer gigabytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from hivemind.p2p import P2P, PeerID

from agora_node.comms import linkemu
from agora_node.comms.guard import ADMISSION, Guard, Refused

log = logging.getLogger(__name__)

KIND_DATA, KIND_END, KIND_ERROR = b"D", b"E", b"X"
KIND_REFUSED = b"R"
"""Sent instead of reading the request: this peer does not take requests from the remote
(a private swarm's allow list); the payload says so in one line."""
_LEN_BYTES = 8
DEFAULT_MAX_FRAME = 64 << 20
CHUNK = 1 << 20


class StreamError(ConnectionError):
    """The remote side failed, answered with an error, or broke the framing."""


class RefusedError(StreamError):
    """The remote peer refused to serve us at all (we are not on its allow list)."""


class SilentPeerError(StreamError):
    """The stream was open but the remote peer sent nothing within the per-frame deadline."""


async def write_frame(writer: asyncio.StreamWriter, kind: bytes, payload: bytes = b"") -> None:
    # the header leaves at once and the payload after the emulated link's delay, as on a
    # real link, so a reader's header deadline does not count a shaped uplink's queue;
    # an empty frame (END) follows its message's data without another latency
    writer.write(kind + len(payload).to_bytes(_LEN_BYTES, "big"))
    await linkemu.transmit(len(payload) + 1 + _LEN_BYTES, propagate=bool(payload))
    view = memoryview(payload)
    for offset in range(0, len(view), CHUNK):
        writer.write(view[offset : offset + CHUNK])
    try:
        await writer.drain()
    except StreamError:
        raise
    except ConnectionError as exc:  # the peer went away: what every caller already handles
        raise StreamError(f"stream lost while sending: {exc!r}") from exc


async def read_frame(
    reader: asyncio.StreamReader, max_bytes: int = DEFAULT_MAX_FRAME
) -> tuple[bytes, bytes]:
    kind, length = _parse_head(await _read_exactly(reader, 1 + _LEN_BYTES, "stream closed"))
    if length > max_bytes:
        raise StreamError(f"frame of {length} bytes exceeds the limit of {max_bytes}")
    return kind, await _read_exactly(reader, length, "stream closed mid-frame")


async def _read_exactly(reader: asyncio.StreamReader, n: int, what: str) -> bytes:
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as exc:
        raise StreamError(f"{what} by the remote peer") from exc
    except StreamError:
        raise
    except ConnectionError as exc:  # reset rather than closed
        raise StreamError(f"{what} ({exc!r})") from exc


def _parse_head(head: bytes) -> tuple[bytes, int]:
    kind, length = head[:1], int.from_bytes(head[1:], "big")
    if kind not in (KIND_DATA, KIND_END, KIND_ERROR, KIND_REFUSED):
        raise StreamError(f"bad frame kind {kind!r}")
    return kind, length


async def read_request(
    reader: asyncio.StreamReader, max_bytes: int, guard: Guard, remote: str
) -> bytes:
    """A server reads one request frame: its header within the read deadline, a length
    above `max_bytes` refused before the body is read, the body within the read
    deadline plus its bytes at the guard's slowest rate."""
    head = await guard.read(_read_exactly(reader, 1 + _LEN_BYTES, "stream closed"), 0, remote)
    _, length = _parse_head(head)
    guard.check_size(length, max_bytes, remote)
    return await guard.read(
        _read_exactly(reader, length, "stream closed mid-frame"), length, remote
    )


def _close(writer: asyncio.StreamWriter) -> None:
    try:
        writer.close()
    except Exception:  # already broken: nothing to release
        log.debug("closing a broken stream", exc_info=True)


async def _discard_until_closed(reader: asyncio.StreamReader, timeout: float = 5.0) -> None:
    """Read and drop what the remote sends until it closes: closing at once, with its
    request unread, lost the frame just written (observed with hivemind's p2pd)."""
    with contextlib.suppress(TimeoutError, ConnectionError):
        async with asyncio.timeout(timeout):
            while await reader.read(CHUNK):
                pass


# A handler gets (remote peer id, request bytes) and yields response frames.
Handler = Callable[[str, bytes], AsyncIterator[bytes]]


async def serve(
    p2p: P2P,
    name: str,
    handler: Handler,
    *,
    max_request: int = DEFAULT_MAX_FRAME,
    guard: Guard | None = None,
    refuse: Callable[[str], str | None] | None = None,
) -> None:
    """Register `handler` under protocol `name` on this node's libp2p daemon, behind
    `guard` (comms/guard.py): admission by the authenticated remote peer id, the read
    deadline, a drain deadline per write and an overall deadline. `refuse(remote peer
    id)`: a private swarm's one-line refusal, sent before the request is read, or None."""
    guard = guard or Guard(name)

    async def on_stream(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        remote = info.peer_id.to_base58()  # authenticated by libp2p's secure channel
        try:
            refusal = refuse(remote) if refuse is not None else None
            if refusal is not None:
                await write_frame(writer, KIND_REFUSED, refusal.encode()[:1000])
                await _discard_until_closed(reader)
                return
            async with guard.serving(remote):
                request = await read_request(reader, max_request, guard, remote)
                async for chunk in handler(remote, request):
                    await guard.drain(write_frame(writer, KIND_DATA, chunk), len(chunk), remote)
                await guard.drain(write_frame(writer, KIND_END), 0, remote)
        except Refused as exc:
            # admission refusals can come by the thousand (counted, not logged one by one)
            level = logging.DEBUG if exc.reason in ADMISSION else logging.INFO
            log.log(level, "stream %s from %s: %s", name, remote[-8:], exc)
            if exc.reason in ADMISSION:  # nothing was read: say why, briefly
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(write_frame(writer, KIND_ERROR, str(exc).encode()), 1.0)
        except StreamError as exc:
            log.debug("stream %s from %s: %s", name, remote[-8:], exc)
        except (ConnectionError, asyncio.IncompleteReadError):
            log.debug("stream %s from %s broke", name, remote[-8:])
        except Exception as exc:
            log.exception("handler %s failed for %s", name, remote[-8:])
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    write_frame(writer, KIND_ERROR, f"{type(exc).__name__}: {exc}".encode()[:1000]),
                    guard.limits.drain_deadline_s,
                )
        finally:
            _close(writer)

    await p2p.add_binary_stream_handler(name, on_stream)


async def request_stream(
    p2p: P2P,
    peer_id: str,
    name: str,
    payload: bytes,
    *,
    timeout: float,
    max_response: int = DEFAULT_MAX_FRAME,
) -> AsyncIterator[bytes]:
    """Send one request, yield the response frames; each frame must arrive within `timeout`."""
    try:
        _, reader, writer = await asyncio.wait_for(
            p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), name), timeout
        )
    except TimeoutError as exc:
        raise StreamError(
            f"could not open a stream to {peer_id[-8:]} within {timeout:.0f}s"
        ) from exc
    except Exception as exc:  # p2pd reports dial failures as generic errors
        raise StreamError(f"could not reach {peer_id[-8:]}: {exc}") from exc
    try:
        await write_frame(writer, KIND_DATA, payload)
        while True:
            try:
                kind, data = await asyncio.wait_for(read_frame(reader, max_response), timeout)
            except TimeoutError as exc:
                raise SilentPeerError(f"{peer_id[-8:]} sent nothing for {timeout:.0f}s") from exc
            if kind == KIND_END:
                return
            if kind == KIND_REFUSED:
                raise RefusedError(data.decode(errors="replace"))
            if kind == KIND_ERROR:
                raise StreamError(f"{peer_id[-8:]} failed: {data.decode(errors='replace')}")
            yield data
    finally:
        _close(writer)


async def request(
    p2p: P2P,
    peer_id: str,
    name: str,
    payload: bytes,
    *,
    timeout: float,
    max_response: int = DEFAULT_MAX_FRAME,
) -> bytes:
    """A unary call: exactly one response frame."""
    frames = [
        f
        async for f in request_stream(
            p2p, peer_id, name, payload, timeout=timeout, max_response=max_response
        )
    ]
    if len(frames) != 1:
        raise StreamError(f"expected one response frame from {peer_id[-8:]}, got {len(frames)}")
    return frames[0]
