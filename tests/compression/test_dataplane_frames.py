"""The boundary codec decodes frames framed as its encoder frames them, in any dense mode:
a rotated frame (which has the receiver build and cache a sign vector per seed and block a
peer picks), a sparse one, or one with another scale block is refused before it is
dequantized."""

import pytest
import torch

from agora_node.compression import ActivationCodec, CodecError, encode_frame, hadamard, quantize
from agora_node.protocol.codecs import Codec

SHAPE = (2, 4, 64)
X = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("mode", ["fp32", "bf16", "int8", "int4"])
def test_what_the_encoder_frames_decodes_in_every_mode(mode: str) -> None:
    for receiver in ("int8", "fp32"):  # frames are self-describing: any receiver's mode
        y = ActivationCodec(mode=receiver).decode(ActivationCodec(mode=mode).encode(X), SHAPE)
        assert y.shape == SHAPE


@pytest.mark.parametrize(
    ("codec", "block", "seed"),
    [
        (Codec.INT8, 64, 12345),  # the encoder's block, rotated
        (Codec.INT4, 32, 7),
        (Codec.INT8, 16, None),  # not rotated, but another block than block_for(64)
        (Codec.INT4, 64, None),
        (Codec.TOPK4, 128, None),  # sparse
    ],
    ids=["int8-rotated", "int4-rotated", "int8-block16", "int4-block64", "topk4"],
)
def test_a_frame_the_encoder_never_sends_is_refused(codec: Codec, block: int, seed) -> None:  # noqa: ANN001
    frame = encode_frame(
        quantize(X, codec, block=block, seed=seed, scale_dtype=torch.bfloat16), zstd=False
    )
    hadamard._signs_cpu.cache_clear()
    with pytest.raises(CodecError):
        ActivationCodec(mode="int8").decode(frame, SHAPE)
    assert hadamard._signs_cpu.cache_info().currsize == 0  # nothing built for the peer's seed
