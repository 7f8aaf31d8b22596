"""The state a replica sends a joiner: its outer anchor and momentum, and a strict decoder.

Only what the stage's replicas can attest travels: the anchor (weights after the
last outer round, equal on every replica that finished the round with the same
group) and the outer momentum. A replica's inner progress since the round and
its inner optimizer moments are its own and cannot be checked by anyone, so they
are not sent (docs/security.md, "State transfer").

Layout (little-endian): an 8-byte magic, the round (int64), the number of
values (uint64), a flags byte (bit 0: momentum follows), then the anchor as
float32 values and, if flagged, the momentum as float32 values. The size of a
valid blob is fixed by the stage's parameter count, so a reader knows its bound
before it allocates anything.

`decode` never trusts the sender: any mismatch raises StateFormatError.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

MAGIC = b"AGSTATE1"
_HEADER = struct.Struct("<8sqQB")
HEADER_BYTES = _HEADER.size
MAX_ROUND = 1 << 53
DIGEST_CHARS = 32
"""Digests are the first 32 hex characters of a sha256 (as OuterState.digest)."""


class StateFormatError(ValueError):
    """A state blob that must not be adopted (malformed, wrong size, non-finite)."""


@dataclass(frozen=True)
class AnchorState:
    round: int
    anchor: Tensor
    momentum: Tensor | None

    def digests(self) -> tuple[str, str | None]:
        """(anchor digest, anchor+momentum digest or None without momentum)."""
        return digests(self.anchor, self.momentum)


def max_bytes(numel: int) -> int:
    """The size of the largest valid blob for a stage of `numel` trainable values."""
    return HEADER_BYTES + 2 * 4 * numel


def digests(anchor: Tensor, momentum: Tensor | None) -> tuple[str, str | None]:
    """sha256 of the anchor's float32 bytes, and of anchor then momentum (as
    OuterState.digest() and digest(with_momentum=True) compute them)."""
    h = hashlib.sha256(_f32_bytes(anchor))
    anchor_digest = h.hexdigest()[:DIGEST_CHARS]
    if momentum is None:
        return anchor_digest, None
    h.update(_f32_bytes(momentum))
    return anchor_digest, h.hexdigest()[:DIGEST_CHARS]


def _f32_bytes(t: Tensor) -> bytes:
    return t.detach().float().contiguous().numpy().tobytes()


def encode(round_no: int, anchor: Tensor, momentum: Tensor | None) -> bytes:
    if momentum is not None and momentum.numel() != anchor.numel():
        raise ValueError("anchor and momentum differ in size")
    parts = [_HEADER.pack(MAGIC, round_no, anchor.numel(), int(momentum is not None))]
    parts.append(_f32_bytes(anchor))
    if momentum is not None:
        parts.append(_f32_bytes(momentum))
    return b"".join(parts)


def decode(blob: bytes, numel: int) -> AnchorState:
    """The anchor state in `blob` for a stage of `numel` trainable values; raises
    StateFormatError unless it is exactly well formed and every value finite."""
    if not isinstance(blob, bytes | bytearray | memoryview):
        raise StateFormatError(f"state is {type(blob).__name__}, not bytes")
    view = memoryview(blob)
    if len(view) < HEADER_BYTES:
        raise StateFormatError(f"state of {len(view)} bytes is shorter than its header")
    magic, round_no, count, flags = _HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise StateFormatError("not an agora state blob (bad magic)")
    if not 0 <= round_no <= MAX_ROUND:
        raise StateFormatError(f"implausible round {round_no}")
    if count != numel:
        raise StateFormatError(f"state has {count} values, this stage {numel}")
    if flags not in (0, 1):
        raise StateFormatError(f"unknown flags {flags}")
    expected = HEADER_BYTES + 4 * numel * (1 + flags)
    if len(view) != expected:
        raise StateFormatError(f"state is {len(view)} bytes, expected {expected}")
    anchor = _finite(view, HEADER_BYTES, numel, "anchor")
    momentum = _finite(view, HEADER_BYTES + 4 * numel, numel, "momentum") if flags else None
    return AnchorState(round_no, anchor, momentum)


def _finite(view: memoryview, offset: int, count: int, what: str) -> Tensor:
    values = np.frombuffer(view, dtype="<f4", count=count, offset=offset).astype(np.float32)
    if not np.isfinite(values).all():
        raise StateFormatError(f"{what} has non-finite values")
    return torch.from_numpy(values)
