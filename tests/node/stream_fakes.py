"""A libp2p stand-in for the raw-stream tests: every stream opens onto a reader the test
feeds, as if the remote peer wrote there."""

import asyncio


class _Writer:
    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


class FakeP2P:
    """Opens every stream onto `reader`, as if the remote peer wrote there."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader

    async def call_binary_stream_handler(self, peer_id, name):  # noqa: ANN001, ANN201
        return None, self.reader, _Writer()


def frame(kind: bytes, payload: bytes = b"", length: int | None = None) -> bytes:
    """A stream frame: kind, the payload's length (or `length`, a lie), the payload."""
    return kind + (len(payload) if length is None else length).to_bytes(8, "big") + payload
