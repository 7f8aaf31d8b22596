"""What travels in a collective: framed spans of a flat float32 vector.

A contribution is encoded once for the whole flat vector (so error feedback keeps
one residual per stage whatever the group's span cut is this round), then cut into
span parts along quantization-block boundaries: a slice of whole blocks of a
`QuantizedTensor` is itself a valid `QuantizedTensor`, so no value is encoded twice.

Results (a reducer's aggregate of its span) are framed without error feedback:
every member, the reducer included, uses the *decoded* frame, so all of them hold
bit-identical values whatever the codec.

Decoding is strict: a frame must be exactly a float32 span of the expected length,
finite, and no larger than the float32 encoding plus headers; anything else is a
CodecError that the caller counts and drops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from agora_node.compression import (
    Codec,
    CodecError,
    ErrorFeedback,
    QuantizedTensor,
    decode_frame,
    dequantize,
    encode_frame,
    quantize_with_fallback,
)

FRAME_OVERHEAD = 64  # tensor frame header + crc for a 1-d tensor, with margin
EF_NAME = "flat"


@dataclass(frozen=True, kw_only=True)
class WireFormat:
    """How one phase's contributions and results are encoded."""

    part: Codec = Codec.FP32
    result: Codec = Codec.FP32
    block: int = 256
    seed: int | None = 0
    """Hadamard rotation seed for quantized codecs (None: no rotation)."""
    error_feedback: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "part", Codec(self.part))
        object.__setattr__(self, "result", Codec(self.result))

    def bits(self, codec: Codec) -> float:
        """Approximate bits per value on the wire (before zstd), for deadline estimates."""
        if codec.is_sparse:  # a position byte and an int4 value per kept value, and a scale
            return (codec.kept(self.block) * 12.0 + 32.0) / self.block
        return {Codec.FP32: 32.0, Codec.BF16: 16.0, Codec.INT8: 8.0, Codec.INT4: 4.0}[codec] + (
            32.0 / self.block if codec.is_quantized else 0.0
        )


def plain_format() -> WireFormat:
    """Uncompressed float32 both ways: the exact-DiLoCo setting."""
    return WireFormat()


class PartEncoder:
    """Encodes a member's contribution into span frames (with error feedback if enabled)."""

    def __init__(self, fmt: WireFormat) -> None:
        self.fmt = fmt
        self.feedback = (
            ErrorFeedback(fmt.part, block=fmt.block, seed=fmt.seed) if fmt.error_feedback else None
        )

    def encode(self, flat: Tensor, spans: tuple[tuple[int, int], ...]) -> list[bytes]:
        flat = flat.detach().reshape(-1).float()
        if self.feedback is not None:
            q = self.feedback.compress(EF_NAME, flat)
        else:
            q, _ = quantize_with_fallback(
                flat, self.fmt.part, block=self.fmt.block, seed=self.fmt.seed
            )
        return [encode_frame(slice_quantized(q, lo, hi)) for lo, hi in spans]

    def reset(self) -> None:
        """Forget the residual (e.g. after the weights were replaced by a state transfer)."""
        if self.feedback is not None:
            self.feedback.reset()

    def take_residual(self) -> Tensor | None:
        """What the last encodings left out (flat, float32), forgotten here: the caller
        keeps it elsewhere. None without error feedback or before any encoding."""
        if self.feedback is None:
            return None
        residual = self.feedback.residual(EF_NAME)
        self.feedback.reset()
        return residual


def slice_quantized(q: QuantizedTensor, lo: int, hi: int) -> QuantizedTensor:
    """Elements [lo, hi) of a flat encoded tensor; lo must be on a block boundary."""
    n = hi - lo
    if not q.codec.is_quantized:
        return QuantizedTensor(q.codec, (n,), q.dtype, q.data[lo:hi].clone())
    if lo % q.block:
        raise ValueError(f"span start {lo} is not a multiple of block {q.block}")
    b0, nblocks = lo // q.block, -(-n // q.block)
    scales = q.scales[b0 : b0 + nblocks].clone()
    if q.codec.is_sparse:  # whole blocks of positions and of int4 values (kept is even)
        k = q.codec.kept(q.block)
        indices = q.indices[b0 * k : (b0 + nblocks) * k].clone()
        data = q.data[b0 * k // 2 : (b0 + nblocks) * k // 2].clone()
        return QuantizedTensor(q.codec, (n,), q.dtype, data, q.block, q.seed, scales, indices)
    values = nblocks * q.block
    if q.codec is Codec.INT4:
        data = q.data[lo // 2 : lo // 2 + (values + 1) // 2]
    else:
        data = q.data[lo : lo + values]
    return QuantizedTensor(q.codec, (n,), q.dtype, data.clone(), q.block, q.seed, scales)


def encode_result(value: Tensor, fmt: WireFormat) -> bytes:
    q, _ = quantize_with_fallback(
        value.reshape(-1).float(), fmt.result, block=fmt.block, seed=fmt.seed
    )
    return encode_frame(q)


def max_frame_bytes(numel: int) -> int:
    """No honest frame of `numel` values is larger than its float32 encoding plus a header."""
    return 4 * numel + FRAME_OVERHEAD


ROTATION_SEEDS = (0, None)
"""The rotations a peer's quantized frame may use: the daemons' (OuterConfig.rotation_seed)
or none (sparse codecs). Each other (seed, block) costs a sign vector of up to 4 MiB in
compression/hadamard.py's cache (64 kept) and a slower decode."""


def decode_span(
    data: bytes | bytearray | memoryview, numel: int, *, block: int | None = None
) -> Tensor:
    """Strictly decode a frame that must hold exactly `numel` finite float32 values; with
    `block` (a peer's frame: the plan's), a quantized one in blocks of that size and a
    rotation of ROTATION_SEEDS. Before, a group member chose both: 64 frames of distinct
    seeds in blocks of 2^20 pinned 256 MiB of sign vectors and decoded 2.4x slower."""
    limit = max_frame_bytes(numel)
    if len(data) > limit:
        raise CodecError(f"frame of {len(data)} bytes exceeds {limit} for {numel} values")
    q = decode_frame(data, max_bytes=limit, expected_shape=(numel,))
    if q.dtype != torch.float32:
        raise CodecError(f"frame dtype {q.dtype} is not float32")
    foreign = q.block != block or q.seed not in ROTATION_SEEDS
    if block is not None and q.codec.is_quantized and foreign:
        raise CodecError(f"blocks of {q.block}, rotation {q.seed}: expected blocks of {block}")
    value = dequantize(q)
    if not bool(torch.isfinite(value).all()):
        raise CodecError("decoded values are not all finite")
    return value
