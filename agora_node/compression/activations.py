"""Codec for what crosses a pipeline stage boundary: activations forward, gradients backward.

Both are float tensors of shape [batch, seq, k] (k subspace coefficients per token, or the
dense width d). Per-element guarantee and wire size of each mode (B = scale block):

    mode  guarantee |x - y| <=                  bytes/token   scale block B
    fp32  0 (exact)                             4k            -
    bf16  2**-8 |x|                             2k            -
    int8  absmax_B / 254 * (1 + 2**-7)          k + 2         the token (B = k)
    int4  absmax_B / 14  * (1 + 2**-7)          k/2 + 2k/B    32 if 32 divides k, else k

plus a ~60-byte header per frame. Scales are bfloat16, rounded up (hence the 1 + 2**-7): at
small k a float32 scale per token would cost int4 another 10%. `bytes_per_token` measures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from agora_node.compression.errors import CodecError, NonFiniteError
from agora_node.compression.framing import decode_frame, encode_frame
from agora_node.compression.quant import dequantize, quantize
from agora_node.protocol.codecs import DENSE_CODEC_NAMES, Codec, CodecName, from_name

ActivationMode = CodecName  # a dense codec of the registry (DENSE_CODEC_NAMES)
_INT4_BLOCK = 32
# Largest header (ndim 3) plus slack; used to derive a frame-size limit from the shape.
_FRAME_OVERHEAD = 128


@dataclass(frozen=True, kw_only=True)
class ActivationCodec:
    """Encodes [batch, seq, k] float tensors to framed bytes and back."""

    mode: ActivationMode = "bf16"
    """Value format on the wire."""
    block: int | None = None
    """Values per scale for int modes; None: k for int8, 32 (or k) for int4."""

    def __post_init__(self) -> None:
        from_name(self.mode, what="activation mode", allowed=DENSE_CODEC_NAMES)
        if self.block is not None and self.block < 1:
            raise ValueError(f"block must be >= 1, got {self.block}")

    def block_for(self, k: int, codec: Codec | None = None) -> int:
        """Scale block for width k: a divisor of k so that no block straddles two tokens.
        `codec`: the block this codec's frames have in another mode (default: its own)."""
        if self.block is not None:
            return self.block
        if (codec or from_name(self.mode)) is Codec.INT4 and k % _INT4_BLOCK == 0:
            return _INT4_BLOCK
        return k

    @staticmethod
    def max_frame(shape: tuple[int, int, int]) -> int:
        """The largest frame `decode` takes for `shape`: a float32 copy and a header."""
        return 4 * math.prod(shape) + _FRAME_OVERHEAD

    def encode(self, x: torch.Tensor, *, stochastic: torch.Generator | None = None) -> bytes:
        """Frame x ([batch, seq, k], finite) in this codec's mode; `stochastic`: round the int
        modes at random from this generator, unbiased (quant.quantize), not to nearest."""
        if x.dim() != 3:
            raise ValueError(f"expected [batch, seq, k], got shape {tuple(x.shape)}")
        codec = from_name(self.mode)
        if codec.is_quantized:
            block = self.block_for(x.shape[-1])
            q = quantize(x, codec, block=block, scale_dtype=torch.bfloat16, stochastic=stochastic)
        else:
            q = quantize(x, codec)
        # Activations are near-incompressible noise; zstd would only cost latency.
        return encode_frame(q, zstd=False)

    def decode(
        self,
        data: bytes | bytearray | memoryview,
        expected_shape: tuple[int, int, int],
        *,
        expected_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Decode a peer's frame; wrong shape or dtype, garbage or non-finite raise CodecError.

        Any dense mode is accepted (frames are self-describing), framed as `encode` frames
        it: never rotated, and blocks of `block_for` the width. Rotated frames had the
        receiver build and cache a sign vector for each (seed, block) a peer chose, up to
        hundreds of MiB. The size limit follows from the expected shape, so a peer cannot
        make us allocate more than a float32 copy of it.
        """
        max_bytes = self.max_frame(expected_shape)
        q = decode_frame(data, max_bytes=max_bytes, expected_shape=tuple(expected_shape))
        if expected_dtype is not None and q.dtype != expected_dtype:
            raise CodecError(f"dtype {q.dtype} != expected {expected_dtype}")
        if q.seed is not None or q.codec.is_sparse:
            raise CodecError(f"a rotated or sparse {q.codec.label} frame: boundaries send neither")
        block = self.block_for(expected_shape[-1], q.codec)
        if q.codec.is_quantized and q.block != block:
            raise CodecError(f"block {q.block} != {block} for width {expected_shape[-1]}")
        y = dequantize(q)
        if not bool(torch.isfinite(y).all()):
            raise NonFiniteError("decoded activation is not finite")
        return y

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """What the receiver of x decodes: x through encode and decode (on the host, as on
        the wire), back on x's device in x's dtype."""
        frame = self.encode(x.detach().float().cpu().contiguous())
        return self.decode(frame, tuple(x.shape)).to(x.device, x.dtype)


GradRounding = Literal["nearest", "stochastic", "feedback"]
GRAD_ROUNDINGS: tuple[GradRounding, ...] = ("nearest", "stochastic", "feedback")


class GradientSender:
    """Encodes the gradients one stage boundary sends upstream, micro-batch after micro-batch.

    `rounding` says how the int modes round them:
    - "nearest": as the activations forward (biased: a value below half a step is lost,
      every time);
    - "stochastic": up or down at random, unbiased, so the upstream stage's weight gradient
      (linear in what it receives) is unbiased too, at a little more variance;
    - "feedback": error feedback; what rounding left out of one gradient is added to the next
      one of the same shape before it is rounded. The same positions of the next micro-batch
      hold other tokens, so what is carried lands on other samples' weight gradients.
    Measured with bench/subspace_quality.py (docs/benchmarks.md, "Rounding the gradients"):
    on `tiny` the three end within the evaluations' own noise of each other, so the daemons
    send as the codec rounds (nearest). One sender per boundary, used from one thread."""

    def __init__(self, codec: ActivationCodec, rounding: GradRounding = "nearest") -> None:
        if rounding not in GRAD_ROUNDINGS:
            raise ValueError(f"gradient rounding {rounding!r}: one of {', '.join(GRAD_ROUNDINGS)}")
        if rounding != "nearest" and not from_name(codec.mode).is_quantized:
            raise ValueError(f"{rounding} rounding needs an int mode, not {codec.mode}")
        self.codec, self.rounding = codec, rounding
        self._rng: torch.Generator | None = None
        if rounding == "stochastic":
            self._rng = torch.Generator()
            self._rng.seed()  # from the OS: the noise need not be reproducible
        self._residual: torch.Tensor | None = None

    def encode(self, grad: torch.Tensor) -> bytes:
        """Frame a gradient ([batch, seq, k], finite) to send upstream."""
        x = grad.float()
        feedback = self.rounding == "feedback"
        if feedback and self._residual is not None and self._residual.shape == x.shape:
            x = x + self._residual
        frame = self.codec.encode(x, stochastic=self._rng)
        if feedback:
            self._residual = x - self.codec.decode(frame, tuple(x.shape))
        return frame

    def round_trip(self, grad: torch.Tensor) -> torch.Tensor:
        """What the upstream stage decodes of `grad`, on its device in its dtype."""
        frame = self.encode(grad.detach().float().cpu().contiguous())
        return self.codec.decode(frame, tuple(grad.shape)).to(grad.device, grad.dtype)


class _Wire(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: torch.Tensor, codec: ActivationCodec, grad: GradientSender | None
    ) -> torch.Tensor:  # type: ignore[override]  # noqa: E501
        ctx.codec, ctx.grad = codec, grad
        return codec.round_trip(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        sender = ctx.grad if ctx.grad is not None else ctx.codec
        return sender.round_trip(grad), None, None


def through_wire(
    x: torch.Tensor, codec: ActivationCodec, grad: GradientSender | None = None
) -> torch.Tensor:
    """x as a stage boundary leaves it both ways: forward, the receiver's decoding of x; in
    backward, the sender's decoding of the gradient the receiver sends back (through `grad`,
    or `codec` rounding to nearest). For trainers that chain stages in one process and want
    the wire's rounding in the loop."""
    return _Wire.apply(x, codec, grad)


def bytes_per_token(mode: ActivationMode, k: int, *, tokens: int = 1024) -> float:
    """Measured wire bytes per token for `mode` at width k (header amortized over `tokens`)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, tokens, k, generator=g)
    return len(ActivationCodec(mode=mode).encode(x)) / tokens
