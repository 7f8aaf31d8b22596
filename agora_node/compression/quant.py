"""Blockwise int8/int4 quantization with optional Hadamard rotation, fallback and error feedback.

Scheme (symmetric absmax, round to nearest): the tensor is flattened, zero-padded to a multiple
of `block`, optionally rotated block by block (see hadamard.py), and every block gets one scale
s = absmax / qmax with qmax = 127 (int8) or 7 (int4; -8 is never produced, so the grid is
symmetric). Values are q = round(x / s), stored as int8 or as two 4-bit nibbles per byte.

Guarantee, per block, in the domain that was quantized (rotated or not):
    |x_i - s * q_i| <= s / 2        hence ||x_b - deq_b||_2 <= sqrt(block) * s / 2.
The rotation is orthonormal, so the L2 bound carries over to the original values unchanged.

Since absmax <= ||x_b||, the relative L2 error is at most sqrt(block) / (2 qmax) for any input.

TOPK4 (sparse) keeps, per block of 128 or 256 values (never rotated), the 1/64 of them largest
in magnitude: their positions (one byte each) and their values in int4 on a scale set by the
largest. Everything else decodes as 0; the bound above holds for the kept values only.

Scales are float32 by default: pseudo-gradients can be ~1e-9, below float16's range. bfloat16
scales (same range, half the overhead, which matters at small blocks) are rounded *up*, so the
bound above holds with the stored scale (whose step is then up to 2**-7 coarser).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from agora_node.compression.errors import CodecError, NonFiniteError
from agora_node.compression.hadamard import is_power_of_two, rotate, unrotate
from agora_node.protocol.codecs import SPARSE_BLOCKS, Codec

DEFAULT_BLOCK = 256
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SCALE_DTYPES = (torch.float32, torch.bfloat16)


# Relative L2 error above which `quantize_with_fallback` re-encodes at higher precision. Typical
# at block 256: gaussian ~0.007 (int8) / ~0.12 (int4); student-t(2) unrotated ~0.03 / ~0.28. The
# worst case is sqrt(block) / (2 qmax): 0.063 / 1.14. So these catch pathology, not ordinary data.
# A sparse codec drops most of a dense vector by design (error feedback sends it later): its
# limit only catches an encoding that kept nothing of a non-zero input.
DEFAULT_MAX_REL_ERROR = {
    Codec.INT8: 0.05,
    Codec.INT4: 0.35,
    Codec.TOPK4: 0.9999,
    Codec.BF16: 0.01,
    Codec.FP32: 0.0,
}
_FALLBACK = {
    Codec.INT8: Codec.BF16,
    Codec.INT4: Codec.BF16,
    Codec.TOPK4: Codec.INT8,
    Codec.BF16: Codec.FP32,
}


@dataclass(frozen=True)
class QuantizedTensor:
    """An encoded tensor, ready for framing.

    data is float32 / bfloat16 values (FP32, BF16), int8 values (INT8) or uint8 nibble pairs
    (INT4; TOPK4: the kept values only), flat and padded to whole blocks. scales is one value
    per block (quantized only).
    """

    codec: Codec
    shape: tuple[int, ...]
    dtype: torch.dtype
    data: torch.Tensor
    block: int = 0
    seed: int | None = None
    scales: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    """Sparse codecs: uint8 positions of the kept values within each block, increasing."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def quantize(
    x: torch.Tensor,
    codec: Codec = Codec.INT8,
    *,
    block: int = DEFAULT_BLOCK,
    seed: int | None = None,
    scale_dtype: torch.dtype | None = None,
    stochastic: torch.Generator | None = None,
) -> QuantizedTensor:
    """Encode `x` with exactly `codec`. `seed` (quantized codecs only) enables rotation.

    `stochastic` (dense int codecs only): round each value up or down at random from this
    generator, with the probability that makes the decoded value's expectation x
    (unbiased, at up to twice the error of rounding to nearest); None: to nearest.

    `scale_dtype` None: bfloat16 for sparse codecs, whose scale is most of a block's bytes
    (2 of 8 against 4 of 10: 1.25x fewer bytes for a scale rounded up by at most 2**-8),
    float32 otherwise."""
    _check_input(x)
    codec = Codec(codec)
    if stochastic is not None and (codec.is_sparse or not codec.is_quantized):
        raise ValueError(f"stochastic rounding is for dense int codecs, not {codec.value}")
    if scale_dtype is None:
        scale_dtype = torch.bfloat16 if codec.is_sparse else torch.float32
    shape, dtype = tuple(x.shape), x.dtype
    flat = x.detach().reshape(-1)
    if codec is Codec.FP32:
        # clone: the encoding must not change if the caller later updates x in place.
        return QuantizedTensor(codec, shape, dtype, flat.float().clone())
    if codec is Codec.BF16:
        return QuantizedTensor(codec, shape, dtype, flat.to(torch.bfloat16).contiguous())
    _check_block(block, seed, scale_dtype)
    if codec.is_sparse:
        return _quantize_sparse(flat.float(), codec, shape, dtype, block, seed, scale_dtype)
    blocks = _to_blocks(flat.float(), block)
    if seed is not None:
        blocks = rotate(blocks, seed)
    scales, q = _scale_and_round(blocks, codec.qmax, scale_dtype, stochastic)
    data = pack_int4(q.reshape(-1)) if codec is Codec.INT4 else q.reshape(-1)
    return QuantizedTensor(codec, shape, dtype, data, block, seed, scales)


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """Decode to a tensor of the original shape and dtype."""
    n = q.numel
    if q.codec in (Codec.FP32, Codec.BF16):
        return q.data[:n].reshape(q.shape).to(q.dtype)
    nblocks = q.scales.numel()
    length = nblocks * q.block
    if q.codec.is_sparse:
        kept = q.codec.kept(q.block)
        values = unpack_int4(q.data, nblocks * kept).reshape(nblocks, kept).float()
        blocks = torch.zeros(nblocks, q.block)
        blocks.scatter_(
            1, q.indices.reshape(nblocks, kept).long(), values * q.scales.float()[:, None]
        )
        return blocks.reshape(-1)[:n].reshape(q.shape).to(q.dtype)
    vals = unpack_int4(q.data, length) if q.codec is Codec.INT4 else q.data[:length]
    blocks = vals.reshape(nblocks, q.block).float() * q.scales.float()[:, None]
    if q.seed is not None:
        blocks = unrotate(blocks, q.seed)
    return blocks.reshape(-1)[:n].reshape(q.shape).to(q.dtype)


def quantize_with_fallback(
    x: torch.Tensor,
    codec: Codec = Codec.INT8,
    *,
    block: int = DEFAULT_BLOCK,
    seed: int | None = None,
    max_rel_error: float | None = None,
) -> tuple[QuantizedTensor, torch.Tensor]:
    """Encode with the cheapest of `codec`, BF16, FP32 whose relative L2 error fits the limit.

    max_rel_error bounds ||x - deq|| / ||x|| (None: DEFAULT_MAX_REL_ERROR[codec]); the same
    limit applies at every step, and FP32 always fits. Returns the encoding and its decoded
    value, which error feedback needs anyway.
    """
    codec = Codec(codec)
    limit = DEFAULT_MAX_REL_ERROR[codec] if max_rel_error is None else max_rel_error
    while True:
        try:
            q = quantize(x, codec, block=block, seed=seed)
        except CodecError:
            if codec is Codec.FP32:
                raise  # non-finite input: no codec can carry it
            codec = _FALLBACK[codec]
            continue
        deq = dequantize(q)
        if codec is Codec.FP32 or relative_error(x, deq) <= limit:
            return q, deq
        codec = _FALLBACK[codec]


def _quantize_sparse(
    flat: torch.Tensor,
    codec: Codec,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    block: int,
    seed: int | None,
    scale_dtype: torch.dtype,
) -> QuantizedTensor:
    """The largest `codec.kept(block)` magnitudes of each block, int4 on the block's scale."""
    if block not in SPARSE_BLOCKS or seed is not None:
        raise ValueError(f"{codec.label} takes blocks of {SPARSE_BLOCKS} values, not rotated")
    blocks = _to_blocks(flat, block)
    kept = codec.kept(block)
    positions = blocks.abs().topk(kept, dim=1, sorted=False).indices.sort(dim=1).values
    scales, q = _scale_and_round(blocks.gather(1, positions), codec.qmax, scale_dtype)
    indices = positions.to(torch.uint8).reshape(-1)
    return QuantizedTensor(
        codec, shape, dtype, pack_int4(q.reshape(-1)), block, None, scales, indices
    )


def relative_error(x: torch.Tensor, approx: torch.Tensor) -> float:
    """||x - approx||_2 / ||x||_2, 0 for an all-zero x that is reproduced exactly."""
    # float64 accumulation: squares of large fp32 values overflow, and sums of 25M terms drift.
    diff = torch.linalg.vector_norm((x.float() - approx.float()).reshape(-1), dtype=torch.float64)
    ref = torch.linalg.vector_norm(x.reshape(-1).float(), dtype=torch.float64)
    if ref == 0:
        return 0.0 if diff == 0 else float("inf")
    return float(diff / ref)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack int8 values in [-8, 7] two per byte (low nibble first), padding an odd tail."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    if u.numel() % 2:
        u = torch.cat((u, u.new_full((1,), 8)))
    return u[0::2] | (u[1::2] << 4)


def unpack_int4(packed: torch.Tensor, length: int) -> torch.Tensor:
    """Inverse of `pack_int4`: the first `length` int8 values."""
    pairs = torch.stack((packed & 0x0F, packed >> 4), dim=1).reshape(-1)[:length]
    return pairs.to(torch.int8) - 8


class ErrorFeedback:
    """Per-tensor residual memory so that quantization error is re-sent, not lost.

    compress(name, x) encodes x + residual[name] and keeps residual = (x + residual) - decoded.
    After any number of rounds, sum(decoded) = sum(x) - residual: the accumulated error is one
    round's quantization error, not a random walk over rounds.
    """

    def __init__(
        self,
        codec: Codec = Codec.INT8,
        *,
        block: int = DEFAULT_BLOCK,
        seed: int | None = 0,
        max_rel_error: float | None = None,
    ) -> None:
        self.codec = Codec(codec)
        self.block = block
        self.seed = seed
        self.max_rel_error = max_rel_error
        self._residuals: dict[str, torch.Tensor] = {}

    def compress(self, name: str, tensor: torch.Tensor) -> QuantizedTensor:
        """Encode tensor + the residual kept under `name`; frame the result to send it."""
        x = tensor.detach().float()
        residual = self._residuals.get(name)
        if residual is not None:
            if residual.shape != x.shape:
                raise ValueError(
                    f"{name}: shape {tuple(x.shape)} != residual {tuple(residual.shape)}"
                )
            x = x + residual
        q, deq = quantize_with_fallback(
            x, self.codec, block=self.block, seed=self.seed, max_rel_error=self.max_rel_error
        )
        self._residuals[name] = x - deq.float()
        return q

    def residual(self, name: str) -> torch.Tensor | None:
        return self._residuals.get(name)

    def reset(self, name: str | None = None) -> None:
        """Forget one residual (or all), e.g. after weights were replaced by a sync."""
        if name is None:
            self._residuals.clear()
        else:
            self._residuals.pop(name, None)


def _check_input(x: torch.Tensor) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {x.dtype}; expected one of {SUPPORTED_DTYPES}")
    if not bool(torch.isfinite(x).all()):
        raise NonFiniteError("cannot encode a tensor with NaN or infinite values")


def _check_block(block: int, seed: int | None, scale_dtype: torch.dtype) -> None:
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if seed is not None and not is_power_of_two(block):
        raise ValueError(f"rotation needs a power-of-two block, got {block}")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale dtype must be one of {SCALE_DTYPES}, got {scale_dtype}")


def _to_blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    pad = -flat.numel() % block
    if pad:
        flat = torch.cat((flat, flat.new_zeros(pad)))
    return flat.reshape(-1, block)


def _scale_and_round(
    rows: torch.Tensor,
    qmax: int,
    scale_dtype: torch.dtype,
    stochastic: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row (absmax / qmax) and the rows rounded to int8 on it (to nearest, or
    down after adding uniform noise in [0, 1) from `stochastic`: up with probability equal
    to the fraction)."""
    scales = _block_scales(rows, qmax, scale_dtype)
    if not bool(torch.isfinite(scales).all()):
        raise NonFiniteError("values too large for a finite scale (after any rotation)")
    # Divide (not multiply by 1/s): 1/s overflows for subnormal scales. All-zero rows: s = 0.
    divisor = torch.where(scales > 0, scales.float(), torch.ones_like(scales, dtype=torch.float32))
    scaled = rows / divisor[:, None]
    if stochastic is None:
        rounded = torch.round(scaled)
    else:  # |scaled| <= qmax up to float rounding (exactly, with bf16 scales rounded up)
        rounded = torch.floor(scaled.add_(torch.rand(scaled.shape, generator=stochastic)))
    return scales, rounded.clamp_(-qmax, qmax).to(torch.int8)


def _block_scales(blocks: torch.Tensor, qmax: int, scale_dtype: torch.dtype) -> torch.Tensor:
    scales = blocks.abs().amax(dim=1) / qmax
    if scale_dtype is torch.bfloat16:
        scales = _bf16_round_up(scales)
    return scales


def _bf16_round_up(x: torch.Tensor) -> torch.Tensor:
    # Round non-negative float32 toward +inf by carrying into the upper 16 bits, so that
    # |x / scale| never exceeds qmax and the s/2 bound holds for the stored scale.
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0xFFFF) >> 16).to(torch.int16).view(torch.bfloat16)
