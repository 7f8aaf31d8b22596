"""The conversation of a collective: three requests, their answers, and the transport seam.

    push(PART)   member -> span owner      ACCEPTED | REJECTED(reason)  (a witness taking its
                                           span owner's copy adds its signed receipt)
    fetch(FETCH) member -> span owner      FINAL(frame, attempt) | NOT_READY | REJECTED
    query(QUERY) backup owner -> member    FINAL(frame, attempt) | CONTRIBUTION(frame, weight)
                                           | NOTHING | REJECTED
    check(CHECK, nonce + members mask)     SKETCH(sketch of the witness's value) | NOT_READY
         member -> witness                 | NOTHING (lacks a part) | REJECTED     (verify.py)
    inventory(INVENTORY, members mask)     HOLDS(mask of those parts it holds, their
         owner -> witness                  signed entries, its signed receipt) | REJECTED

A PART with attempt 1 is a copy of the sender's part for the span's witness. A PART
carries its sender's signature; FINAL and SKETCH the signed entries of the parts they
aggregate (proofs.py), so a failed check can name who lied; FINAL also passes on the
witness's receipt from the inventory, so a witness that denies holding a part it signed
for is caught.

`Transport` is the narrow interface the protocol driver talks through; `P2PTransport`
(p2p.py) carries it over hivemind, `LocalTransport` (local.py) in-process for unit
tests and the one-process simulation. Timeouts are the caller's business
(asyncio.wait_for around each call), so every transport behaves the same under them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol


class Code(IntEnum):
    PART = 1
    ACCEPTED = 2
    REJECTED = 3
    FETCH = 4
    FINAL = 5
    NOT_READY = 6
    QUERY = 7
    CONTRIBUTION = 8
    NOTHING = 9
    CHECK = 10
    SKETCH = 11
    INVENTORY = 12
    HOLDS = 13


@dataclass(frozen=True)
class Header:
    """Names the collective and span a message is about."""

    round: int
    phase: str
    group_id: bytes
    span: int
    attempt: int = 0
    weight: float = 0.0
    """The sender's contribution weight (PART only)."""
    wait: float = 0.0
    """How long the receiver may hold the request open (registration, long-poll)."""
    signature: bytes = b""
    """PART: the sender's signature over its part (proofs.py)."""


@dataclass(frozen=True)
class Reply:
    code: Code
    payload: bytes = b""
    attempt: int = 0
    weight: float = 0.0
    reason: str = ""
    members: bytes = b""
    """FINAL: bitmask of the members whose parts the result aggregates (verify.py).
    NOTHING to a check: those whose parts the witness lacks."""
    proofs: bytes = b""
    """FINAL and SKETCH: the signed entries of the parts aggregated, in plan order
    (proofs.py)."""
    receipt: bytes = b""
    """HOLDS: the witness's signed receipt for the parts it holds; ACCEPTED (or REJECTED
    "duplicate") to the span owner's own copy: one for that part; FINAL: the inventory's,
    then the copy's if the inventory lacks the owner (proofs.read_receipts; b"" none)."""


class Transport(Protocol):
    """Sends the three requests to a peer; raises on a transport failure."""

    async def push(self, peer: str, header: Header, payload: bytes) -> Reply: ...

    async def fetch(self, peer: str, header: Header) -> Reply: ...

    async def query(self, peer: str, header: Header) -> Reply: ...

    async def check(self, peer: str, header: Header, nonce: bytes, members: bytes) -> Reply: ...

    async def inventory(self, peer: str, header: Header, members: bytes) -> Reply: ...


def rejected(reason: str) -> Reply:
    return Reply(Code.REJECTED, reason=reason)
