"""Requests to nodes nobody can dial, passed on by a relay of our own.

A node behind NAT reserves a slot on a public peer through libp2p's AutoRelay
(comms/host.py) and announces the circuit address. The bundled p2pd resets a circuit
once it has carried 128 KiB each way, which is enough for membership and dial-back
but not for micro-batches. So the requests of comms/streams.py's protocols
(micro-batches, cell work, state transfer, admission) go another way: the caller sends
the request to the relay over a direct connection, and the relay passes it on over
the direct connection the NATed node keeps to it (the one its reservation holds open),
and passes the answer back. Nothing of it is a circuit.

The relay is a stranger, so it is trusted with nothing:
- The caller signs its request (target, protocol, time, nonce and the SHA-256 of the
  body) with its identity key. The target checks that signature against the caller's
  peer id, the time window and the nonce before anything else, then serves the request
  as the caller's: admission, the allow list and any blame count the caller, never the
  relay.
- The target signs its answer (the nonce and the SHA-256 of every data frame); the
  caller checks that before it takes any frame.
- So a relay can delay or drop, like a link; it cannot forge, alter, replay or pin a
  request on someone else.

What a relay gives, bounded: it passes requests only to peers that hold a direct
connection to it and only for protocols of its own run; it copies in chunks, never
holding a request; a guard per caller (streams at once, rate, deadlines) and a byte cap
per answer bound the rest. An operator turns it off with `--relay-for-others off`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import replace

from hivemind.p2p import P2P, PeerID

from agora_node.comms import streams
from agora_node.comms.guard import Guard, Limits, Refused
from agora_node.comms.host import is_relayed, split_connections
from agora_node.comms.relay_wire import (
    HEADER_LEN_BYTES,
    WINDOW_S,
    AnswerSigner,
    Header,
    Nonces,
    RelayError,
    copy_answer,
    copy_bytes,
    read_header,
    read_signed,
    request_message,
)
from agora_node.protocol.identity import Identity, verify
from agora_node.protocol.names import protocol_prefix, relay_protocol, relayed_protocol

log = logging.getLogger(__name__)

MAX_REQUEST = streams.DEFAULT_MAX_FRAME
MAX_READING_BYTES = 512 << 20
"""Bytes of relayed request bodies read at once, before their origin's signature is
checked: anyone may open the relayed protocol and call itself a relay (256 streams of
up to MAX_REQUEST each were 16 GiB)."""
MAX_READING_PER_RELAY = 2 * MAX_REQUEST
"""...and through one relay (so a few slow streams of one key cannot hold them all)."""
MAX_ANSWER = 4 << 30
"""Bytes of answer one relayed request may carry back through a relay (a stage's state
included); they pass in chunks, never held."""
CONNECTED_TTL_S = 2.0
MAX_RELAYS_PER_PEER = 2

RELAY_LIMITS = Limits(
    # a caller may hold as many requests open through one relay as it has to the peers
    # behind it: the collective's long-polling fetches and queries (up to 32 per peer,
    # collective/p2p.py), micro-batches in flight, cell work
    max_streams=256,
    max_streams_per_peer=64,
    rate_per_s=200.0,
    burst=400.0,
    read_deadline_s=120.0,  # the answer may take a whole hop: forward, then backward
    drain_deadline_s=30.0,
    deadline_s=600.0,
)
"""A relay's guard, per caller."""
RELAYED_LIMITS = Limits(
    max_streams=256,
    max_streams_per_peer=128,
    rate_per_s=1000.0,
    burst=2000.0,
    read_deadline_s=30.0,
    drain_deadline_s=30.0,
    deadline_s=120.0,  # reading and checking one request; serving it is the protocol's
)
"""The target's guard per relay, while it reads and checks a request (one relay passes on
the requests of many callers; each is then held to its protocol's guard per caller)."""


def relays_in(addrs: Iterable[str]) -> list[str]:
    """The relays a node announces: the peer before `/p2p-circuit` in its circuit addresses."""
    found: list[str] = []
    for addr in addrs:
        if is_relayed(addr):
            relay = addr.split("/p2p-circuit")[0].rpartition("/p2p/")[2]
            if relay and relay not in found:
                found.append(relay)
    return found[:MAX_RELAYS_PER_PEER]


class Relaying:
    """One node's relaying: the routes its requests take, the relay it offers others and
    the requests it serves that came through a relay, with their counts."""

    def __init__(
        self,
        identity: Identity,
        run_id: str,
        *,
        offer: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.identity, self.run_id, self.offer = identity, run_id, offer
        self.me = identity.peer_id
        self._clock = clock
        self.routes: dict[str, list[str]] = {}
        """Peer -> the relays requests to it go through (`update_routes`)."""
        self.nonces = Nonces()
        self.sent_via: Counter[str] = Counter()
        """Bytes of requests and answers this node sent or got through each relay."""
        self.forwarded = Counter({"requests": 0, "bytes": 0})
        """What this node passed on for others as a relay."""
        self.served = 0
        """Requests this node served that came through a relay."""
        self.refused: Counter[str] = Counter()
        self._reading_from: dict[str, int] = {}
        """Bytes of relayed request bodies being read now (before their signature check),
        by the relay they come through (only while reading)."""
        self._connected: tuple[float, set[str]] = (-1.0, set())

    # ---- the caller's side ------------------------------------------------------------------
    def relays_of(self, peer_id: str) -> list[str]:
        return self.routes.get(peer_id, [])

    def update_routes(self, addrs_of: Mapping[str, Iterable[str]], direct: set[str]) -> None:
        """`addrs_of`: what each known peer announces (its signed record); `direct`: peers
        with a direct connection to this node. A peer that announces circuit addresses
        cannot be dialed: requests to it go through its relays, unless it holds a direct
        connection to this node (then its streams ride that)."""
        routes = {}
        for peer, addrs in addrs_of.items():
            relays = [r for r in relays_in(addrs) if r not in (peer, self.me)]
            if relays and peer not in direct and peer != self.me:
                routes[peer] = relays
        if routes.keys() != self.routes.keys():
            log.info(
                "relay: requests to %s go through their relays",
                ", ".join(p[-8:] for p in sorted(routes)) or "no peer",
            )
        self.routes = routes

    async def request_stream(
        self,
        p2p: P2P,
        peer_id: str,
        name: str,
        payload: bytes,
        timeout: float,
        max_response: int,
        max_total: int,
    ) -> AsyncIterator[bytes]:
        """comms/streams.request_stream through one of `peer_id`'s relays: the request
        signed, the answer's signature checked before any frame is yielded."""
        relay, reader, writer = await self._open(p2p, peer_id, timeout)
        try:
            nonce, t_ms = os.urandom(16).hex(), int(self._clock() * 1000)
            digest = hashlib.sha256(payload).digest()
            sig = self.identity.sign(request_message(peer_id, name, t_ms, nonce, digest)).hex()
            header = Header(peer_id, name, t_ms, nonce, sig).encode()
            await streams.send_request(
                writer,
                len(header).to_bytes(HEADER_LEN_BYTES, "big") + header + payload,
                timeout,
                f"{peer_id[-8:]} (through relay {relay[-8:]})",
            )
            frames = await read_signed(
                reader, peer_id, relay, nonce, timeout, (max_response, max_total)
            )
            self.sent_via[relay] += len(payload) + sum(len(f) for f in frames)
        finally:
            streams.close_quietly(writer)
        for frame in frames:
            yield frame

    async def _open(self, p2p: P2P, peer_id: str, timeout: float):  # noqa: ANN202
        failures = []
        for relay in self.relays_of(peer_id):
            try:
                _, reader, writer = await asyncio.wait_for(
                    p2p.call_binary_stream_handler(
                        PeerID.from_base58(relay), relay_protocol(self.run_id)
                    ),
                    timeout,
                )
                return relay, reader, writer
            except Exception as exc:  # p2pd reports dial failures as generic errors
                failures.append(f"{relay[-8:]}: {exc or type(exc).__name__}")
        raise streams.StreamError(
            f"could not reach {peer_id[-8:]} through its relay(s) ({'; '.join(failures)})"
        )

    # ---- the relay's side --------------------------------------------------------------------
    async def relay(
        self, p2p: P2P, guard: Guard, caller: str, reader: asyncio.StreamReader, writer
    ) -> None:
        """Pass one request of `caller` on to its target and the answer back, in chunks."""
        head = await guard.read(streams.read_exactly(reader, 1 + streams.LEN_BYTES, "closed"))
        kind, length = streams.parse_head(head)
        guard.check_size(length, MAX_REQUEST, caller)
        header, size = await read_header(reader, length, guard, caller)
        if header.origin or not header.proto.startswith(protocol_prefix(self.run_id)):
            raise RelayError("protocol", f"not a protocol this relay passes on: {header.proto}")
        if header.proto in (relay_protocol(self.run_id), relayed_protocol(self.run_id)):
            raise RelayError("protocol", "a relayed request cannot be relayed again")
        if kind != streams.KIND_DATA or header.to in (caller, self.me):
            raise RelayError("target", "a relayed request for its caller or its relay")
        if header.to not in await self._direct_peers(p2p):
            raise RelayError("target", f"{header.to[-8:]} holds no direct connection to this relay")
        out = replace(header, origin=caller).encode()
        body = length - HEADER_LEN_BYTES - size
        try:
            _, answer, target = await asyncio.wait_for(
                p2p.call_binary_stream_handler(
                    PeerID.from_base58(header.to), relayed_protocol(self.run_id)
                ),
                guard.limits.read_deadline_s,
            )
        except Exception as exc:  # p2pd reports a failed stream as a generic error
            raise RelayError("target", f"no stream to {header.to[-8:]}: {exc!r}"[:300]) from None
        try:
            target.write(
                streams.KIND_DATA
                + (HEADER_LEN_BYTES + len(out) + body).to_bytes(streams.LEN_BYTES, "big")
                + len(out).to_bytes(HEADER_LEN_BYTES, "big")
                + out
            )
            moved = await copy_bytes(
                reader, target, guard, caller, body, "the caller closed the stream mid-request"
            )
            moved += await copy_answer(answer, writer, guard, caller, MAX_ANSWER)
        finally:
            streams.close_quietly(target)  # the target waits for this before it closes
        self.forwarded.update(requests=1, bytes=moved)
        # and so does this relay for its caller: a side that closes first can lose what
        # it wrote last in p2pd
        await streams.discard_until_closed(reader)

    async def _direct_peers(self, p2p: P2P) -> set[str]:
        at, peers = self._connected
        now = time.monotonic()
        if now - at > CONNECTED_TTL_S:
            peers = split_connections(await p2p.list_peers())[1]
            self._connected = (now, peers)
        return peers

    # ---- the target's side -------------------------------------------------------------------
    async def take(
        self, p2p: P2P, guard: Guard, relay: str, reader: asyncio.StreamReader
    ) -> tuple[streams.Served, Header, bytes]:
        """Read and check one request that came through `relay`: what to serve, for whom."""
        head = await guard.read(streams.read_exactly(reader, 1 + streams.LEN_BYTES, "closed"))
        kind, length = streams.parse_head(head)
        header, size = await read_header(reader, length, guard, relay)
        served = streams.served(p2p, header.proto)  # never the relay's own protocols
        if kind != streams.KIND_DATA or header.to != self.me or not header.origin:
            raise RelayError("target", "a relayed request for another peer, or from nobody")
        if served is None:
            raise RelayError("protocol", f"this node does not serve {header.proto}")
        size = length - HEADER_LEN_BYTES - size
        # an honest relay passes on at most MAX_REQUEST; anyone may claim to be a relay
        guard.check_size(size, min(served.max_request, MAX_REQUEST), relay)
        refusal = served.refuse(header.origin) if served.refuse is not None else None
        if refusal is not None:  # before the body is read (as on a direct stream)
            raise _OriginRefused(refusal)
        mine, reading = self._reading_from.get(relay, 0), sum(self._reading_from.values())
        if reading + size > MAX_READING_BYTES or mine + size > MAX_READING_PER_RELAY:
            raise RelayError("busy", "too many relayed bytes waiting for their signature check")
        self._reading_from[relay] = mine + size
        try:
            body = await guard.read(streams.read_exactly(reader, size, "closed mid-request"), size)
        finally:
            left = self._reading_from.pop(relay) - size
            if left:
                self._reading_from[relay] = left
        digest = hashlib.sha256(body).digest()
        message = request_message(header.to, header.proto, header.t_ms, header.nonce, digest)
        if not verify(header.origin, message, bytes.fromhex(header.sig)):
            raise RelayError("signature", f"not signed by {header.origin[-8:]}")
        now = self._clock()
        if abs(now - header.t_ms / 1000) > WINDOW_S:
            raise RelayError("time", "a relayed request outside the time window (clock or replay)")
        if not self.nonces.fresh(header.nonce, now, header.t_ms / 1000, header.origin):
            raise RelayError("replay", "a relayed request seen before")
        return served, header, body

    # ---- serving both sides ------------------------------------------------------------------
    async def serve(
        self,
        p2p: P2P,
        refuse: streams.Refuse | None,
        on_refuse: Callable[[str, str], None] | None = None,
    ) -> None:
        """Register the target's side, and the relay's when this node offers it."""
        relayed_guard = Guard("relayed", RELAYED_LIMITS, on_refuse=on_refuse)

        async def on_relayed(info, reader, writer) -> None:  # noqa: ANN001
            relay = info.peer_id.to_base58()

            async def work() -> None:
                async with relayed_guard.serving(relay):
                    served, header, body = await self.take(p2p, relayed_guard, relay, reader)
                self.served += 1
                signer = AnswerSigner(self.identity, header.nonce)
                await streams.answer(served, header.origin, _const(body), reader, writer, signer)

            await self._stream(relay, writer, refuse, work)

        await p2p.add_binary_stream_handler(relayed_protocol(self.run_id), on_relayed)
        if not self.offer:
            return
        relay_guard = Guard("relay", RELAY_LIMITS, on_refuse=on_refuse)

        async def on_relay(info, reader, writer) -> None:  # noqa: ANN001
            caller = info.peer_id.to_base58()

            async def work() -> None:
                async with relay_guard.serving(caller):
                    await self.relay(p2p, relay_guard, caller, reader, writer)

            await self._stream(caller, writer, refuse, work)

        await p2p.add_binary_stream_handler(relay_protocol(self.run_id), on_relay)

    async def _stream(
        self,
        remote: str,
        writer,  # noqa: ANN001
        refuse: streams.Refuse | None,
        work: Callable[[], Awaitable[None]],
    ) -> None:
        """One relay or relayed stream: a refused peer is told in one frame; a bad request
        is counted by code and answered with one error frame; the stream always closes."""
        try:
            refusal = refuse(remote) if refuse is not None else None
            if refusal is not None:
                await streams.write_frame(writer, streams.KIND_REFUSED, refusal.encode()[:1000])
                return
            await work()
        except _OriginRefused as exc:  # the protocol's own refusal of the request's origin
            self.refused["origin"] += 1
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    streams.write_frame(writer, streams.KIND_REFUSED, str(exc).encode()[:1000]),
                    5.0,
                )
        except RelayError as exc:  # counted; a stranger may send a thousand a second
            self.refused[exc.code] += 1
            log.debug("relay: refused a request from %s: %s", remote[-8:], exc)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    streams.write_frame(writer, streams.KIND_ERROR, str(exc).encode()[:1000]), 5.0
                )
        except Refused as exc:  # by a guard: counted by reason, told in one frame
            self.refused[exc.reason.value] += 1
            log.debug("relay stream with %s: %s", remote[-8:], exc)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    streams.write_frame(writer, streams.KIND_ERROR, str(exc).encode()[:1000]), 5.0
                )
        except (streams.StreamError, ConnectionError, TimeoutError) as exc:
            log.debug("relay stream with %s: %r", remote[-8:], exc)
        except Exception:
            log.exception("relay stream with %s failed", remote[-8:])
        finally:
            streams.close_quietly(writer)

    def status(self) -> dict:
        return {
            "offered": self.offer,
            "routes": {p[-8:]: [r[-8:] for r in rs] for p, rs in sorted(self.routes.items())},
            "bytes_via": {r[-8:]: n for r, n in sorted(self.sent_via.items())},
            "forwarded_requests": self.forwarded["requests"],
            "forwarded_bytes": self.forwarded["bytes"],
            "served_relayed": self.served,
            "refused": dict(self.refused),
        }


class _OriginRefused(Exception):
    """The relayed request's protocol refuses its origin (as `streams.Served.refuse`)."""


def _const(body: bytes) -> Callable[[], Awaitable[bytes]]:
    async def read() -> bytes:
        return body

    return read
