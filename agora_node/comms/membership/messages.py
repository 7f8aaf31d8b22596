"""Wire format of membership messages: a compact, canonical big-endian encoding.

An envelope is one datagram-like message between two members::

    version u8 | flags u8 | kind u8 | seq u64 | body | n_items u8 | items | signature (64 B)

The envelope signature (by the sender) covers a domain tag, the sender's and the
receiver's peer ids and every byte before it, so a message cannot be replayed to
another member or attributed to another sender. Peer ids are not sent in the
envelope: the transport says who sent it, the receiver knows who it is.

Gossip items carry their own signature, made by the member the item speaks for:
ALIVE and LEFT by the subject itself (nobody can change another member's stage or
make it leave), SUSPECT and DEAD by the accuser. Relays forward items verbatim.

    item  = kind u8 | subject id | incarnation u32 | meta (ALIVE) | accuser id (SUSPECT, DEAD) | sig
    meta  = stage i16 | state (u8 length + ASCII)
    entry = status u8 | incarnation u32 | record | accusation (SUSPECT, DEAD)

An entry of a push-pull state carries the subject's latest self-signed record
(ALIVE or LEFT) and, if it is suspected or dead, the signed SUSPECT or DEAD item,
so a full sync only ever relays signed statements.

Decoding raises `MalformedMessage` on anything that is not exactly one such message.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum

VERSION = 1
SIGNATURE_BYTES = 64
FLAG_SIGNED = 0x01
ENVELOPE_DOMAIN = b"agora-swim-envelope/1"
ITEM_DOMAIN = b"agora-swim-item/1"
MAX_STATE_CHARS = 32
NO_SIGNATURE = bytes(SIGNATURE_BYTES)

_HEADER = struct.Struct(">BBBQ")
_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
MAX_ENTRIES = 8193
"""Entries of one push-pull: the sender and the most members a table holds
(settings.max_members, which may not exceed MAX_ENTRIES - 1)."""
_U32 = struct.Struct(">I")
_I16 = struct.Struct(">h")
_ENTRY_HEAD = struct.Struct(">BI")


class MalformedMessage(ValueError):
    """Bytes that do not decode to exactly one membership message."""


class MsgKind(IntEnum):
    PING = 1
    ACK = 2
    NACK = 3
    PING_REQ = 4
    GOSSIP = 5
    PUSH_PULL = 6


class Status(IntEnum):
    """A member's status; also the kind of a gossip item that announces it.
    At equal incarnation a larger value wins (LEFT > DEAD > SUSPECT > ALIVE)."""

    ALIVE = 1
    SUSPECT = 2
    DEAD = 3
    LEFT = 4


@dataclass(frozen=True, slots=True)
class MemberMeta:
    """What a member says about itself besides being alive."""

    stage: int = -1
    state: str = "joining"

    def __post_init__(self) -> None:
        if not -(2**15) <= self.stage < 2**15:
            raise ValueError("stage must fit in int16")
        if len(self.state) > MAX_STATE_CHARS or not self.state.isascii():
            raise ValueError(f"state must be ASCII of at most {MAX_STATE_CHARS} characters")


@dataclass(slots=True)
class Item:
    """One piece of gossip, with the exact bytes it arrived in (relayed verbatim)."""

    kind: Status
    subject: str
    incarnation: int
    meta: MemberMeta | None
    accuser: str | None
    raw: bytes

    @property
    def signer(self) -> str:
        return self.subject if self.accuser is None else self.accuser

    @property
    def signing_input(self) -> bytes:
        return ITEM_DOMAIN + self.raw[:-SIGNATURE_BYTES]

    @property
    def signature(self) -> bytes:
        return self.raw[-SIGNATURE_BYTES:]


@dataclass(slots=True)
class Entry:
    """One member in a push-pull state: its status, its self-signed record and,
    when suspected or dead, the signed accusation that made it so."""

    status: Status
    incarnation: int
    record: Item
    accusation: Item | None = None


@dataclass(slots=True)
class Envelope:
    kind: MsgKind
    seq: int
    signed: bool
    items: list[Item]
    unsigned_part: bytes
    signature: bytes
    probe_seq: int = 0
    target: str | None = None
    nack_after_ms: int = 0
    reply: bool = False
    entries: list[Entry] = field(default_factory=list)


_id_cache: dict[str, bytes] = {}


def encode_id(peer_id: str) -> bytes:
    """Length-prefixed ASCII peer id (cached: the same few ids are encoded constantly)."""
    out = _id_cache.get(peer_id)
    if out is None:
        raw = peer_id.encode("ascii")
        if not 0 < len(raw) < 256:
            raise ValueError("peer id must have 1..255 ASCII characters")
        out = _U8.pack(len(raw)) + raw
        if len(_id_cache) > 200_000:
            _id_cache.clear()
        _id_cache[peer_id] = out
    return out


def encode_meta(meta: MemberMeta) -> bytes:
    state = meta.state.encode("ascii")
    return _I16.pack(meta.stage) + _U8.pack(len(state)) + state


def item_body(
    kind: Status,
    subject: str,
    incarnation: int,
    *,
    meta: MemberMeta | None = None,
    accuser: str | None = None,
) -> bytes:
    """The signed part of an item; append the signer's signature to get the item."""
    out = _U8.pack(kind) + encode_id(subject) + _U32.pack(incarnation)
    if kind == Status.ALIVE:
        out += encode_meta(meta or MemberMeta())
    elif kind in (Status.SUSPECT, Status.DEAD):
        if accuser is None:
            raise ValueError("SUSPECT and DEAD items name their accuser")
        out += encode_id(accuser)
    return out


def envelope_signing_input(sender: str, receiver: str, unsigned_part: bytes) -> bytes:
    return ENVELOPE_DOMAIN + encode_id(sender) + encode_id(receiver) + unsigned_part


def encode_envelope(
    kind: MsgKind, seq: int, body: bytes, items: list[bytes], *, signed: bool = True
) -> bytes:
    """The part of an envelope the signature covers (the caller appends it)."""
    if len(items) > 255:
        raise ValueError("at most 255 items per message")
    head = _HEADER.pack(VERSION, FLAG_SIGNED if signed else 0, kind, seq)
    return b"".join((head, body, _U8.pack(len(items)), *items))


def probe_body(probe_seq: int) -> bytes:
    return _U32.pack(probe_seq)


def ping_req_body(probe_seq: int, target: str, nack_after_ms: int) -> bytes:
    return _U32.pack(probe_seq) + encode_id(target) + _U16.pack(min(nack_after_ms, 65535))


def entry_bytes(status: Status, incarnation: int, record: bytes, accusation: bytes = b"") -> bytes:
    return _ENTRY_HEAD.pack(status, incarnation) + record + accusation


def push_pull_body(reply: bool, entries: list[bytes]) -> bytes:
    return b"".join((_U8.pack(1 if reply else 0), _U32.pack(len(entries)), *entries))


_STATUS = {int(s): s for s in Status}
_KIND = {int(k): k for k in MsgKind}
_meta_cache: dict[bytes, MemberMeta] = {}


def _read_id(data: bytes, pos: int) -> tuple[str, int]:
    size = data[pos]
    end = pos + 1 + size
    if size == 0 or end > len(data):
        raise MalformedMessage("bad peer id")
    try:
        return data[pos + 1 : end].decode("ascii"), end
    except UnicodeDecodeError as e:
        raise MalformedMessage("peer id is not ASCII") from e


def _read_meta(data: bytes, pos: int) -> tuple[MemberMeta, int]:
    end = pos + 3 + data[pos + 2]
    if end > len(data):
        raise MalformedMessage("truncated metadata")
    key = data[pos:end]
    meta = _meta_cache.get(key)
    if meta is None:  # few distinct values exist: validate each once
        try:
            meta = MemberMeta(stage=_I16.unpack_from(data, pos)[0], state=key[3:].decode("ascii"))
        except (UnicodeDecodeError, ValueError) as e:
            raise MalformedMessage(f"bad member metadata: {e}") from e
        if len(_meta_cache) < 10_000:
            _meta_cache[key] = meta
    return meta, end


def read_item(data: bytes, pos: int) -> tuple[Item, int]:
    """Parse the item at `pos`; return it and the position after it.
    Raises MalformedMessage, IndexError or struct.error on bad input."""
    kind = _STATUS.get(data[pos])
    if kind is None:
        raise MalformedMessage("unknown item kind")
    subject, at = _read_id(data, pos + 1)
    incarnation = _U32.unpack_from(data, at)[0]
    at += 4
    meta = accuser = None
    if kind == Status.ALIVE:
        meta, at = _read_meta(data, at)
    elif kind != Status.LEFT:
        accuser, at = _read_id(data, at)
    at += SIGNATURE_BYTES
    if at > len(data):
        raise MalformedMessage("truncated item signature")
    return Item(kind, subject, incarnation, meta, accuser, data[pos:at]), at


def decode_item(raw: bytes) -> Item:
    try:
        item, end = read_item(raw, 0)
    except (IndexError, struct.error) as e:
        raise MalformedMessage("truncated item") from e
    if end != len(raw):
        raise MalformedMessage("trailing bytes after item")
    return item


def _read_body(env: Envelope, data: bytes, pos: int) -> int:
    kind = env.kind
    if kind == MsgKind.PING or kind == MsgKind.ACK or kind == MsgKind.NACK:
        env.probe_seq = _U32.unpack_from(data, pos)[0]
        return pos + 4
    if kind == MsgKind.PING_REQ:
        env.probe_seq = _U32.unpack_from(data, pos)[0]
        env.target, pos = _read_id(data, pos + 4)
        env.nack_after_ms = _U16.unpack_from(data, pos)[0]
        return pos + 2
    if kind == MsgKind.PUSH_PULL:
        env.reply = data[pos] == 1
        count = _U32.unpack_from(data, pos + 1)[0]
        pos += 5
        if count > min(len(data), MAX_ENTRIES):  # refuse absurd counts before parsing
            raise MalformedMessage(f"push-pull of {count} entries (at most {MAX_ENTRIES})")
        for _ in range(count):
            status, incarnation = _ENTRY_HEAD.unpack_from(data, pos)
            record, pos = read_item(data, pos + _ENTRY_HEAD.size)
            accusation = None
            if status == Status.SUSPECT or status == Status.DEAD:
                accusation, pos = read_item(data, pos)
                if accusation.kind != status or accusation.subject != record.subject:
                    raise MalformedMessage("accusation does not match its entry")
            if record.kind not in (Status.ALIVE, Status.LEFT) or status not in _STATUS:
                raise MalformedMessage("bad push-pull entry")
            env.entries.append(Entry(_STATUS[status], incarnation, record, accusation))
    return pos


def decode_envelope(data: bytes) -> Envelope:
    """Parse one envelope; raise MalformedMessage unless it is exactly one message."""
    if len(data) < _HEADER.size + 1:
        raise MalformedMessage("message too short")
    version, flags, kind, seq = _HEADER.unpack_from(data, 0)
    if version != VERSION:
        raise MalformedMessage(f"unsupported version {version}")
    msg_kind = _KIND.get(kind)
    if msg_kind is None:
        raise MalformedMessage(f"unknown message kind {kind}")
    signed = bool(flags & FLAG_SIGNED)
    end = len(data) - SIGNATURE_BYTES if signed else len(data)
    if end < _HEADER.size + 1:
        raise MalformedMessage("message too short for its signature")
    body = data[:end]
    env = Envelope(msg_kind, seq, signed, [], body, data[end:])
    try:
        pos = _read_body(env, body, _HEADER.size)
        count = body[pos]
        pos += 1
        items = env.items
        for _ in range(count):
            item, pos = read_item(body, pos)
            items.append(item)
    except (IndexError, struct.error) as e:
        raise MalformedMessage("truncated message") from e
    if pos != end:
        raise MalformedMessage("trailing bytes after message")
    return env
