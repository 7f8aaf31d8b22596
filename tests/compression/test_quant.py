"""Blockwise int8/int4 quantization: stated error bounds, rotation, packing, fallback.

Bound under test (quant.py): in the domain that was quantized (after rotation, if any),
every element is within s/2 of its original, s = block absmax / qmax the stored scale.
"""

from __future__ import annotations

import pytest
import torch

from agora_node.compression import (
    Codec,
    CodecError,
    NonFiniteError,
    QuantizedTensor,
    dequantize,
    quantize,
    quantize_with_fallback,
    relative_error,
)
from agora_node.compression.hadamard import rotate, unrotate
from agora_node.compression.quant import pack_int4, unpack_int4

from .samples import gaussian, student_t, with_outliers

pytestmark = pytest.mark.timeout(60)

N = (1 << 15) + 37  # not a multiple of the block: exercises padding


def _name(codec: Codec) -> str:
    return codec.name


SAMPLES = {"gaussian": gaussian, "student_t2": student_t, "outliers": with_outliers}


def blocks_of(x: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    """x padded to whole blocks, in the domain q quantized (rotated when q.seed is set)."""
    flat = x.float().reshape(-1)
    flat = torch.cat((flat, flat.new_zeros(-flat.numel() % q.block)))
    blocks = flat.reshape(-1, q.block)
    return blocks if q.seed is None else rotate(blocks, q.seed)


def decoded_blocks(q: QuantizedTensor) -> torch.Tensor:
    """s * q per block, before un-rotation and before the padding is cut off."""
    length = q.scales.numel() * q.block
    vals = unpack_int4(q.data, length) if q.codec is Codec.INT4 else q.data[:length]
    return vals.reshape(-1, q.block).float() * q.scales.float()[:, None]


@pytest.mark.parametrize("kind", SAMPLES)
@pytest.mark.parametrize("seed", [None, 7])
@pytest.mark.parametrize("codec", [Codec.INT8, Codec.INT4], ids=_name)
def test_error_bounds(codec: Codec, seed: int | None, kind: str) -> None:
    x = SAMPLES[kind](N) * 3.0
    q = quantize(x, codec, seed=seed)
    target = blocks_of(x, q)
    s = q.scales.float()[:, None]
    slack = 1e-5 * target.abs().amax(dim=1, keepdim=True)  # rotation round-off
    # Per element, in the quantized domain: within half a step; scales cover the absmax.
    assert bool(((target - decoded_blocks(q)).abs() <= s / 2 + slack).all())
    assert bool((s * codec.qmax >= target.abs().amax(dim=1, keepdim=True) - slack).all())
    # Per block, in the original domain: L2 error <= sqrt(block) * s / 2 (rotation is orthonormal).
    flat = torch.cat(((x - dequantize(q)).reshape(-1), x.new_zeros(-x.numel() % q.block)))
    block_err = flat.reshape(-1, q.block).norm(dim=1, keepdim=True)
    assert bool((block_err <= q.block**0.5 * (s / 2 + slack)).all())
    # Hence, for any input: relative L2 error <= sqrt(block) / (2 qmax).
    assert relative_error(x, dequantize(q)) <= q.block**0.5 / (2 * codec.qmax)


@pytest.mark.parametrize(("codec", "limit"), [(Codec.INT8, 0.01), (Codec.INT4, 0.15)])
@pytest.mark.parametrize("seed", [None, 3])
def test_gaussian_relative_error(codec: Codec, limit: float, seed: int | None) -> None:
    x = gaussian(N)
    assert relative_error(x, dequantize(quantize(x, codec, seed=seed))) < limit


@pytest.mark.parametrize("kind", ["student_t2", "outliers"])
@pytest.mark.parametrize("codec", [Codec.INT8, Codec.INT4], ids=_name)
def test_rotation_reduces_error_on_heavy_tails(codec: Codec, kind: str) -> None:
    x = SAMPLES[kind](N, seed=5)
    plain = relative_error(x, dequantize(quantize(x, codec)))
    rotated = relative_error(x, dequantize(quantize(x, codec, seed=11)))
    assert rotated < 0.6 * plain


def test_int4_packs_two_per_byte_and_round_trips() -> None:
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(3)[:-1]  # odd length
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.numel() == (q.numel() + 1) // 2
    assert torch.equal(unpack_int4(packed, q.numel()), q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("codec", list(Codec), ids=_name)
def test_shape_and_dtype_survive(codec: Codec, dtype: torch.dtype) -> None:
    x = torch.randn(3, 5, 7).to(dtype)
    if codec.is_sparse:
        kw = {"block": 128}
    else:
        kw = {"block": 64, "seed": 1 if codec.is_quantized else None}
    y = dequantize(quantize(x, codec, **kw))
    assert y.shape == x.shape and y.dtype == dtype


def test_fp32_codec_is_exact_and_owns_its_data() -> None:
    x = gaussian(1000)
    original = x.clone()
    q = quantize(x, Codec.FP32)
    x.add_(1.0)
    assert torch.equal(dequantize(q), original)


def test_bf16_scales_round_up_so_the_bound_holds() -> None:
    x = gaussian(4096) * 1e-7  # tiny, like a late pseudo-gradient
    q = quantize(x, Codec.INT8, block=32, scale_dtype=torch.bfloat16)
    assert q.scales.dtype == torch.bfloat16
    amax = x.reshape(-1, 32).abs().amax(dim=1)
    assert bool((q.scales.float() * 127 >= amax).all())
    assert bool(((x - dequantize(q)).reshape(-1, 32).abs() <= q.scales.float()[:, None] / 2).all())


@pytest.mark.parametrize("codec", list(Codec), ids=_name)
def test_zero_and_empty_tensors(codec: Codec) -> None:
    assert torch.equal(dequantize(quantize(torch.zeros(300), codec)), torch.zeros(300))
    assert dequantize(quantize(torch.zeros(0, 4), codec)).shape == (0, 4)


@pytest.mark.parametrize("codec", [Codec.INT8, Codec.INT4], ids=_name)
def test_extreme_magnitudes(codec: Codec) -> None:
    tiny = gaussian(512) * 1e-40  # subnormal float32: 1 / scale would overflow
    y = dequantize(quantize(tiny, codec))
    assert bool(torch.isfinite(y).all()) and relative_error(tiny, y) < 0.2
    huge = torch.full((512,), 3e38)
    with pytest.raises(CodecError, match="too large"):
        quantize(huge, codec, seed=1)  # the rotation sums overflow float32
    q, deq = quantize_with_fallback(huge, codec, seed=1)
    assert q.codec is Codec.BF16 and bool(torch.isfinite(deq).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_is_refused(bad: float) -> None:
    x = gaussian(100)
    x[3] = bad
    with pytest.raises(NonFiniteError, match="NaN or infinite"):
        quantize(x, Codec.INT8)
    with pytest.raises(NonFiniteError, match="NaN or infinite"):
        quantize_with_fallback(x, Codec.INT4)


def test_caller_errors_are_not_codec_errors() -> None:
    with pytest.raises(TypeError):
        quantize(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="power-of-two"):
        quantize(torch.zeros(4), block=100, seed=1)


def spiky_blocks(codec: Codec, block: int = 256, nblocks: int = 16) -> torch.Tensor:
    """One spike per block, the rest just below half a step: all of them round to zero."""
    spike = 100.0
    rest = 0.49 * spike / codec.qmax
    signs = torch.sign(torch.randn(nblocks, block, generator=torch.Generator().manual_seed(2)))
    x = rest * signs
    x[:, 0] = spike
    return x.reshape(-1)


@pytest.mark.parametrize("codec", [Codec.INT8, Codec.INT4], ids=_name)
def test_fallback_to_bf16_on_pathological_tensor(codec: Codec) -> None:
    x = spiky_blocks(codec)
    assert relative_error(x, dequantize(quantize(x, codec))) > 0.05
    q, deq = quantize_with_fallback(x, codec)
    assert q.codec is Codec.BF16
    assert torch.equal(deq, dequantize(q))
    assert relative_error(x, deq) < 0.004


def test_fallback_when_rotation_concentrates_the_energy() -> None:
    # The inverse rotation of spiky blocks is spiky again after rotate(): rotation cannot help.
    x = unrotate(spiky_blocks(Codec.INT4).reshape(-1, 256), seed=5).reshape(-1)
    q, _ = quantize_with_fallback(x, Codec.INT4, seed=5)
    assert q.codec is Codec.BF16


def test_fallback_reaches_fp32_when_bf16_is_not_enough() -> None:
    x = spiky_blocks(Codec.INT8)
    q, deq = quantize_with_fallback(x, Codec.INT8, max_rel_error=1e-4)
    assert q.codec is Codec.FP32 and torch.equal(deq, x)


@pytest.mark.parametrize("codec", [Codec.INT8, Codec.INT4], ids=_name)
def test_no_fallback_on_ordinary_data(codec: Codec) -> None:
    for make in SAMPLES.values():
        q, _ = quantize_with_fallback(make(N), codec, seed=3)
        assert q.codec is codec
