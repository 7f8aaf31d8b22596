"""Codecs: Hadamard-rotated blockwise int8/int4 quantization with error feedback, strict
zstd-framed wire format, and the stage-boundary activation codec. Pure functions on tensors
and bytes; imports only torch, numpy, zstandard, the standard library and the codec registry
(agora_node.protocol.codecs, which defines `Codec`).
"""

from agora_node.compression.activations import (
    ActivationCodec,
    ActivationMode,
    GradientSender,
    GradRounding,
    bytes_per_token,
    through_wire,
)
from agora_node.compression.errors import CodecError, NonFiniteError
from agora_node.compression.framing import (
    decode_dict,
    decode_frame,
    decode_tensor,
    encode_dict,
    encode_frame,
)
from agora_node.compression.quant import (
    ErrorFeedback,
    QuantizedTensor,
    dequantize,
    quantize,
    quantize_with_fallback,
    relative_error,
)
from agora_node.protocol.codecs import Codec

__all__ = [
    "ActivationCodec",
    "ActivationMode",
    "Codec",
    "CodecError",
    "ErrorFeedback",
    "NonFiniteError",
    "QuantizedTensor",
    "bytes_per_token",
    "decode_dict",
    "decode_frame",
    "decode_tensor",
    "dequantize",
    "encode_dict",
    "encode_frame",
    "quantize",
    "quantize_with_fallback",
    "relative_error",
    "through_wire",
    "GradientSender",
    "GradRounding",
]
