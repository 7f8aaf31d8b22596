"""Span frames: one encoding cut along block boundaries, strict decoding."""

import struct

import pytest
import torch

from agora_node.comms.collective import PartEncoder, WireFormat
from agora_node.comms.collective.payload import decode_span, max_frame_bytes, slice_quantized
from agora_node.comms.collective.plan import span_bounds
from agora_node.compression import (
    Codec,
    CodecError,
    QuantizedTensor,
    dequantize,
    encode_frame,
    quantize,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("codec", list(Codec))
def test_span_slices_decode_to_slices_of_the_whole(codec: Codec) -> None:
    x = torch.randn(10_000)
    if codec.is_quantized:
        q = quantize(x, codec, block=256, seed=None if codec.is_sparse else 7)
    else:
        q = quantize(x, codec)
    whole = dequantize(q)
    for lo, hi in span_bounds(x.numel(), 3, 256):
        part = decode_span(encode_frame(slice_quantized(q, lo, hi)), hi - lo)
        torch.testing.assert_close(part, whole[lo:hi], rtol=0, atol=0)


def test_encoder_with_error_feedback_keeps_one_residual_whatever_the_cut() -> None:
    enc = PartEncoder(WireFormat(part=Codec.INT4, error_feedback=True))
    x = torch.randn(5000)
    enc.encode(x, span_bounds(5000, 2, 256))
    enc.encode(x, span_bounds(5000, 5, 256))  # a different group size next round: no error
    assert enc.feedback.residual("flat").shape == x.shape


def fp32_frame(values: torch.Tensor, dtype: torch.dtype = torch.float32) -> bytes:
    flat = values.reshape(-1)
    return encode_frame(QuantizedTensor(Codec.FP32, tuple(values.shape), dtype, flat.float()))


@pytest.mark.parametrize(
    "frame, why",
    [
        (fp32_frame(torch.ones(99)), "wrong length"),
        (fp32_frame(torch.ones(10, 10)), "wrong shape"),
        (fp32_frame(torch.ones(100), torch.float16), "wrong dtype"),
        (fp32_frame(torch.full((100,), float("nan"))), "NaN"),
        (fp32_frame(torch.ones(100)) + b"\0" * 8, "trailing bytes"),
        (b"\0" * (max_frame_bytes(100) + 1), "oversized"),
        (b"garbage", "garbage"),
    ],
)
def test_strict_decoding_rejects(frame: bytes, why: str) -> None:
    with pytest.raises(CodecError):
        decode_span(frame, 100)


def test_frame_with_altered_header_is_rejected() -> None:
    frame = bytearray(fp32_frame(torch.ones(100)))
    struct.pack_into("<Q", frame, 29, 50)  # claim a different shape
    with pytest.raises(CodecError):
        decode_span(bytes(frame), 100)
