"""The exception the codecs raise for bad data (as opposed to caller bugs), and its kinds."""


class CodecError(ValueError):
    """Input cannot be encoded or a received frame is malformed, oversized or non-finite.

    Callers that read frames from untrusted peers catch exactly this and drop the peer's
    contribution; anything else escaping a decoder is a bug in this package.
    """


class NonFiniteError(CodecError):
    """The values, or the scales that decode them, are NaN or infinite.

    A peer answers such a frame with its own wire code (non_finite): it usually means the
    sender diverged, not that it is hostile.
    """
