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
    GradientSender,
    NonFiniteError,
    QuantizedTensor,
    bytes_per_token,
    encode_frame,
    quantize,
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


# ---- the gradient path: how gradients sent upstream are rounded (GradientSender) ----------


def _steady_gradient() -> torch.Tensor:
    """One token of k=32 whose absmax is 7 (the int4 step is 1, up to the scale's rounding
    up) and whose other values sit 0.3 of a step above a grid point: rounding to nearest
    drops those 0.3 every time."""
    g = torch.full((1, 1, 32), 2.3)
    g[0, 0, 0] = 7.0
    return g


def test_stochastic_rounding_is_unbiased_where_nearest_is_not() -> None:
    g = _steady_gradient()
    nearest = GradientSender(ActivationCodec(mode="int4"), "nearest").round_trip(g)
    sender = GradientSender(ActivationCodec(mode="int4"), "stochastic")
    sender._rng.manual_seed(0)  # noqa: SLF001 - a fixed draw, so the test cannot flake
    draws = torch.stack([sender.round_trip(g) for _ in range(2000)])
    step = 7.0 / 7 * (1 + 2**-7)
    assert float((nearest - g)[0, 0, 1:].mean()) < -0.25 * step  # biased by about -0.3
    # Unbiased: over 31 values x 2000 draws the mean error is ~0.002 of a step (std), each
    # value's own mean ~0.01: bounds at 5 standard deviations, whatever the draw.
    bias = draws.mean(0) - g
    assert abs(float(bias[0, 0, 1:].mean())) < 0.01 * step
    assert float(bias.abs().max()) < 0.05 * step
    # Every draw is on the grid next to its value: never more than one step away.
    assert float((draws - g).abs().max()) <= step
    assert torch.equal(draws[:, 0, 0, 0], torch.full((2000,), 7.0))  # the absmax is exact


def test_error_feedback_sends_what_rounding_left_out_later() -> None:
    g = _steady_gradient()
    sender = GradientSender(ActivationCodec(mode="int4"), "feedback")
    sent = sum(sender.round_trip(g) for _ in range(10))
    # Each send carries the last one's rounding error: the sum is off by at most one step,
    # where rounding to nearest is off by 10 x 0.3 steps.
    assert float((sent - 10 * g).abs().max()) <= 7.0 / 7 * (1 + 2**-7)
    # A gradient of another shape (the last, shorter micro-batch) starts afresh.
    short = activation((1, 3, 32))
    assert torch.equal(sender.round_trip(short), round_trip("int4", short))


def test_gradient_frames_decode_with_the_plain_codec() -> None:
    """The rounding is the sender's business: the frame format does not change."""
    g = activation()
    for rounding in ("stochastic", "feedback"):
        frame = GradientSender(ActivationCodec(mode="int8"), rounding).encode(g)
        y = ActivationCodec(mode="bf16").decode(frame, tuple(g.shape))
        assert float((y - g).abs().max()) <= float(g.abs().amax(-1).max()) / 127 * 1.01


def test_random_rounding_needs_an_int_mode() -> None:
    for mode in ("fp32", "bf16"):
        with pytest.raises(ValueError, match="int mode"):
            GradientSender(ActivationCodec(mode=mode), "stochastic")
        GradientSender(ActivationCodec(mode=mode), "nearest")  # fine
    with pytest.raises(ValueError, match="one of"):
        GradientSender(ActivationCodec(mode="int8"), "sometimes")
    with pytest.raises(ValueError, match="dense int codecs"):
        quantize(activation(), Codec.TOPK4, stochastic=torch.Generator())


def test_through_wire_sends_gradients_through_the_boundarys_sender() -> None:
    codec = ActivationCodec(mode="int4")
    sender = GradientSender(codec, "feedback")
    g = activation(seed=1)
    for _ in range(2):
        x = activation().requires_grad_(True)
        through_wire(x, codec, sender).backward(g)
    # The second backward carried the first one's residual: not what plain rounding sends.
    assert not torch.equal(x.grad, round_trip("int4", g))
