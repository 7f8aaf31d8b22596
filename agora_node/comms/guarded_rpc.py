"""Serving a hivemind servicer's `rpc_*` methods behind a Guard (comms/guard.py).

hivemind's own registration (`ServicerBase.add_p2p_handlers`) reads a streamed
request's messages with no size cap (an 8-byte length, then that many bytes),
waits for the request with no deadline, and runs any number of handlers at once.
`add_guarded_handlers` (and `GuardedServicer`, whose `add_p2p_handlers` calls it)
registers the same methods under the same names, speaking
the same wire format (so hivemind stubs call them unchanged), with:

- admission by the authenticated remote peer id (`Guard.serving`) before any
  message is read: concurrency per protocol and per peer, a per-peer rate;
- streamed RPCs: each request message within the read deadline and at most
  `max_message` bytes (refused on its length, before its body is read); each
  response message written within the drain deadline; the call cut at the overall
  deadline; the handler cancelled if the caller closes the stream (as hivemind does);
- unary RPCs: the libp2p daemon reads the whole request (capped at 4 MiB by its
  persistent connection) before we see it; admission and the overall deadline
  apply as above, a refusal is an error response to the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from hivemind.p2p import P2P, P2PContext, ServicerBase
from hivemind.proto.p2pd_pb2 import RPCError

from agora_node.comms.guard import ADMISSION, Guard, Refused

log = logging.getLogger(__name__)

_MARKER_BYTES, _LEN_BYTES = 1, P2P.HEADER_LEN


class _EndOfStream(Exception):
    pass


class GuardedServicer(ServicerBase):
    """A servicer whose `add_p2p_handlers` registers its RPCs behind `self.guard`, with
    streamed request messages capped at `max_message` bytes. Subclasses set both."""

    guard: Guard
    max_message: int = 4 << 20

    async def add_p2p_handlers(
        self, p2p: P2P, wrapper: object = None, *, namespace: str | None = None, **_: object
    ) -> None:
        if wrapper is not None:
            raise ValueError("a guarded servicer serves its own methods")
        await add_guarded_handlers(
            self, p2p, namespace=namespace, guard=self.guard, max_message=self.max_message
        )


async def add_guarded_handlers(
    servicer: ServicerBase, p2p: P2P, *, namespace: str | None, guard: Guard, max_message: int
) -> None:
    """Register every `rpc_*` of `servicer` on `p2p` (removed as usual, with
    `servicer.remove_p2p_handlers`)."""
    cls = type(servicer)
    cls._collect_rpc_handlers()
    for rpc in cls._rpc_handlers:
        name = cls._get_handle_name(namespace, rpc.method_name)
        method = getattr(servicer, rpc.method_name)
        if rpc.stream_input or rpc.stream_output:
            await p2p.add_binary_stream_handler(
                name, _stream_handler(p2p, name, method, rpc, guard, max_message)
            )
        else:
            await p2p.add_protobuf_handler(name, _unary_handler(method, guard), rpc.request_type)


def _unary_handler(method: Callable, guard: Guard) -> Callable:
    async def handle(request, context: P2PContext):  # noqa: ANN001, ANN202
        async with guard.serving(context.remote_id.to_base58()):
            return await method(request, context)

    return handle


def _stream_handler(  # noqa: ANN202 - p2pd's stream handler type
    p2p: P2P, name: str, method: Callable, rpc, guard: Guard, max_message: int
):  # noqa: ANN001
    async def read_message(reader: asyncio.StreamReader, remote: str):  # noqa: ANN202
        head = await guard.read(reader.readexactly(_MARKER_BYTES + _LEN_BYTES), 0, remote)
        marker, length = head[:1], int.from_bytes(head[1:], P2P.BYTEORDER)
        guard.check_size(length, max_message, remote)
        body = await guard.read(reader.readexactly(length), length, remote)
        if marker == P2P.ERROR_MARKER:  # hivemind's end of stream is an empty RPCError
            raise _EndOfStream
        if marker != P2P.MESSAGE_MARKER:
            raise ValueError("bad message marker")
        return rpc.request_type.FromString(body)

    async def requests(reader: asyncio.StreamReader, remote: str) -> AsyncIterator:
        while True:
            try:
                yield await read_message(reader, remote)
            except _EndOfStream:
                return

    async def respond(output, writer: asyncio.StreamWriter, remote: str) -> None:  # noqa: ANN001
        if not rpc.stream_output:
            output = _once(output)
        async for message in output:
            size = message.ByteSize()
            await guard.drain(P2P.send_protobuf(message, writer), size, remote)

    async def on_stream(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        remote = info.peer_id.to_base58()  # authenticated by libp2p's secure channel
        context = P2PContext(handle_name=name, local_id=p2p.peer_id, remote_id=info.peer_id)
        try:
            async with guard.serving(remote):
                if rpc.stream_input:
                    await respond(method(requests(reader, remote), context), writer, remote)
                else:
                    request = await read_message(reader, remote)
                    with contextlib.suppress(_EndOfStream):  # the caller's end of stream
                        await read_message(reader, remote)
                    work = respond(method(request, context), writer, remote)
                    await _unless_closed(work, reader)
        except Refused as exc:
            level = logging.DEBUG if exc.reason in ADMISSION else logging.INFO
            log.log(level, "%s from %s: %s", name, remote[-8:], exc)
            if exc.reason in ADMISSION:
                await _send_error(writer, str(exc))
        except (ConnectionError, asyncio.IncompleteReadError, _EndOfStream):
            log.debug("%s from %s: the stream broke", name, remote[-8:])
        except Exception as exc:
            log.warning("%s failed for %s: %r", name, remote[-8:], exc)
            await _send_error(writer, str(exc)[:1000])
        finally:
            writer.close()

    return on_stream


async def _once(value: Awaitable) -> AsyncIterator:
    yield await value


async def _unless_closed(work: Awaitable[None], reader: asyncio.StreamReader) -> None:
    """Run `work`; cancel it if the caller closes the stream first."""
    task = asyncio.ensure_future(work)
    closed = asyncio.ensure_future(reader.read(1))
    try:
        await asyncio.wait({task, closed}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise ConnectionError("the caller closed the stream")
        await task
    finally:
        for pending in (task, closed):
            pending.cancel()
        await asyncio.gather(task, closed, return_exceptions=True)


async def _send_error(writer: asyncio.StreamWriter, message: str) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(P2P.send_protobuf(RPCError(message=message), writer), 1.0)
