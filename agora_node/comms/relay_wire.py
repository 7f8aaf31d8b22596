"""What travels through a relay of ours (comms/relay.py), and the checks on it.

A relayed request is one stream frame (comms/streams.py) whose payload is a 4-byte
header length, the header (JSON, at most 2 KiB) and the body. The caller signs
`request_message` over the body's SHA-256; the target answers with data frames, then a
`KIND_SIGNED` frame over `AnswerDigest` (the request's nonce and every data frame), then
END. The checks the target makes on a request are in `Relaying.take`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from collections import OrderedDict
from dataclasses import dataclass

from agora_node.comms import streams
from agora_node.comms.guard import Guard
from agora_node.protocol.identity import Identity, IdentityError, public_key_from_peer_id, verify

HEADER_LEN_BYTES = 4
MAX_HEADER = 2048
WINDOW_S = 300.0
"""A relayed request older or newer than this (by the target's clock) is refused."""
NONCES_KEPT = 1 << 16


class RelayError(ValueError):
    """A relayed request that is refused; `code` says why (counted)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Header:
    """What travels in front of a relayed request's body."""

    to: str
    proto: str
    t_ms: int
    nonce: str
    sig: str
    origin: str = ""
    """The caller, added by the relay (it is the peer libp2p authenticated to the relay);
    the target checks `sig` against it, so a relay that names someone else is caught."""

    def encode(self) -> bytes:
        fields = {"to": self.to, "proto": self.proto, "t": self.t_ms, "nonce": self.nonce}
        fields["sig"] = self.sig
        if self.origin:
            fields["from"] = self.origin
        return json.dumps(fields, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> Header:
        """Strict: every field of its type and size, peer ids that are Ed25519 ids."""
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):  # a nesting bomb too
            raise RelayError("header", "relay header is not JSON") from None
        if not isinstance(raw, dict) or not {"to", "proto", "t", "nonce", "sig"} <= set(raw):
            raise RelayError("header", "relay header lacks a field")
        to, proto, t, nonce, sig = (raw[k] for k in ("to", "proto", "t", "nonce", "sig"))
        origin = raw.get("from", "")
        if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 53):
            raise RelayError("header", "relay header: bad time")
        if not all(isinstance(v, str) for v in (to, proto, nonce, sig, origin)):
            raise RelayError("header", "relay header: a field is not text")
        if len(proto) > 200 or not _is_hex(nonce, 32) or not _is_hex(sig, 128):
            raise RelayError("header", "relay header: bad protocol, nonce or signature")
        for peer in (to, origin) if origin else (to,):
            try:
                public_key_from_peer_id(peer)
            except IdentityError:
                raise RelayError("header", "relay header: not a peer id") from None
        return cls(to, proto, t, nonce, sig, origin)


def _is_hex(text: str, length: int) -> bool:
    return len(text) == length and all(c in "0123456789abcdef" for c in text)


def request_message(to: str, proto: str, t_ms: int, nonce: str, digest: bytes) -> bytes:
    """What a caller signs: the request can serve only this target, protocol and body."""
    return b"agora-relayed-request/1\n" + f"{to}\n{proto}\n{t_ms}\n{nonce}\n".encode() + digest


class AnswerDigest:
    """The SHA-256 chain over an answer's data frames that the target signs."""

    def __init__(self, nonce: str) -> None:
        self._hash = hashlib.sha256(b"agora-relayed-answer/1\n" + nonce.encode() + b"\n")

    def update(self, chunk: bytes) -> None:
        self._hash.update(len(chunk).to_bytes(8, "big"))
        self._hash.update(chunk)

    def digest(self) -> bytes:
        return self._hash.digest()


class AnswerSigner(AnswerDigest):
    """The target's side: `finish` signs the frames so far (comms/streams.Signer)."""

    def __init__(self, identity: Identity, nonce: str) -> None:
        super().__init__(nonce)
        self._identity = identity

    def finish(self) -> bytes:
        return self._identity.sign(self.digest())


class Nonces:
    """Nonces of the requests served within the time window: a relay that sends one twice
    is refused the second time. A nonce is kept until both when it came and when its
    request was signed are a window old (a clock ahead must not shorten it). At most
    `kept`, the oldest forgotten first; and once one still inside the window is
    forgotten, no request of its origin signed before it is taken any more (that
    origin's floor, at its signing time): a relay that floods requests of its own to
    push a captured nonce out cannot replay it then. A floor is its origin's alone (one
    shared by all let one stranger's flood, signed minutes ahead, refuse every honest
    request). The newest `kept` floors are kept; an older one is folded into a floor for
    all origins at the time its nonce came, which lags the present by a whole store."""

    def __init__(self, window_s: float = WINDOW_S, kept: int = NONCES_KEPT) -> None:
        self.window_s, self.kept = window_s, kept
        self._seen: OrderedDict[str, tuple[float, float, str]] = OrderedDict()
        """nonce -> (when it came, when its request was signed, its origin), oldest first."""
        self._floors: OrderedDict[str, tuple[float, float]] = OrderedDict()
        """origin -> (its requests signed before this are refused, when that nonce came)."""
        self._floor_all = -math.inf
        """Requests of any origin signed before this are refused (from floors forgotten)."""

    def floor(self, origin: str) -> float:
        return max(self._floor_all, self._floors.get(origin, (-math.inf, 0.0))[0])

    def fresh(
        self, nonce: str, now: float, signed_at: float | None = None, origin: str = ""
    ) -> bool:
        """Record `nonce` (of a request `origin` signed at `signed_at`, default `now`);
        False if it was seen within the window, or its request is older than its
        origin's floor."""
        signed_at = now if signed_at is None else signed_at
        while self._seen:
            came, signed, whose = next(iter(self._seen.values()))
            expired = max(came, signed) < now - self.window_s
            if not expired and len(self._seen) < self.kept:
                break
            self._seen.popitem(last=False)
            if not expired:
                self._raise_floor(whose, signed, came)
        if nonce in self._seen or signed_at <= self.floor(origin):
            return False
        self._seen[nonce] = (now, signed_at, origin)
        return True

    def _raise_floor(self, origin: str, signed: float, came: float) -> None:
        old = self._floors.pop(origin, (-math.inf, -math.inf))
        self._floors[origin] = (max(old[0], signed), max(old[1], came))
        while len(self._floors) > self.kept:
            _, (_, at) = self._floors.popitem(last=False)
            self._floor_all = max(self._floor_all, at)


async def read_header(
    reader: asyncio.StreamReader, length: int, guard: Guard, remote: str
) -> tuple[Header, int]:
    """The header in front of a relayed request of `length` bytes, and its size."""
    size = int.from_bytes(
        await guard.read(streams.read_exactly(reader, HEADER_LEN_BYTES, "closed"), 0, remote),
        "big",
    )
    if not 0 < size <= MAX_HEADER or HEADER_LEN_BYTES + size > length:
        raise RelayError("header", f"relay header of {size} bytes")
    data = await guard.read(streams.read_exactly(reader, size, "closed"), size, remote)
    return Header.decode(data), size


async def read_signed(
    reader: asyncio.StreamReader,
    peer_id: str,
    relay: str,
    nonce: str,
    timeout: float,
    limits: tuple[int, int],
) -> list[bytes]:
    """The answer's data frames, once the target's signature over them checked out.
    limits: the most bytes of one frame and of all of them (they are held until then)."""
    max_response, max_total = limits
    digest, frames, signed, total = AnswerDigest(nonce), [], False, 0
    while True:
        try:
            kind, data = await asyncio.wait_for(streams.read_frame(reader, max_response), timeout)
        except TimeoutError as exc:
            raise streams.SilentPeerError(
                f"{peer_id[-8:]} (through relay {relay[-8:]}) sent nothing for {timeout:.0f}s"
            ) from exc
        if kind == streams.KIND_DATA and not signed:
            total += len(data)
            if total > max_total:
                raise streams.StreamError(
                    f"the answer of {peer_id[-8:]} through relay {relay[-8:]} exceeds "
                    f"{max_total} bytes"
                )
            digest.update(data)
            frames.append(data)
        elif kind == streams.KIND_SIGNED and not signed:
            signed = verify(peer_id, digest.digest(), data)
            if not signed:
                raise streams.StreamError(
                    f"the answer of {peer_id[-8:]} through relay {relay[-8:]} does not carry "
                    "its signature: altered on the way"
                )
        elif kind == streams.KIND_END and signed:
            return frames
        elif kind == streams.KIND_REFUSED:
            # unsigned: the relay's word, or the peer refusing the relay (a private swarm's
            # NATed peer refuses an unlisted relay), not the peer refusing us. Taken as one,
            # a relay made an admitted node stop with its text.
            raise streams.StreamError(
                f"{peer_id[-8:]} through relay {relay[-8:]}: refused "
                f"(unsigned, not taken as its word): {streams.peer_text(data)}"
            )
        elif kind == streams.KIND_ERROR:
            raise streams.StreamError(
                f"{peer_id[-8:]} through relay {relay[-8:]} failed: {streams.peer_text(data)}"
            )
        else:
            raise streams.StreamError(
                f"the answer of {peer_id[-8:]} through relay {relay[-8:]} broke the framing"
            )


async def copy_bytes(
    reader: asyncio.StreamReader, writer, guard: Guard, remote: str, nbytes: int, what: str
) -> int:
    """Copy `nbytes` in chunks under the guard's read and drain deadlines; `what` names a
    stream that ends before them."""
    moved = 0
    while moved < nbytes:
        want = min(streams.CHUNK, nbytes - moved)
        chunk = await guard.read(reader.read(want), want, remote)
        if not chunk:
            raise streams.StreamError(what)
        moved += len(chunk)
        writer.write(chunk)
        await guard.drain(writer.drain(), len(chunk), remote)
    return moved


async def copy_answer(
    reader: asyncio.StreamReader, writer, guard: Guard, remote: str, cap: int
) -> int:
    """A relay copies an answer frame by frame up to its last (END, ERROR or REFUSED),
    at most `cap` bytes, under the guard's deadlines; the bytes copied. An answer cut
    short is an error here, not a short answer passed on."""
    moved = 0
    while True:
        head = await guard.read(
            streams.read_exactly(reader, 1 + streams.LEN_BYTES, "answer cut short"), 0, remote
        )
        kind, length = streams.parse_head(head)
        moved += len(head) + length
        if moved > cap:
            raise RelayError("answer", f"an answer of more than {cap} bytes")
        writer.write(head)
        await copy_bytes(reader, writer, guard, remote, length, "the target cut its answer short")
        await guard.drain(writer.drain(), 0, remote)
        if kind in (streams.KIND_END, streams.KIND_ERROR, streams.KIND_REFUSED):
            return moved
