"""The codec registry: every value codec, its wire id and the name people write.

The manifest (`outer.codec`), the CLI (`--activation-codec`), the activation codec and
the outer wire all take a codec by name and resolve it here, so a new codec is added
in one place. Pure data, no torch: the tensor work lives in agora_node.compression,
which re-exports `Codec`.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Literal, get_args


class Codec(IntEnum):
    """How a tensor's values are stored; the integer is the wire id."""

    FP32 = 1
    BF16 = 2
    INT8 = 3
    INT4 = 4
    TOPK4 = 5
    """Sparse: the largest 1/64 of each block's values (by magnitude), at their positions,
    in int4. For pseudo-gradients with error feedback (what is not sent now is sent later);
    blocks of 128 or 256 values, never rotated."""

    @property
    def qmax(self) -> int:
        return {Codec.INT8: 127, Codec.INT4: 7, Codec.TOPK4: 7}[self]

    @property
    def is_quantized(self) -> bool:
        """Values stored as integers with one scale per block."""
        return self in (Codec.INT8, Codec.INT4, Codec.TOPK4)

    @property
    def is_sparse(self) -> bool:
        """Only some values of each block are stored, with their positions."""
        return self is Codec.TOPK4

    def kept(self, block: int) -> int:
        """Values stored per block: all of them, or for a sparse codec 1/64 of them."""
        return block // SPARSE_FRACTION if self.is_sparse else block

    @property
    def label(self) -> str:
        """The name used in manifests, flags and activation modes, e.g. "int8"."""
        return self.name.lower()


SPARSE_FRACTION = 64
"""A sparse codec keeps one value in this many."""
SPARSE_BLOCKS = (128, 256)
"""Block sizes a sparse codec takes: a position fits one byte, and an even count of kept
values fills whole bytes of int4."""

CodecName = Literal["fp32", "bf16", "int8", "int4", "topk4"]
CODEC_NAMES: tuple[CodecName, ...] = get_args(CodecName)
"""Every codec name, in order of precision (most precise first)."""

# Fails at import if a name has no enum member.
_BY_NAME: dict[str, Codec] = {name: Codec[name.upper()] for name in CODEC_NAMES}

DENSE_CODEC_NAMES: tuple[CodecName, ...] = tuple(
    n for n in CODEC_NAMES if not _BY_NAME[n].is_sparse
)
"""The codecs that keep every value (what boundary activations and anchors may use)."""


class UnknownCodecError(ValueError):
    """A codec name that is not in the registry; the message lists the valid ones."""

    def __init__(
        self, name: object, *, what: str = "codec", allowed: tuple[str, ...] = CODEC_NAMES
    ) -> None:
        super().__init__(f"{what} must be one of {', '.join(allowed)}, not {name!r}")
        self.name = name


def from_name(name: str, *, what: str = "codec", allowed: tuple[str, ...] = CODEC_NAMES) -> Codec:
    """The codec called `name` (one of `allowed`); raises UnknownCodecError otherwise.

    `what` names the setting in the error, e.g. "--activation-codec".
    """
    if isinstance(name, str) and name in allowed:
        return _BY_NAME[name]
    raise UnknownCodecError(name, what=what, allowed=allowed)
