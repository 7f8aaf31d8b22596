"""In-process transport: members of a collective as objects in one event loop.

Used by unit tests (deterministic failure injection without processes) and by the
one-process DiLoCo simulation in bench/diloco.py. Payloads are copied to bytes so a
handler can never alias the sender's buffers, as over a real wire.
"""

from __future__ import annotations

from agora_node.comms.collective.handlers import Responder
from agora_node.comms.collective.proofs import Signing, Verify
from agora_node.comms.collective.state import RoundBook
from agora_node.comms.collective.wire import Header, Reply


class LocalNetwork:
    """Routes requests between in-process members; `down` peers refuse every call."""

    def __init__(self, *, verify: Verify | None = None) -> None:
        self.verify = verify
        """How members check parts' signatures (proofs.py); None: parts go unsigned."""
        self.responders: dict[str, Responder] = {}
        self.down: set[str] = set()
        self.bytes_moved = 0

    def join(self, peer: str, signing: Signing | None = None) -> RoundBook:
        """Add `peer`; `signing` signs its inventory receipts as a witness (proofs.py)."""
        book = RoundBook(peer)
        sign = signing.sign if signing is not None else None
        self.responders[peer] = Responder(book, verify=self.verify, sign=sign)
        return book

    def transport(self, me: str) -> LocalTransport:
        return LocalTransport(self, me)

    def responder(self, sender: str, peer: str) -> Responder:
        if sender in self.down or peer in self.down or peer not in self.responders:
            raise ConnectionError(f"peer {peer} unreachable")
        return self.responders[peer]


class LocalTransport:
    def __init__(self, network: LocalNetwork, me: str) -> None:
        self.network, self.me = network, me

    async def push(self, peer: str, header: Header, payload: bytes) -> Reply:
        self.network.bytes_moved += len(payload)
        return await self.network.responder(self.me, peer).on_push(self.me, header, bytes(payload))

    async def fetch(self, peer: str, header: Header) -> Reply:
        reply = await self.network.responder(self.me, peer).on_fetch(self.me, header)
        self.network.bytes_moved += len(reply.payload)
        return reply

    async def query(self, peer: str, header: Header) -> Reply:
        reply = await self.network.responder(self.me, peer).on_query(self.me, header)
        self.network.bytes_moved += len(reply.payload)
        return reply

    async def check(self, peer: str, header: Header, nonce: bytes, members: bytes) -> Reply:
        responder = self.network.responder(self.me, peer)
        reply = await responder.on_check(self.me, header, nonce, members)
        self.network.bytes_moved += len(reply.payload)
        return reply

    async def inventory(self, peer: str, header: Header, members: bytes) -> Reply:
        responder = self.network.responder(self.me, peer)
        return await responder.on_inventory(self.me, header, members)
