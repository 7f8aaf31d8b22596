"""K/V frames: what the members of a context-parallel cell send each other, and what a
receiver accepts.

A frame is a 19-byte header (magic, layer, sending member, kind, batch, length,
width, dtype) and the values, plus one byte of subspace choice per token for a
mixture frame and, when the mixture keeps a token table (`kv_tokens`), each token's
id in the fewest bytes the vocabulary allows (`token_id_bytes`). The receiver knows
before reading what each frame must be (`KVExpect`: from the layer it is at and the
chunk layout) and refuses anything else with a code: `layer`, `chunk`, `length`,
`rank`, `dtype`, `nonfinite`, `choice`, `token` or `malformed`; `FramedExchange`
counts the refusals.
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from agora_node.protocol.manifest import ModelSpec


class Posted(Protocol):
    def wait(self) -> list[Tensor]:
        """What each member sent (this member's own send at its rank); blocks."""
        ...


class Exchange(Protocol):
    """One member's view of its cell: send sends[j] to member j, get what each sent.
    `post` sends and returns at once; the caller computes what it can meanwhile and
    then waits for what the others sent (`all_to_all` is both in one)."""

    rank: int
    size: int

    def post(self, sends: list[Tensor]) -> Posted: ...

    def all_to_all(self, sends: list[Tensor]) -> list[Tensor]: ...


_MAGIC = b"AKV1"
_HEADER = struct.Struct("<4sHBBIIHB")  # magic, layer, member, kind, batch, length, width, dtype
_DTYPES = {0: torch.float32, 1: torch.bfloat16}
_DTYPE_CODES = {v: k for k, v in _DTYPES.items()}
KIND_DENSE, KIND_MIXTURE, KIND_GRAD = 0, 1, 2
MAX_FRAME_BYTES = 256 << 20


class KVFrameError(ValueError):
    """A K/V frame refused on receipt; `code` says why (counted by the receiver)."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code


@dataclass(frozen=True)
class KVExpect:
    """What the receiver knows a frame from `member` must be, before reading it."""

    layer: int
    member: int
    kind: int
    batch: int
    length: int
    width: int
    dtype: torch.dtype
    vocab: int = 0
    """> 0: a mixture frame also carries each token's id, below this."""


_ID_TYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def max_kv_frame_bytes(model: ModelSpec, micro_batch: int) -> int:
    """An upper bound on one K/V frame of `model`'s cells: every position of the sequences
    of a micro-batch, each the widest a frame carries (a dense cell sends the normalized
    block input, d_model wide, and its gradient back; keys and values, or a subspace code
    of twice kv_rank values, where wider) in fp32, a choice byte and a 4-byte token id.
    What a cell member reads of a push before it looks at the frame (comms/cell_link.py)."""
    width = max(model.d_model, 2 * model.n_kv_heads * model.head_dim, 2 * model.kv_rank)
    return _HEADER.size + micro_batch * model.seq_len * (4 * width + 1 + 4)


def token_id_bytes(vocab: int) -> int:
    """Bytes one token id takes on the wire for a vocabulary of `vocab`."""
    return 1 if vocab <= 1 << 8 else 2 if vocab <= 1 << 16 else 4


def encode_kv_frame(
    *,
    layer: int,
    member: int,
    kind: int,
    values: Tensor,
    choice: Tensor | None = None,
    tokens: Tensor | None = None,
    vocab: int = 0,
) -> bytes:
    """values [B, n, width] (fp32 or bf16); choice [B, n] uint8 for mixture frames, and
    with a token table the tokens' ids [B, n] (ids below `vocab`)."""
    b, n, width = values.shape
    header = _HEADER.pack(_MAGIC, layer, member, kind, b, n, width, _DTYPE_CODES[values.dtype])
    raw = values.contiguous().view(torch.uint8).numpy().tobytes()
    tail = b"" if choice is None else choice.to(torch.uint8).contiguous().numpy().tobytes()
    if tokens is not None:
        tail += tokens.contiguous().numpy().astype(_ID_TYPES[token_id_bytes(vocab)]).tobytes()
    return header + raw + tail


def decode_kv_frame(
    frame: bytes, expect: KVExpect, num_subspaces: int = 0
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Check a received frame against what it must be; (values, choice, token ids) or
    KVFrameError."""
    if len(frame) < _HEADER.size or len(frame) > MAX_FRAME_BYTES:
        raise KVFrameError("malformed", f"{len(frame)} bytes")
    magic, layer, member, kind, b, n, width, dtype_code = _HEADER.unpack_from(frame)
    if magic != _MAGIC or kind != expect.kind:
        raise KVFrameError("malformed", f"magic {magic!r}, kind {kind}")
    if layer != expect.layer:
        raise KVFrameError("layer", f"layer {layer}, expected {expect.layer}")
    if member != expect.member:
        raise KVFrameError("chunk", f"chunk of member {member}, expected {expect.member}")
    if b != expect.batch or n != expect.length:
        raise KVFrameError("length", f"{b}x{n} tokens, expected {expect.batch}x{expect.length}")
    if width != expect.width:
        raise KVFrameError("rank", f"width {width}, expected {expect.width}")
    if _DTYPES.get(dtype_code) != expect.dtype:
        raise KVFrameError("dtype", f"dtype code {dtype_code}, expected {expect.dtype}")
    itemsize = torch.empty(0, dtype=expect.dtype).element_size()
    body = b * n * width * itemsize
    mixture = kind == KIND_MIXTURE
    id_bytes = token_id_bytes(expect.vocab) if mixture and expect.vocab else 0
    tail = b * n * (1 + id_bytes) if mixture else 0
    if len(frame) != _HEADER.size + body + tail:
        raise KVFrameError("length", f"{len(frame)} bytes, expected {_HEADER.size + body + tail}")
    raw = torch.frombuffer(bytearray(frame[_HEADER.size : _HEADER.size + body]), dtype=torch.uint8)
    values = raw.view(expect.dtype).view(b, n, width)
    if not torch.isfinite(values).all():
        raise KVFrameError("nonfinite", "NaN or inf in values")
    choice = tokens = None
    if mixture:
        start = _HEADER.size + body
        choice = torch.frombuffer(bytearray(frame[start : start + b * n]), dtype=torch.uint8)
        top = int(choice.max()) if choice.numel() else 0
        if num_subspaces and top >= num_subspaces:
            raise KVFrameError("choice", f"subspace {top} of {num_subspaces}")
        choice = choice.view(b, n).long()
    if id_bytes:
        ids = np.frombuffer(frame, dtype=_ID_TYPES[id_bytes], offset=_HEADER.size + body + b * n)
        tokens = torch.from_numpy(ids.astype(np.int64)).view(b, n)
        top = int(tokens.max()) if tokens.numel() else 0
        if top >= expect.vocab:
            raise KVFrameError("token", f"token id {top} of a vocabulary of {expect.vocab}")
    return values, choice, tokens


@dataclass
class FramedExchange:
    """Sends tensors as checked K/V frames over a byte exchange (an `Exchange` of uint8)."""

    inner: Exchange
    refused: Counter = field(default_factory=Counter)
    frame_bytes_sent: int = 0

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    def exchange_frames(
        self, frames: list[bytes], expects: list[KVExpect | None], num_subspaces: int = 0
    ) -> list[tuple[Tensor, Tensor | None, Tensor | None] | None]:
        """Send frames[j] to member j; decode what each member sent (None for self)."""
        return self.post_frames(frames).collect(expects, num_subspaces)

    def post_frames(self, frames: list[bytes]) -> PostedFrames:
        """Send frames[j] to member j now; `collect` what the others sent later."""
        self.frame_bytes_sent += sum(len(f) for j, f in enumerate(frames) if j != self.rank)
        sends = [
            torch.frombuffer(bytearray(f), dtype=torch.uint8)
            if f
            else torch.empty(0, dtype=torch.uint8)
            for f in frames
        ]
        return PostedFrames(self, self.inner.post(sends))


@dataclass
class PostedFrames:
    exchange: FramedExchange
    posted: Posted

    def collect(
        self, expects: list[KVExpect | None], num_subspaces: int = 0
    ) -> list[tuple[Tensor, Tensor | None, Tensor | None] | None]:
        """Wait for every member's frame and check it (None for this member's own)."""
        me = self.exchange.rank
        out: list[tuple[Tensor, Tensor | None, Tensor | None] | None] = []
        for src, raw in enumerate(self.posted.wait()):
            if src == me:
                out.append(None)
                continue
            try:
                out.append(decode_kv_frame(raw.numpy().tobytes(), expects[src], num_subspaces))
            except KVFrameError as exc:
                self.exchange.refused[exc.code] += 1
                raise
        return out
