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
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from hivemind.p2p import P2P, PeerID

from agora_node.comms import linkemu
from agora_node.comms.guard import ADMISSION, Guard, Limits, Refused

log = logging.getLogger(__name__)

KIND_DATA, KIND_END, KIND_ERROR = b"D", b"E", b"X"
KIND_REFUSED = b"R"
"""Sent instead of reading the request: this peer does not take requests from the remote
(a private swarm's allow list); the payload says so in one line."""
KIND_SIGNED = b"S"
"""Before END of an answer that came through a relay (comms/relay.py): the answering
peer's signature over the request's nonce and every data frame."""
LEN_BYTES = 8
DEFAULT_MAX_FRAME = 64 << 20
CHUNK = 1 << 20
ONE_WRITE = 1 << 18
"""Frames up to this size go to the socket in one write, header and payload together."""
SLOWEST_SEND = Limits.min_bytes_per_s
"""Bytes per second below which a request is not taken (the slowest link a server reads
one at, guard.Limits): its write's deadline is the request's timeout plus its bytes at this."""
PEER_TEXT_CHARS = 300
"""What this node keeps of a peer's own words (an error or refusal frame, a reply's message)."""


class Route(Protocol):
    """Where requests to peers that cannot be dialed go (comms/relay.py's `Relaying`)."""

    def relays_of(self, peer_id: str) -> list[str]: ...

    def request_stream(
        self,
        p2p: P2P,
        peer_id: str,
        name: str,
        payload: bytes,
        timeout: float,
        max_response: int,
        max_total: int,
    ) -> AsyncIterator[bytes]: ...


_routes: weakref.WeakKeyDictionary[P2P, Route] = weakref.WeakKeyDictionary()


def set_route(p2p: P2P, route: Route) -> None:
    """Requests this node sends over `p2p` to peers `route` names a relay for go through it."""
    _routes[p2p] = route


def relayed(p2p: P2P, peer_id: str) -> bool:
    """Whether this node's requests to `peer_id` go through a relay (see `set_route`)."""
    route = _routes.get(p2p)
    return route is not None and bool(route.relays_of(peer_id))


class StreamError(ConnectionError):
    """The remote side failed, answered with an error, or broke the framing."""


class BadRequest(Exception):
    """A handler's answer to a request it cannot serve as asked (not JSON, a stage it does
    not serve): sent back as the error, logged in one line (a stranger's requests were
    each logged at ERROR with a traceback)."""


class RefusedError(StreamError):
    """The remote peer refused to serve us at all (we are not on its allow list)."""


class SilentPeerError(StreamError):
    """The stream was open but the remote peer sent nothing within the per-frame deadline,
    or did not take our request within its deadline (`send_request`)."""


def peer_text(data: bytes) -> str:
    """A peer's text as this node repeats it (in an error, so in a log): cut to
    PEER_TEXT_CHARS, and quoted as Python would (repr) unless every character is printable,
    so that a stranger's words neither run on nor carry control characters."""
    text = data[: 4 * PEER_TEXT_CHARS].decode(errors="replace")[:PEER_TEXT_CHARS]
    return text if text.isprintable() else repr(text)


async def send_request(
    writer: asyncio.StreamWriter, payload: bytes, timeout: float, who: str
) -> None:
    """Write one request frame to `who` within `timeout` plus its bytes at SLOWEST_SEND. A
    peer that accepts the stream and never reads held the write for good once the payload
    passed the buffers, and the micro-batch (the head's slot, the router's count) with it:
    it is a peer that said nothing (SilentPeerError)."""
    deadline = timeout + len(payload) / SLOWEST_SEND
    try:
        await asyncio.wait_for(write_frame(writer, KIND_DATA, payload), deadline)
    except TimeoutError as exc:
        raise SilentPeerError(
            f"{who} did not take a {len(payload)}-byte request in {deadline:.0f}s"
        ) from exc


async def write_frame(writer: asyncio.StreamWriter, kind: bytes, payload: bytes = b"") -> None:
    head = kind + len(payload).to_bytes(LEN_BYTES, "big")
    if len(payload) <= ONE_WRITE and not linkemu.shaping():
        writer.write(head + payload)  # one send, and one read for libp2p's daemon
    else:
        # shaped, the header leaves at once and the payload after the emulated link's
        # delay, as on a real link, so a reader's header deadline does not count a shaped
        # uplink's queue; an empty frame (END) follows its data without another latency
        writer.write(head)
        await linkemu.transmit(len(payload) + 1 + LEN_BYTES, propagate=bool(payload))
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
    kind, length = parse_head(await read_exactly(reader, 1 + LEN_BYTES, "stream closed"))
    if length > max_bytes:
        raise StreamError(f"frame of {length} bytes exceeds the limit of {max_bytes}")
    return kind, await read_exactly(reader, length, "stream closed mid-frame")


async def read_exactly(reader: asyncio.StreamReader, n: int, what: str) -> bytes:
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as exc:
        raise StreamError(f"{what} by the remote peer") from exc
    except StreamError:
        raise
    except ConnectionError as exc:  # reset rather than closed
        raise StreamError(f"{what} ({exc!r})") from exc


def parse_head(head: bytes) -> tuple[bytes, int]:
    kind, length = head[:1], int.from_bytes(head[1:], "big")
    if kind not in (KIND_DATA, KIND_END, KIND_ERROR, KIND_REFUSED, KIND_SIGNED):
        raise StreamError(f"bad frame kind {kind!r}")
    return kind, length


async def read_request(
    reader: asyncio.StreamReader, max_bytes: int, guard: Guard, remote: str
) -> bytes:
    """A server reads one request frame: its header within the read deadline, a length
    above `max_bytes` refused before the body is read, the body within the read
    deadline plus its bytes at the guard's slowest rate."""
    head = await guard.read(read_exactly(reader, 1 + LEN_BYTES, "stream closed"), 0, remote)
    _, length = parse_head(head)
    guard.check_size(length, max_bytes, remote)
    return await guard.read(read_exactly(reader, length, "stream closed mid-frame"), length, remote)


def close_quietly(writer: asyncio.StreamWriter) -> None:
    try:
        writer.close()
    except Exception:  # already broken: nothing to release
        log.debug("closing a broken stream", exc_info=True)


async def discard_until_closed(reader: asyncio.StreamReader, timeout: float = 5.0) -> None:
    """Read and drop what the remote sends until it closes: closing at once, with its
    request unread, lost the frame just written (observed with hivemind's p2pd)."""
    with contextlib.suppress(TimeoutError, ConnectionError):
        async with asyncio.timeout(timeout):
            while await reader.read(CHUNK):
                pass


# A handler gets (remote peer id, request bytes) and yields response frames.
Handler = Callable[[str, bytes], AsyncIterator[bytes]]
Refuse = Callable[[str], str | None]


@dataclass
class Served:
    """One protocol this node serves: its handler behind its guard (see `serve`)."""

    name: str
    handler: Handler
    guard: Guard
    max_request: int
    refuse: Refuse | None


class Signer(Protocol):
    """Signs an answer frame by frame (comms/relay.py): `update` with each data frame,
    then `finish` gives the signature frame's payload."""

    def update(self, chunk: bytes) -> None: ...

    def finish(self) -> bytes: ...


_served: weakref.WeakKeyDictionary[P2P, dict[str, Served]] = weakref.WeakKeyDictionary()


def served(p2p: P2P, name: str) -> Served | None:
    """What this node serves under protocol `name`, for requests that come through a relay."""
    return _served.get(p2p, {}).get(name)


async def answer(
    served: Served,
    remote: str,
    body: Callable[[], Awaitable[bytes]],
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    signer: Signer | None = None,
) -> None:
    """Serve one request of `remote` (the peer it is from, authenticated): refused before
    anything is read if `served.refuse` says so, else admitted by the guard; `body()`
    reads the request under the guard's deadlines. Every failure ends in one frame or a
    closed stream, never an exception. After END the stream stays open until the caller
    closes it (at most 5 s): p2pd cut answers short when this side closed first (through
    a relay 2 of 200 answers of 1 MiB, directly one in a few hundred)."""
    name, guard = served.name, served.guard
    try:
        refusal = served.refuse(remote) if served.refuse is not None else None
        if refusal is not None:
            await write_frame(writer, KIND_REFUSED, refusal.encode()[:1000])
            await discard_until_closed(reader)
            return
        async with guard.serving(remote):
            request = await body()
            chunks = served.handler(remote, request)
            try:
                async for chunk in chunks:
                    if signer is not None:
                        signer.update(chunk)
                    await guard.drain(write_frame(writer, KIND_DATA, chunk), len(chunk), remote)
            finally:  # closed here, not when collected: what a handler holds (a lent copy
                # of the state) is given back as soon as its stream ends, broken or not
                close = getattr(chunks, "aclose", None)
                if close is not None:
                    await close()
            if signer is not None:
                await guard.drain(write_frame(writer, KIND_SIGNED, signer.finish()), 0, remote)
            await guard.drain(write_frame(writer, KIND_END), 0, remote)
            await discard_until_closed(reader)
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
        if isinstance(exc, BadRequest):  # the asker's doing: one line, no traceback
            log.info("stream %s from %s: %s", name, remote[-8:], exc)
        else:
            log.exception("handler %s failed for %s", name, remote[-8:])
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                write_frame(writer, KIND_ERROR, f"{type(exc).__name__}: {exc}".encode()[:1000]),
                guard.limits.drain_deadline_s,
            )
    finally:
        close_quietly(writer)


async def serve(
    p2p: P2P,
    name: str,
    handler: Handler,
    *,
    max_request: int = DEFAULT_MAX_FRAME,
    guard: Guard | None = None,
    refuse: Refuse | None = None,
) -> None:
    """Register `handler` under protocol `name` on this node's libp2p daemon, behind
    `guard` (comms/guard.py): admission by the authenticated remote peer id, the read
    deadline, a drain deadline per write and an overall deadline. `refuse(remote peer
    id)`: a private swarm's one-line refusal, sent before the request is read, or None.
    Requests that come through a relay (comms/relay.py) reach the same handler."""
    entry = Served(name, handler, guard or Guard(name), max_request, refuse)

    async def on_stream(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        remote = info.peer_id.to_base58()  # authenticated by libp2p's secure channel
        await answer(
            entry,
            remote,
            lambda: read_request(reader, max_request, entry.guard, remote),
            reader,
            writer,
        )

    await p2p.add_binary_stream_handler(name, on_stream)
    with contextlib.suppress(TypeError):  # a test's stand-in for P2P may not be weak-referable
        _served.setdefault(p2p, {})[name] = entry


async def unserve(p2p: P2P, name: str) -> None:
    """Stop serving protocol `name` (what `serve` registered)."""
    _served.get(p2p, {}).pop(name, None)
    await p2p.remove_binary_stream_handler(name)


async def request_stream(
    p2p: P2P,
    peer_id: str,
    name: str,
    payload: bytes,
    *,
    timeout: float,
    max_response: int = DEFAULT_MAX_FRAME,
    max_total: int | None = None,
) -> AsyncIterator[bytes]:
    """Send one request, yield the response frames; each frame must arrive within `timeout`,
    be at most `max_response` bytes, and all of them together at most `max_total` (default:
    one frame's worth). A peer that cannot be dialed is asked through its relay
    (comms/relay.py), if known: the answer is held until its signature checks out, so
    `max_total` also bounds what a relay or the peer can make this node buffer."""
    max_total = max_response if max_total is None else max_total
    if relayed(p2p, peer_id):
        async for frame in _routes[p2p].request_stream(
            p2p, peer_id, name, payload, timeout, max_response, max_total
        ):
            yield frame
        return
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
        await send_request(writer, payload, timeout, peer_id[-8:])
        total = 0
        while True:
            try:
                kind, data = await asyncio.wait_for(read_frame(reader, max_response), timeout)
            except TimeoutError as exc:
                raise SilentPeerError(f"{peer_id[-8:]} sent nothing for {timeout:.0f}s") from exc
            if kind == KIND_END:
                return
            if kind == KIND_REFUSED:
                raise RefusedError(peer_text(data))
            if kind == KIND_ERROR:
                raise StreamError(f"{peer_id[-8:]} failed: {peer_text(data)}")
            if kind == KIND_SIGNED:  # only answers that came through a relay carry one
                raise StreamError(f"{peer_id[-8:]} sent a signature frame on a direct stream")
            total += len(data)
            if total > max_total:
                raise StreamError(f"{peer_id[-8:]} answered more than {max_total} bytes")
            yield data
    finally:
        close_quietly(writer)


async def request(
    p2p: P2P,
    peer_id: str,
    name: str,
    payload: bytes,
    *,
    timeout: float,
    max_response: int = DEFAULT_MAX_FRAME,
) -> bytes:
    """A unary call: exactly one response frame (a second one fails the call at once)."""
    frames = request_stream(p2p, peer_id, name, payload, timeout=timeout, max_response=max_response)
    answer: bytes | None = None
    try:
        async for frame in frames:
            if answer is not None:
                raise StreamError(f"{peer_id[-8:]} sent more than one response frame")
            answer = frame
    finally:
        await frames.aclose()
    if answer is None:
        raise StreamError(f"expected one response frame from {peer_id[-8:]}, got none")
    return answer
