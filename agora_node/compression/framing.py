"""Self-describing, strictly checked wire frames for encoded tensors and dicts of them.

Tensor frame (little-endian):

    off  size  field
    0    4     magic b"AGQT"
    4    1     version (1)
    5    1     codec id (quant.Codec)
    6    1     original dtype id: 1 float32, 2 float16, 3 bfloat16
    7    1     flags: 1 payload is zstd, 2 Hadamard-rotated, 4 bfloat16 scales
    8    1     ndim (<= 8)
    9    4     block size (0 for FP32/BF16)
    13   8     rotation seed (0 unless rotated)
    21   8     payload length on the wire
    29   8*nd  shape
    ..   4     crc32 of everything before it and of the payload
    ..         payload: scales (one per block, quantized codecs), positions (sparse codecs:
               u8 per kept value, increasing within each block) then values

zstd (level 1) is applied only when it shrinks the payload by at least 5%.

Dict frame: magic b"AGQD", version, u32 count, then per entry u16 name length, utf-8 name,
u64 frame length, tensor frame; then a crc32 of everything before it.

Decoding trusts nothing: any inconsistency, a size over the caller's limit, or a non-finite
decoded value raises CodecError, the only exception a decoder lets out.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Mapping

import numpy as np
import torch
import zstandard

from agora_node.compression.errors import CodecError, NonFiniteError
from agora_node.compression.quant import Codec, QuantizedTensor, dequantize
from agora_node.protocol.codecs import SPARSE_BLOCKS

VERSION = 1
DEFAULT_MAX_BYTES = 1 << 30
MAX_NDIM = 8
MAX_BLOCK = 1 << 20
MAX_DIM = 1 << 40  # per dimension; an empty tensor could otherwise claim a 2**64 - 1 dim
MAX_NAME_BYTES = 1024

FLAG_ZSTD = 1
FLAG_ROTATED = 2
FLAG_BF16_SCALES = 4
_KNOWN_FLAGS = FLAG_ZSTD | FLAG_ROTATED | FLAG_BF16_SCALES

_TENSOR_MAGIC = b"AGQT"
_DICT_MAGIC = b"AGQD"
_FIXED = struct.Struct("<4sBBBBBIQQ")
_CRC = struct.Struct("<I")
_DICT_HEAD = struct.Struct("<4sBI")
_NAME_LEN = struct.Struct("<H")
_FRAME_LEN = struct.Struct("<Q")
_MASK64 = (1 << 64) - 1

_DTYPE_IDS = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_DTYPES = {v: k for k, v in _DTYPE_IDS.items()}

Buffer = bytes | bytearray | memoryview


def encode_frame(q: QuantizedTensor, *, zstd: bool = True) -> bytes:
    """Serialize one encoded tensor; zstd only where it pays (see `zstd_pays`)."""
    raw = _payload_bytes(q)
    expected = payload_size(q.codec, q.numel, q.block, _scale_width(q))
    if len(raw) != expected:
        raise ValueError(
            f"inconsistent QuantizedTensor: {len(raw)} payload bytes, expected {expected}"
        )
    flags = 0
    if zstd and raw:
        packed = zstandard.ZstdCompressor(level=1).compress(raw)
        if zstd_pays(len(raw), len(packed)):
            raw, flags = packed, FLAG_ZSTD
    if q.seed is not None:
        flags |= FLAG_ROTATED
    if q.scales is not None and q.scales.dtype == torch.bfloat16:
        flags |= FLAG_BF16_SCALES
    seed = 0 if q.seed is None else q.seed & _MASK64
    fixed = _FIXED.pack(
        _TENSOR_MAGIC, VERSION, int(q.codec), _DTYPE_IDS[q.dtype], flags, len(q.shape),
        q.block, seed, len(raw),
    )  # fmt: skip
    head = fixed + struct.pack(f"<{len(q.shape)}Q", *q.shape)
    return head + _CRC.pack(zlib.crc32(raw, zlib.crc32(head))) + raw


def decode_frame(
    data: Buffer,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    expected_shape: tuple[int, ...] | None = None,
) -> QuantizedTensor:
    """Parse and validate one tensor frame without dequantizing it.

    max_bytes bounds both the frame and its decompressed payload (so the decoded float32
    tensor is at most ~8x max_bytes). expected_shape, when given, must match exactly.
    """
    q, _ = _parse_frame(memoryview(data), max_bytes, expected_shape)
    return q


def decode_tensor(
    data: Buffer,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    expected_shape: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Parse, validate and dequantize one tensor frame; the result is finite."""
    return _finite(
        dequantize(decode_frame(data, max_bytes=max_bytes, expected_shape=expected_shape))
    )


def encode_dict(items: Mapping[str, QuantizedTensor], *, zstd: bool = True) -> bytes:
    """Serialize named encoded tensors (names: non-empty utf-8, at most 1024 bytes)."""
    parts = [_DICT_HEAD.pack(_DICT_MAGIC, VERSION, len(items))]
    for name, q in items.items():
        raw_name = name.encode("utf-8")
        if not 0 < len(raw_name) <= MAX_NAME_BYTES:
            raise ValueError(f"tensor name must be 1..{MAX_NAME_BYTES} utf-8 bytes: {name!r}")
        frame = encode_frame(q, zstd=zstd)
        parts += [_NAME_LEN.pack(len(raw_name)), raw_name, _FRAME_LEN.pack(len(frame)), frame]
    body = b"".join(parts)
    return body + _CRC.pack(zlib.crc32(body))


def decode_dict(
    data: Buffer,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    expected_shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> dict[str, torch.Tensor]:
    """Inverse of `encode_dict`. expected_shapes, when given, must name exactly the entries.

    max_bytes bounds the whole frame and the sum of all decompressed payloads.
    """
    mv = memoryview(data)
    _check_len(len(mv), max_bytes)
    if len(mv) < _DICT_HEAD.size + _CRC.size:
        raise CodecError(f"dict frame truncated: {len(mv)} bytes")
    body, (crc,) = mv[: -_CRC.size], _CRC.unpack(mv[-_CRC.size :])
    if zlib.crc32(body) != crc:
        raise CodecError("dict frame checksum mismatch (corrupted or truncated)")
    magic, version, count = _DICT_HEAD.unpack(body[: _DICT_HEAD.size])
    if magic != _DICT_MAGIC:
        raise CodecError(f"not a dict frame (magic {bytes(magic)!r})")
    if version != VERSION:
        raise CodecError(f"unsupported dict frame version {version}")
    out, pos, budget = {}, _DICT_HEAD.size, max_bytes
    for _ in range(count):
        name, frame, pos = _read_entry(body, pos)
        if name in out:
            raise CodecError(f"duplicate tensor name {name!r}")
        shape = None if expected_shapes is None else expected_shapes.get(name)
        if expected_shapes is not None and shape is None:
            raise CodecError(f"unexpected tensor name {name!r}")
        q, raw_len = _parse_frame(frame, budget, shape)
        budget -= raw_len
        out[name] = _finite(dequantize(q), name)
    if pos != len(body):
        raise CodecError(f"dict frame has {len(body) - pos} trailing bytes")
    if expected_shapes is not None and out.keys() != expected_shapes.keys():
        raise CodecError(f"missing tensors: {sorted(set(expected_shapes) - set(out))}")
    return out


def zstd_pays(raw_len: int, packed_len: int) -> bool:
    """True when compression saves at least 5% of the payload."""
    return packed_len * 20 <= raw_len * 19


def payload_size(codec: Codec, numel: int, block: int, scale_width: int) -> int:
    """Bytes of the uncompressed payload for these header fields."""
    if codec is Codec.FP32:
        return 4 * numel
    if codec is Codec.BF16:
        return 2 * numel
    nblocks = -(-numel // block)
    if codec.is_sparse:  # positions, then int4 values (a whole number of bytes per block)
        kept = codec.kept(block)
        return nblocks * (scale_width + kept + kept // 2)
    values = nblocks * block
    return nblocks * scale_width + (values if codec is Codec.INT8 else (values + 1) // 2)


def _parse_frame(
    mv: memoryview, max_bytes: int, expected_shape: tuple[int, ...] | None
) -> tuple[QuantizedTensor, int]:
    _check_len(len(mv), max_bytes)
    if len(mv) < _FIXED.size:
        raise CodecError(f"frame truncated: {len(mv)} bytes, header needs {_FIXED.size}")
    magic, version, codec_id, dtype_id, flags, ndim, block, seed, wire_len = _FIXED.unpack(
        mv[: _FIXED.size]
    )
    if magic != _TENSOR_MAGIC:
        raise CodecError(f"not a tensor frame (magic {bytes(magic)!r})")
    if version != VERSION:
        raise CodecError(f"unsupported frame version {version}")
    if ndim > MAX_NDIM:
        raise CodecError(f"ndim {ndim} exceeds {MAX_NDIM}")
    head_len = _FIXED.size + 8 * ndim
    if len(mv) != head_len + _CRC.size + wire_len:
        raise CodecError(f"frame is {len(mv)} bytes, header says {head_len + _CRC.size + wire_len}")
    (crc,) = _CRC.unpack(mv[head_len : head_len + _CRC.size])
    payload = mv[head_len + _CRC.size :]
    if zlib.crc32(payload, zlib.crc32(mv[:head_len])) != crc:
        raise CodecError("frame checksum mismatch (corrupted)")
    shape = struct.unpack(f"<{ndim}Q", mv[_FIXED.size : head_len])
    codec = _check_fields(codec_id, dtype_id, flags, block, seed)
    if any(d > MAX_DIM for d in shape):
        raise CodecError(f"shape {shape} has a dimension over {MAX_DIM}")
    if expected_shape is not None and tuple(shape) != tuple(expected_shape):
        raise CodecError(f"shape {shape} != expected {tuple(expected_shape)}")
    scale_width = 2 if flags & FLAG_BF16_SCALES else 4
    raw_len = payload_size(codec, math.prod(shape), block, scale_width)
    if raw_len > max_bytes:
        raise CodecError(f"payload of {raw_len} bytes exceeds limit {max_bytes}")
    raw = _unpack_payload(payload, raw_len, bool(flags & FLAG_ZSTD))
    q = _build(
        codec,
        shape,
        _DTYPES[dtype_id],
        block,
        seed if flags & FLAG_ROTATED else None,
        raw,
        scale_width,
    )
    return q, raw_len


def _check_fields(codec_id: int, dtype_id: int, flags: int, block: int, seed: int) -> Codec:
    if codec_id not in Codec._value2member_map_:
        raise CodecError(f"unknown codec id {codec_id}")
    codec = Codec(codec_id)
    if dtype_id not in _DTYPES:
        raise CodecError(f"unknown dtype id {dtype_id}")
    if flags & ~_KNOWN_FLAGS:
        raise CodecError(f"unknown flags {flags:#x}")
    if not codec.is_quantized:
        if block or seed or flags & (FLAG_ROTATED | FLAG_BF16_SCALES):
            raise CodecError(f"{codec.name} frame carries block/rotation/scale fields")
        return codec
    if not 1 <= block <= MAX_BLOCK:
        raise CodecError(f"block size {block} outside 1..{MAX_BLOCK}")
    if flags & FLAG_ROTATED and block & (block - 1):
        raise CodecError(f"rotated frame with non-power-of-two block {block}")
    if codec.is_sparse and (block not in SPARSE_BLOCKS or flags & FLAG_ROTATED):
        raise CodecError(f"{codec.label} frame needs a block of {SPARSE_BLOCKS}, not rotated")
    if seed and not flags & FLAG_ROTATED:
        raise CodecError("seed set on a frame that is not rotated")
    return codec


def _unpack_payload(payload: memoryview, raw_len: int, compressed: bool) -> bytes | memoryview:
    if not compressed:
        if len(payload) != raw_len:
            raise CodecError(f"payload is {len(payload)} bytes, shape implies {raw_len}")
        return payload
    try:
        # Check the declared size first: the zstd library allocates whatever a frame declares.
        declared = zstandard.frame_content_size(payload)
        if declared != raw_len:
            raise CodecError(f"zstd payload declares {declared} bytes, shape implies {raw_len}")
        raw = zstandard.ZstdDecompressor().decompress(payload, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CodecError(f"bad zstd payload: {exc}") from exc
    if len(raw) != raw_len:
        raise CodecError(f"zstd payload decoded to {len(raw)} bytes, shape implies {raw_len}")
    return raw


def _build(
    codec: Codec,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    block: int,
    seed: int | None,
    raw: bytes | memoryview,
    scale_width: int,
) -> QuantizedTensor:
    numel = math.prod(shape)
    if codec is Codec.FP32:
        return QuantizedTensor(codec, shape, dtype, _array(raw, "<f4", numel, 0))
    if codec is Codec.BF16:
        return QuantizedTensor(
            codec, shape, dtype, _array(raw, "<i2", numel, 0).view(torch.bfloat16)
        )
    nblocks = -(-numel // block)
    if scale_width == 2:
        scales = _array(raw, "<i2", nblocks, 0).view(torch.bfloat16)
    else:
        scales = _array(raw, "<f4", nblocks, 0)
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        # One kind for both: peers have always answered a negative scale as non_finite too.
        raise NonFiniteError("scales must be finite and non-negative")
    offset = nblocks * scale_width
    indices = None
    if codec.is_sparse:
        kept = codec.kept(block)
        indices = _array(raw, "<u1", nblocks * kept, offset)
        # Increasing within each block: one encoding per sparse vector, and no position twice.
        steps = indices.reshape(nblocks, kept).to(torch.int16).diff(dim=1)  # no uint8 wrap
        if not bool((steps > 0).all()):
            raise CodecError("sparse positions are not increasing within a block")
        offset += nblocks * kept
    count = len(raw) - offset
    data = _array(raw, "<i1" if codec is Codec.INT8 else "<u1", count, offset)
    return QuantizedTensor(codec, shape, dtype, data, block, seed, scales, indices)


def _array(raw: bytes | memoryview, np_dtype: str, count: int, offset: int) -> torch.Tensor:
    # astype makes a native-endian, writable, owned copy that torch can wrap without warnings.
    arr = np.frombuffer(raw, dtype=np_dtype, count=count, offset=offset)
    return torch.from_numpy(arr.astype(arr.dtype.newbyteorder("="), copy=True))


def _payload_bytes(q: QuantizedTensor) -> bytes:
    parts = []
    if q.scales is not None:
        parts.append(_to_le(q.scales))
    if q.indices is not None:
        parts.append(_to_le(q.indices))
    parts.append(_to_le(q.data))
    return b"".join(parts)


def _to_le(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().astype("<i2", copy=False).tobytes()
    arr = t.numpy()
    return arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()


def _scale_width(q: QuantizedTensor) -> int:
    return 0 if q.scales is None else q.scales.element_size()


def _read_entry(body: memoryview, pos: int) -> tuple[str, memoryview, int]:
    end = pos + _NAME_LEN.size
    if end > len(body):
        raise CodecError("dict frame truncated in an entry header")
    (name_len,) = _NAME_LEN.unpack(body[pos:end])
    if not 0 < name_len <= MAX_NAME_BYTES:
        raise CodecError(f"tensor name length {name_len} outside 1..{MAX_NAME_BYTES}")
    name_end = end + name_len
    frame_start = name_end + _FRAME_LEN.size
    if frame_start > len(body):
        raise CodecError("dict frame truncated in an entry header")
    try:
        name = bytes(body[end:name_end]).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CodecError("tensor name is not valid utf-8") from exc
    (frame_len,) = _FRAME_LEN.unpack(body[name_end:frame_start])
    if frame_start + frame_len > len(body):
        raise CodecError(f"entry {name!r} runs past the end of the dict frame")
    return name, body[frame_start : frame_start + frame_len], frame_start + frame_len


def _check_len(n: int, max_bytes: int) -> None:
    if n > max_bytes:
        raise CodecError(f"frame of {n} bytes exceeds limit {max_bytes}")


def _finite(t: torch.Tensor, name: str | None = None) -> torch.Tensor:
    if not bool(torch.isfinite(t).all()):
        where = f" in {name!r}" if name else ""
        raise NonFiniteError(f"decoded values{where} are not all finite")
    return t
