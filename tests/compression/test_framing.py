"""Wire frames: round trips, zstd only when it pays, and strict rejection of bad input."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from agora_node.compression import (
    Codec,
    CodecError,
    NonFiniteError,
    QuantizedTensor,
    decode_dict,
    decode_frame,
    decode_tensor,
    dequantize,
    encode_dict,
    encode_frame,
    quantize,
)
from agora_node.compression.framing import FLAG_ZSTD, zstd_pays

from .samples import gaussian

pytestmark = pytest.mark.timeout(60)

FIXED = 29  # bytes before the shape, per the layout in framing.py


def head_len(frame: bytes) -> int:
    return FIXED + 8 * frame[8]


def refresh_crc(frame: bytes) -> bytes:
    """Re-seal an edited frame, as a malicious (not merely noisy) peer would."""
    n = head_len(frame)
    payload = frame[n + 4 :]
    return frame[:n] + struct.pack("<I", zlib.crc32(payload, zlib.crc32(frame[:n]))) + payload


def edit(frame: bytes, offset: int, fmt: str, value: int) -> bytes:
    b = bytearray(frame)
    struct.pack_into(fmt, b, offset, value)
    return refresh_crc(bytes(b))


def small_frame(codec: Codec = Codec.INT8, seed: int | None = 3) -> bytes:
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    return encode_frame(quantize(x, codec, block=8, seed=seed))


CASES = [
    (Codec.FP32, None),
    (Codec.BF16, None),
    (Codec.INT8, None),
    (Codec.INT8, 5),
    (Codec.INT4, None),
    (Codec.INT4, 5),
]


@pytest.mark.parametrize(("codec", "seed"), CASES)
@pytest.mark.parametrize("shape", [(1000,), (4, 33, 7), (), (0, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_matches_dequantize(
    codec: Codec, seed: int | None, shape: tuple, dtype: torch.dtype
) -> None:
    x = torch.randn(shape).to(dtype)
    q = quantize(x, codec, block=64, seed=seed)
    y = decode_tensor(encode_frame(q), expected_shape=shape)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, dequantize(q))


def test_bf16_scales_round_trip() -> None:
    q = quantize(gaussian(4096), Codec.INT4, block=32, scale_dtype=torch.bfloat16)
    back = decode_frame(encode_frame(q))
    assert back.scales.dtype == torch.bfloat16
    assert torch.equal(dequantize(back), dequantize(q))


def test_zstd_only_when_it_pays() -> None:
    assert zstd_pays(100, 95) and not zstd_pays(100, 96)
    sparse = torch.zeros(1 << 16)
    sparse[::97] = 1.0
    packed = encode_frame(quantize(sparse, Codec.INT8))
    uniform = torch.rand(1 << 16, generator=torch.Generator().manual_seed(0)) * 2 - 1
    noise = encode_frame(quantize(uniform, Codec.INT8, block=1 << 16))  # ~8 bits of entropy/byte
    assert packed[7] & FLAG_ZSTD and len(packed) < 0.2 * (1 << 16)
    assert not noise[7] & FLAG_ZSTD and len(noise) == head_len(noise) + 4 + 4 + (1 << 16)
    assert not encode_frame(quantize(sparse, Codec.INT8), zstd=False)[7] & FLAG_ZSTD
    assert torch.equal(decode_tensor(packed), sparse)


def test_every_truncation_is_rejected() -> None:
    frame = small_frame()
    for n in range(len(frame)):
        with pytest.raises(CodecError):
            decode_tensor(frame[:n])


def test_trailing_bytes_are_rejected() -> None:
    with pytest.raises(CodecError, match="header says"):
        decode_tensor(small_frame() + b"\0")


@pytest.mark.parametrize(("codec", "seed"), CASES)
def test_every_single_bit_flip_is_rejected(codec: Codec, seed: int | None) -> None:
    frame = small_frame(codec, seed)
    for bit in range(8 * len(frame)):
        b = bytearray(frame)
        b[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CodecError):
            decode_tensor(bytes(b))


@pytest.mark.parametrize(
    ("offset", "fmt", "value", "message"),
    [
        (0, "<B", ord("X"), "magic"),
        (4, "<B", 2, "version"),
        (5, "<B", 9, "unknown codec"),
        (6, "<B", 7, "unknown dtype"),
        (7, "<B", 0x40, "unknown flags"),
        (8, "<B", 9, "ndim"),
        (9, "<I", 0, "block size"),
        (9, "<I", 12, "non-power-of-two"),
        (FIXED, "<Q", 4, "shape implies"),  # shape product no longer matches the payload
        (FIXED, "<Q", 1 << 39, "exceeds limit"),
    ],
)
def test_resealed_bad_headers_are_rejected(offset: int, fmt: str, value: int, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        decode_tensor(edit(small_frame(), offset, fmt, value))


def test_empty_tensor_with_absurd_dimension_is_rejected() -> None:
    frame = encode_frame(quantize(torch.zeros(0, 3), Codec.FP32))
    with pytest.raises(CodecError, match="dimension"):
        decode_tensor(edit(frame, FIXED + 8, "<Q", (1 << 64) - 1))


def test_expected_shape_and_size_limits() -> None:
    frame = small_frame()
    assert decode_tensor(frame, expected_shape=(3, 5)).shape == (3, 5)
    with pytest.raises(CodecError, match="expected"):
        decode_tensor(frame, expected_shape=(5, 3))
    with pytest.raises(CodecError, match="exceeds limit"):
        decode_tensor(frame, max_bytes=len(frame) - 1)


def test_decompression_bomb_is_rejected() -> None:
    q = quantize(torch.zeros(4096), Codec.INT8)
    frame = encode_frame(q)
    assert frame[7] & FLAG_ZSTD
    n = head_len(frame)
    for payload in (
        zstandard.ZstdCompressor(level=1).compress(bytes(50_000_000)),  # declares too much
        zstandard.ZstdCompressor(level=1, write_content_size=False).compress(bytes(4096 + 64)),
        b"not zstd at all",
    ):
        forged = bytearray(frame[: n + 4] + payload)
        struct.pack_into("<Q", forged, 21, len(payload))
        with pytest.raises(CodecError, match="zstd"):
            decode_tensor(refresh_crc(bytes(forged)))


def forged(
    codec: Codec, data: torch.Tensor, scales: torch.Tensor | None = None, dtype=torch.float32
) -> bytes:
    block = 0 if scales is None else data.numel() // scales.numel()
    return encode_frame(QuantizedTensor(codec, (data.numel(),), dtype, data, block, None, scales))


@pytest.mark.parametrize(
    "frame",
    [
        forged(Codec.FP32, torch.tensor([1.0, float("nan"), 2.0, 3.0])),
        forged(Codec.BF16, torch.tensor([1.0, float("inf")]).bfloat16()),
        forged(Codec.INT8, torch.ones(4, dtype=torch.int8), torch.tensor([float("nan")])),
        forged(Codec.INT8, torch.ones(4, dtype=torch.int8), torch.tensor([-1.0])),
        forged(
            Codec.INT8, torch.full((4,), 127, dtype=torch.int8), torch.tensor([3e38])
        ),  # overflows
        forged(Codec.FP32, torch.tensor([1e6]), dtype=torch.float16),  # overflows float16
    ],
    ids=["nan", "inf-bf16", "nan-scale", "negative-scale", "overflow", "overflow-fp16"],
)
def test_non_finite_payloads_are_rejected(frame: bytes) -> None:
    # Its own kind: a peer answers it with the non_finite wire code, not bad_payload.
    with pytest.raises(NonFiniteError, match="finite"):
        decode_tensor(frame)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_are_rejected(data: bytes) -> None:
    with pytest.raises(CodecError):
        decode_tensor(data)
    with pytest.raises(CodecError):
        decode_dict(data)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 60), st.integers(0, 255), st.sampled_from(CASES))
def test_resealed_random_edits_decode_or_raise_codec_error(
    pos: int, value: int, case: tuple
) -> None:
    frame = bytearray(small_frame(*case))
    frame[pos % len(frame)] = value
    try:
        y = decode_tensor(refresh_crc(bytes(frame)), max_bytes=1 << 20)
    except CodecError:
        return
    assert bool(torch.isfinite(y).all())


def sample_dict() -> dict[str, QuantizedTensor]:
    return {
        "blocks.0.attn.weight": quantize(torch.randn(64, 32), Codec.INT4, seed=1),
        "blocks.0.mlp.bias": quantize(torch.randn(32), Codec.FP32),
        "emb.ünï": quantize(torch.zeros(10, 10), Codec.INT8),
    }


def test_dict_round_trip() -> None:
    items = sample_dict()
    out = decode_dict(encode_dict(items), expected_shapes={k: q.shape for k, q in items.items()})
    assert list(out) == list(items)
    for name, q in items.items():
        assert torch.equal(out[name], dequantize(q))


def test_dict_expected_names_are_enforced() -> None:
    items = sample_dict()
    data = encode_dict(items)
    shapes = {k: q.shape for k, q in items.items()}
    with pytest.raises(CodecError, match="missing"):
        decode_dict(data, expected_shapes={**shapes, "extra": (1,)})
    with pytest.raises(CodecError, match="unexpected"):
        decode_dict(data, expected_shapes={k: v for k, v in shapes.items() if k != "emb.ünï"})
    with pytest.raises(CodecError, match="expected"):
        decode_dict(data, expected_shapes={**shapes, "blocks.0.mlp.bias": (31,)})


def test_dict_corruption_truncation_and_budget() -> None:
    data = encode_dict(sample_dict())
    for n in range(0, len(data), 7):
        with pytest.raises(CodecError):
            decode_dict(data[:n])
    flipped = bytearray(data)
    flipped[12] ^= 0x10
    with pytest.raises(CodecError, match="checksum"):
        decode_dict(bytes(flipped))
    with pytest.raises(CodecError, match="exceeds limit"):
        decode_dict(data, max_bytes=len(data) + 10)  # the decompressed payloads do not fit


def reseal_dict(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def test_dict_duplicate_and_malformed_names() -> None:
    frame = small_frame()
    entry = struct.pack("<H", 1) + b"w" + struct.pack("<Q", len(frame)) + frame
    dup = reseal_dict(b"AGQD" + struct.pack("<BI", 1, 2) + entry + entry)
    with pytest.raises(CodecError, match="duplicate"):
        decode_dict(dup)
    bad_name = reseal_dict(b"AGQD" + struct.pack("<BI", 1, 1) + entry.replace(b"w", b"\xff", 1))
    with pytest.raises(CodecError, match="utf-8"):
        decode_dict(bad_name)
    extra = reseal_dict(b"AGQD" + struct.pack("<BI", 1, 1) + entry + b"junk")
    with pytest.raises(CodecError, match="trailing"):
        decode_dict(extra)
    with pytest.raises(ValueError):
        encode_dict({"": quantize(torch.zeros(1), Codec.FP32)})
