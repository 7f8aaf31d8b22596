"""TOPK4, the sparse codec: what it keeps, how it frames, what the decoder refuses, and that
error feedback re-sends what it dropped."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch

from agora_node.comms.collective.payload import decode_span, slice_quantized
from agora_node.comms.collective.plan import span_bounds
from agora_node.compression import (
    Codec,
    CodecError,
    ErrorFeedback,
    decode_frame,
    dequantize,
    encode_frame,
    quantize,
    relative_error,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("block", [128, 256])
def test_each_block_keeps_its_largest_sixty_fourth_within_half_a_step(block: int) -> None:
    x = torch.randn(10 * block + 37, generator=torch.Generator().manual_seed(1))
    q = quantize(x, Codec.TOPK4, block=block)
    got = dequantize(q)
    kept = block // 64
    padded = torch.cat((x, x.new_zeros(-x.numel() % block))).reshape(-1, block)
    for b, row in enumerate(padded):
        top = set(row.abs().topk(kept).indices.tolist())
        positions = q.indices[b * kept : (b + 1) * kept].tolist()
        assert set(positions) == top and positions == sorted(positions)
    flat = torch.zeros_like(padded)
    flat.view(-1)[: x.numel()] = got
    mask = flat != 0
    scale = q.scales.repeat_interleave(block).reshape(-1, block)
    assert bool(((flat - padded).abs()[mask] <= scale[mask] / 2 + 1e-7).all())
    assert int(mask.sum()) <= kept * padded.shape[0]


def test_frame_round_trip_and_size() -> None:
    x = torch.randn(1 << 16)
    q = quantize(x, Codec.TOPK4, block=256)
    frame = encode_frame(q, zstd=False)
    back = decode_frame(frame)
    assert torch.equal(dequantize(back), dequantize(q))
    # per block of 256: a bfloat16 scale, 4 positions, 4 int4 values = 8 bytes
    assert q.scales.dtype == torch.bfloat16
    assert len(frame) - 64 < 8 * (1 << 16) // 256 <= len(frame)
    assert len(frame) * 125 < 4 * x.numel()  # over 125x fewer bytes than float32


def test_bfloat16_scales_cost_a_sparse_encoding_almost_nothing() -> None:
    """Rounded up, a bfloat16 scale moves each kept value by at most 2**-8 of the block's
    largest (next to int4's half step of 1/14): the error barely changes."""
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(2))
    narrow = dequantize(quantize(x, Codec.TOPK4, block=256))
    wide = dequantize(quantize(x, Codec.TOPK4, block=256, scale_dtype=torch.float32))
    assert torch.equal(narrow != 0, wide != 0)  # the same positions
    assert relative_error(x, narrow) < relative_error(x, wide) * 1.001


def _reseal(frame: bytes, payload: bytes) -> bytes:
    """`frame` with its payload replaced and the checksum recomputed (a peer's own frame)."""
    head_len = len(frame) - len(payload) - 4
    head = frame[:head_len]
    return head + struct.pack("<I", zlib.crc32(payload, zlib.crc32(head))) + payload


def test_positions_out_of_order_or_repeated_are_refused() -> None:
    q = quantize(torch.randn(512), Codec.TOPK4, block=256)
    frame = encode_frame(q, zstd=False)
    scales = 2 * 2  # two blocks' bfloat16 scales
    payload = bytearray(frame[-(scales + 8 + 4) :])
    for bad in ([3, 3, 5, 9], [9, 5, 3, 1]):
        edited = bytes(payload[:scales]) + bytes(bad) + bytes(payload[scales + 4 :])
        with pytest.raises(CodecError, match="increasing"):
            decode_frame(_reseal(frame, edited))


def test_a_sparse_frame_with_another_block_or_a_rotation_is_refused() -> None:
    with pytest.raises(ValueError, match="blocks of"):
        quantize(torch.randn(512), Codec.TOPK4, block=64)
    with pytest.raises(ValueError, match="not rotated"):
        quantize(torch.randn(512), Codec.TOPK4, block=256, seed=3)
    frame = bytearray(encode_frame(quantize(torch.randn(512), Codec.TOPK4, block=256)))
    frame[9:13] = struct.pack("<I", 64)  # claim block 64 (the checksum then fails first)
    with pytest.raises(CodecError):
        decode_frame(bytes(frame))


def test_spans_cut_on_block_boundaries_decode_to_slices_of_the_whole() -> None:
    x = torch.randn(10_000)
    q = quantize(x, Codec.TOPK4, block=256)
    whole = dequantize(q)
    for lo, hi in span_bounds(x.numel(), 3, 256):
        part = decode_span(encode_frame(slice_quantized(q, lo, hi)), hi - lo)
        assert torch.equal(part, whole[lo:hi])


def test_error_feedback_sends_everything_eventually() -> None:
    """The sum of what was sent equals the sum of the inputs minus one residual, and the
    residual stays bounded, so the mean of what was sent converges to the mean input."""
    ef = ErrorFeedback(Codec.TOPK4, block=256, seed=None)
    g = torch.Generator().manual_seed(0)
    target = torch.randn(4096, generator=g)
    sent = torch.zeros_like(target)
    errors = []
    for r in range(1, 401):
        x = target + 0.1 * torch.randn(4096, generator=g)
        sent += dequantize(ef.compress("delta", x))
        if r in (200, 400):
            errors.append(float((sent / r - target).norm() / target.norm()))
    # the residual is what is still owed: bounded, so the mean error falls like 1 / rounds
    assert float(ef.residual("delta").norm()) < 40 * float(target.norm())  # ~28 measured
    assert errors[1] < 0.6 * errors[0] and errors[1] < 0.1, errors  # 0.137, 0.069 measured
