"""ActivationCodec: stage-boundary tensors [batch, seq, k], forward and backward.

Bounds under test (activations.py): fp32 exact; bf16 |x - y| <= 2**-8 |x|; int8 and int4
|x - y| <= absmax(scale block) / (2 qmax) * (1 + 2**-7), the block being one token for int8.
"""

from __future__ import annotations

import pytest
import torch

from agora_node.compression import (
    ActivationCodec,
    Codec,
    CodecError,
    NonFiniteError,
    QuantizedTensor,
    bytes_per_token,
    encode_frame,
    relative_error,
    through_wire,
)
from agora_node.protocol.codecs import DENSE_CODEC_NAMES

pytestmark = pytest.mark.timeout(60)

SHAPE = (4, 64, 32)


def activation(shape: tuple[int, int, int] = SHAPE, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Tokens differ in scale by orders of magnitude, as residual streams do.
    return torch.randn(shape, generator=g) * torch.exp(2 * torch.randn(*shape[:2], 1, generator=g))


def round_trip(mode: str, x: torch.Tensor, **kw) -> torch.Tensor:
    codec = ActivationCodec(mode=mode, **kw)
    return codec.decode(codec.encode(x), tuple(x.shape))


def test_fp32_is_exact() -> None:
    x = activation()
    assert torch.equal(round_trip("fp32", x), x)


def test_bf16_relative_bound() -> None:
    x = activation()
    assert bool(((x - round_trip("bf16", x)).abs() <= 2**-8 * x.abs()).all())


@pytest.mark.parametrize(("mode", "qmax"), [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("k", [32, 48, 7])
def test_int_modes_bound_per_scale_block(mode: str, qmax: int, k: int) -> None:
    x = activation((2, 16, k))
    codec = ActivationCodec(mode=mode)
    block = codec.block_for(k)
    assert k % block == 0  # a scale never spans two tokens
    err = (x - round_trip(mode, x)).reshape(-1, block).abs()
    amax = x.reshape(-1, block).abs().amax(dim=1, keepdim=True)
    assert bool((err <= amax / (2 * qmax) * (1 + 2**-7)).all())


@pytest.mark.parametrize(("mode", "limit"), [("bf16", 0.003), ("int8", 0.01), ("int4", 0.15)])
def test_typical_relative_error(mode: str, limit: float) -> None:
    x = activation()
    assert relative_error(x, round_trip(mode, x)) < limit


def test_gradients_use_the_same_codec() -> None:
    grad = activation(seed=3) * 1e-6  # gradients w.r.t. coefficients are small
    assert relative_error(grad, round_trip("int8", grad)) < 0.01


def test_dtype_is_preserved_and_checked() -> None:
    x = activation().bfloat16()
    codec = ActivationCodec(mode="int8")
    frame = codec.encode(x)
    assert codec.decode(frame, SHAPE, expected_dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(CodecError, match="dtype"):
        codec.decode(frame, SHAPE, expected_dtype=torch.float32)


def test_wrong_shape_garbage_and_oversize_are_rejected() -> None:
    codec = ActivationCodec(mode="int4")
    frame = codec.encode(activation())
    with pytest.raises(CodecError, match="expected"):
        codec.decode(frame, (4, 32, 64))
    with pytest.raises(CodecError):
        codec.decode(frame[:-1], SHAPE)
    with pytest.raises(CodecError):
        codec.decode(b"\0" * 100, SHAPE)
    with pytest.raises(CodecError, match="exceeds limit"):
        codec.decode(ActivationCodec(mode="fp32").encode(activation((4, 64, 64))), (4, 64, 32))


def test_non_finite_input_is_refused_at_the_sender() -> None:
    x = activation()
    x[0, 0, 0] = float("nan")
    with pytest.raises(NonFiniteError):
        ActivationCodec().encode(x)


def test_non_finite_payload_has_its_own_kind() -> None:
    # The stage answers NonFiniteError with the non_finite wire code, other CodecErrors
    # with bad_payload (node/pipeline.py), so the kind must not depend on the message.
    x = activation((1, 2, 4))
    x[0, 1, 2] = float("inf")
    flat = x.reshape(-1)
    frame = encode_frame(QuantizedTensor(Codec.FP32, tuple(x.shape), torch.float32, flat))
    with pytest.raises(NonFiniteError):
        ActivationCodec().decode(frame, (1, 2, 4))
    with pytest.raises(CodecError) as garbage:
        ActivationCodec().decode(b"\0" * 100, (1, 2, 4))
    assert not isinstance(garbage.value, NonFiniteError)


def test_invalid_configuration() -> None:
    with pytest.raises(ValueError, match="mode"):
        ActivationCodec(mode="int2")
    with pytest.raises(ValueError, match="batch, seq, k"):
        ActivationCodec().encode(torch.zeros(4, 32))


def test_bytes_per_token_is_measured_and_ordered() -> None:
    k = 32
    sizes = {mode: bytes_per_token(mode, k) for mode in DENSE_CODEC_NAMES}
    assert sizes["fp32"] > sizes["bf16"] > sizes["int8"] > sizes["int4"]
    # Values plus one bf16 scale per block, plus a header shared by 1024 tokens.
    for mode, expected in {"fp32": 4 * k, "bf16": 2 * k, "int8": k + 2, "int4": k / 2 + 2}.items():
        assert expected < sizes[mode] < expected + 0.1


def test_through_wire_rounds_both_ways_like_the_wire() -> None:
    codec = ActivationCodec(mode="int4")
    x = activation().requires_grad_(True)
    g = activation(seed=1)
    y = through_wire(x, codec)
    y.backward(g)
    # Forward: what a receiver decodes; backward: what the sender decodes of the gradient.
    assert torch.equal(y.detach(), round_trip("int4", x.detach()))
    assert torch.equal(x.grad, round_trip("int4", g))
    assert not torch.equal(x.grad, g)  # int4 does round
