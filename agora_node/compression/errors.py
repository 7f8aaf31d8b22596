"""The one exception the codecs raise for bad data (as opposed to caller bugs)."""


class CodecError(ValueError):
    """Input cannot be encoded or a received frame is malformed, oversized or non-finite.

    Callers that read frames from untrusted peers catch exactly this and drop the peer's
    contribution; anything else escaping a decoder is a bug in this package.
    """
