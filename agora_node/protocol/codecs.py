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

    @property
    def qmax(self) -> int:
        return {Codec.INT8: 127, Codec.INT4: 7}[self]

    @property
    def is_quantized(self) -> bool:
        return self in (Codec.INT8, Codec.INT4)

    @property
    def label(self) -> str:
        """The name used in manifests, flags and activation modes, e.g. "int8"."""
        return self.name.lower()


CodecName = Literal["fp32", "bf16", "int8", "int4"]
CODEC_NAMES: tuple[CodecName, ...] = get_args(CodecName)
"""Every codec name, in order of precision (most precise first)."""

# Fails at import if a name has no enum member.
_BY_NAME: dict[str, Codec] = {name: Codec[name.upper()] for name in CODEC_NAMES}


class UnknownCodecError(ValueError):
    """A codec name that is not in the registry; the message lists the valid ones."""

    def __init__(self, name: object, *, what: str = "codec") -> None:
        super().__init__(f"{what} must be one of {', '.join(CODEC_NAMES)}, not {name!r}")
        self.name = name


def from_name(name: str, *, what: str = "codec") -> Codec:
    """The codec called `name` (one of CODEC_NAMES); raises UnknownCodecError otherwise.

    `what` names the setting in the error, e.g. "--activation-codec".
    """
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):  # TypeError: an unhashable value from a parsed file
        raise UnknownCodecError(name, what=what) from None
