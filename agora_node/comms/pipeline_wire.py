"""Wire format of the pipeline data plane: one request and one response per hop.

A forward request carries a micro-batch to the next stage: its id, the token ids
(every stage needs them: positions for the fixed embedding table, targets at the
last stage), where documents start inside each row when sequences are packed
(every stage's attention keeps documents apart) and the boundary activation (k subspace coefficients per token,
framed by the activation codec). The response comes back on the same stream
once everything downstream is done: the loss and the gradient w.r.t. the
activation that was sent, k values per token as well.

Layout: 4-byte header length | JSON header | 4-byte tokens length | tokens
(a width byte, then unsigned ids of that many bytes, little endian: 1 for byte-level
vocabularies) | document starts (`docs` bytes, the header says
how many; none when no row has a boundary) | codec frame. Document starts are, per
row, a uint32 count and that many uint32 positions, strictly increasing inside
1..seq-1. Parsing is strict: anything inconsistent raises WireError with a code the
sender can act on.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict, dataclass, field
from enum import StrEnum

import numpy as np
import torch

WIRE_VERSION = 1
MAX_HEADER = 4096
MAX_ID_CHARS = 128
"""Run ids, micro-batch ids and origins in a forward header: printable ASCII, this long."""


def _printable(text: str) -> bool:
    return text.isascii() and text.isprintable()


class Status(StrEnum):
    OK = "ok"
    BUSY = "busy"
    """Try another replica now; this one is full or leaving."""
    REJECTED = "rejected"
    """The request is malformed; retrying it anywhere is pointless."""
    FAILED = "failed"
    """This hop or one below it failed; another replica may succeed."""


class Code(StrEnum):
    NONE = ""
    UNKNOWN_RUN = "unknown_run"
    WRONG_STAGE = "wrong_stage"
    BAD_SHAPE = "bad_shape"
    BAD_TOKENS = "bad_tokens"
    BAD_DOCUMENTS = "bad_documents"
    BAD_PAYLOAD = "bad_payload"
    NON_FINITE = "non_finite"
    BAD_HEADER = "bad_header"
    OVERLOADED = "overloaded"
    LEAVING = "leaving"
    NOT_READY = "not_ready"
    UNKNOWN_SENDER = "unknown_sender"
    """The sender has no record at the stage before the receiver's (yet: a fresh one is
    read within the receiver's refresh interval)."""
    BANNED = "banned"
    """The sender is banned at the receiver, caught lying by its checks (node/canary.py)."""
    DOWNSTREAM = "downstream"
    INTERNAL = "internal"


class WireError(ValueError):
    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(kw_only=True)
class ForwardHeader:
    run_id: str
    mb_id: str
    stage: int
    """The stage this request is addressed to."""
    batch: int
    seq: int
    width: int
    loss_scale: float = 1.0
    """Multiplies the loss before backward (1 / micro-batches per inner step)."""
    train: bool = True
    """False: forward only (validation), no gradient comes back."""
    origin: str = ""
    version: int = WIRE_VERSION
    probe: bool = False
    """A canary (node/canary.py): forward at this stage only and answer with its output
    (the loss at the last stage). Sent with train=False, so a peer that does not know
    the field runs a validation forward and answers without a payload."""
    docs: int = 0
    """Bytes of the document-starts section (encode_forward sets it)."""


@dataclass(kw_only=True)
class ResponseHeader:
    status: str
    code: str = ""
    message: str = ""
    loss: float | None = None
    stats: dict = field(default_factory=dict)

    def loss_value(self) -> float:
        """The loss as a float; NaN when the reply carries none (`decode_response` let
        only numbers or nothing through)."""
        return math.nan if self.loss is None else float(self.loss)


def _pack(header: dict, tokens: bytes, payload: bytes) -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join(
        (struct.pack("<I", len(head)), head, struct.pack("<I", len(tokens)), tokens, payload)
    )


def _unpack(data: bytes) -> tuple[dict, bytes, memoryview]:
    view = memoryview(data)
    if len(view) < 8:
        raise WireError(Code.BAD_HEADER, "message too short")
    (head_len,) = struct.unpack_from("<I", view, 0)
    if head_len > MAX_HEADER or 4 + head_len + 4 > len(view):
        raise WireError(Code.BAD_HEADER, f"header length {head_len} is invalid")
    try:
        header = json.loads(bytes(view[4 : 4 + head_len]))
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: "[[[[..."
        raise WireError(Code.BAD_HEADER, "header is not JSON") from None
    if not isinstance(header, dict):
        raise WireError(Code.BAD_HEADER, "header is not an object")
    offset = 4 + head_len
    (tok_len,) = struct.unpack_from("<I", view, offset)
    offset += 4
    if offset + tok_len > len(view):
        raise WireError(Code.BAD_TOKENS, "token section overruns the message")
    return header, bytes(view[offset : offset + tok_len]), view[offset + tok_len :]


_TOKEN_WIDTHS = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4")}
"""Bytes per token id -> its unsigned little-endian type; the sender takes the narrowest
that holds the largest id it sends (a byte for byte-level tokenizers, two up to 65,535)."""


def encode_tokens(tokens: torch.Tensor) -> bytes:
    """A width byte and the ids, each in the fewest bytes that hold the largest."""
    top = int(tokens.max()) if tokens.numel() else 0
    width = next(w for w in _TOKEN_WIDTHS if top < 1 << (8 * w))
    return bytes([width]) + tokens.numpy().astype(_TOKEN_WIDTHS[width]).tobytes()


def decode_tokens(data: bytes, batch: int, seq: int, vocab: int) -> torch.Tensor:
    if not data or data[0] not in _TOKEN_WIDTHS:
        raise WireError(Code.BAD_TOKENS, "unknown token width")
    if batch < 1 or seq < 0:  # batch 0 would let any seq through to the reshape
        raise WireError(Code.BAD_TOKENS, f"token shape [{batch}, {seq} + 1] is invalid")
    expected = batch * (seq + 1) * data[0]
    if len(data) - 1 != expected:
        raise WireError(
            Code.BAD_TOKENS, f"token section has {len(data) - 1} bytes, expected {expected}"
        )
    ids = np.frombuffer(data, dtype=_TOKEN_WIDTHS[data[0]], offset=1)
    ids = ids.astype(np.int64).reshape(batch, seq + 1)
    if ids.size and ids.max() >= vocab:
        raise WireError(Code.BAD_TOKENS, f"token ids outside the vocabulary 0..{vocab - 1}")
    return torch.from_numpy(ids)


_U32 = np.dtype("<u4")


def encode_documents(docs: torch.Tensor | None) -> bytes:
    """[B, seq] document ids (stages/data.py `document_ids` per row) -> the wire's
    document starts; b"" when there are none (every row one document)."""
    if docs is None:
        return b""
    marks = (docs[:, 1:] != docs[:, :-1]).cpu().numpy()
    parts = []
    for row in marks:
        starts = np.flatnonzero(row) + 1
        parts += [np.array([len(starts)], _U32).tobytes(), starts.astype(_U32).tobytes()]
    return b"".join(parts)


def decode_documents(data: bytes, batch: int, seq: int) -> torch.Tensor | None:
    """The document-starts section -> [batch, seq] document ids, or None when empty.
    Every count and position is checked against the row's length before it is used."""
    if not data:
        return None
    values = len(data) // 4
    if len(data) % 4:
        raise WireError(Code.BAD_DOCUMENTS, "document section is not whole uint32s")
    flat = np.frombuffer(data, dtype=_U32).astype(np.int64)
    docs = np.zeros((batch, seq), dtype=np.int64)
    at = 0
    for row in range(batch):
        if at >= values:
            raise WireError(Code.BAD_DOCUMENTS, f"document section ends before row {row}")
        count = int(flat[at])
        if count > max(seq - 1, 0) or at + 1 + count > values:
            raise WireError(Code.BAD_DOCUMENTS, f"row {row}: {count} document starts")
        starts = flat[at + 1 : at + 1 + count]
        at += 1 + count
        if count and (starts[0] < 1 or starts[-1] > seq - 1 or (np.diff(starts) <= 0).any()):
            raise WireError(
                Code.BAD_DOCUMENTS, f"row {row}: starts not increasing inside 1..{seq - 1}"
            )
        docs[row, starts] = 1
    if at != values:
        raise WireError(Code.BAD_DOCUMENTS, f"{values - at} values past the last row")
    return torch.from_numpy(docs.cumsum(axis=1))


def encode_forward(
    header: ForwardHeader,
    tokens: torch.Tensor,
    activation: bytes,
    docs: torch.Tensor | None = None,
) -> bytes:
    """`docs`: [B, seq] document ids of packed rows, or None (one document per row)."""
    starts = encode_documents(docs)
    fields = {**asdict(header), "docs": len(starts)}
    return _pack(fields, encode_tokens(tokens), starts + activation)


def decode_forward(data: bytes) -> tuple[ForwardHeader, bytes, bytes, memoryview]:
    """Header, raw token section, raw document section and activation frame; checks
    types, not run semantics."""
    raw, tokens, payload = _unpack(data)
    try:
        header = ForwardHeader(
            **{k: raw[k] for k in ForwardHeader.__dataclass_fields__ if k in raw}
        )
    except TypeError as exc:
        raise WireError(Code.BAD_HEADER, f"forward header: {exc}") from None
    for name in ("stage", "batch", "seq", "width", "docs", "version"):
        value = getattr(header, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise WireError(Code.BAD_HEADER, f"forward header field {name} = {value!r}")
    for name in ("run_id", "mb_id", "origin"):
        # printable ASCII and short: a header passed on downstream re-encodes to the size
        # it came in (escaped non-ASCII grew past MAX_HEADER, and the next stage's refusal
        # was charged to that stage)
        value = getattr(header, name)
        if not isinstance(value, str) or len(value) > MAX_ID_CHARS or not _printable(value):
            raise WireError(Code.BAD_HEADER, f"forward header field {name} is not a short id")
    for name in ("train", "probe"):
        if not isinstance(getattr(header, name), bool):
            raise WireError(Code.BAD_HEADER, f"forward header field {name} is not a boolean")
    if not isinstance(header.loss_scale, int | float) or not 0 < header.loss_scale <= 1:
        raise WireError(Code.BAD_HEADER, f"loss_scale = {header.loss_scale!r}")
    if header.docs > len(payload):
        raise WireError(Code.BAD_DOCUMENTS, "document section overruns the message")
    return header, tokens, bytes(payload[: header.docs]), payload[header.docs :]


def encode_response(header: ResponseHeader, gradient: bytes = b"") -> bytes:
    return _pack(asdict(header), b"", gradient)


def decode_response(data: bytes) -> tuple[ResponseHeader, memoryview]:
    raw, _, payload = _unpack(data)
    try:
        header = ResponseHeader(
            **{k: raw[k] for k in ResponseHeader.__dataclass_fields__ if k in raw}
        )
        Status(header.status)
    except (TypeError, ValueError) as exc:
        raise WireError(Code.BAD_HEADER, f"response header: {exc}") from None
    if not isinstance(header.code, str) or not isinstance(header.message, str):
        raise WireError(Code.BAD_HEADER, "response code and message must be strings")
    if not isinstance(header.stats, dict):
        raise WireError(Code.BAD_HEADER, "response stats must be an object")
    loss = header.loss
    if loss is not None:
        # the sender adds it to its statistics: a string or a 400-digit integer must not
        # raise there (non-finite floats are the peer's loss as reported, and kept)
        if isinstance(loss, bool) or not isinstance(loss, int | float):
            raise WireError(Code.BAD_HEADER, f"loss = {loss!r:.40} is not a number")
        try:
            header.loss = float(loss)
        except OverflowError:
            raise WireError(Code.BAD_HEADER, "loss does not fit a float") from None
    return header, payload


def error_response(status: Status, code: Code, message: str) -> bytes:
    return encode_response(
        ResponseHeader(status=status.value, code=code.value, message=message[:300])
    )
