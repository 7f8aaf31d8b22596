"""Streaming a stage's state (weights, optimizer and outer state) from a live replica.

The server takes one consistent snapshot (serialized in the stage worker, not
on the event loop) and streams it in 1 MiB frames after a JSON header that
gives the size and sha256. The client checks both before it trusts a byte, and
reports progress as it goes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from hivemind.p2p import P2P

from agora_node.comms import streams
from agora_node.protocol.names import state_protocol

log = logging.getLogger(__name__)

MAX_STATE_BYTES = 16 << 30


class StateTransferError(RuntimeError):
    pass


# Returns (header fields, serialized state) for the requested stage, or raises.
SnapshotProvider = Callable[[int], Awaitable[tuple[dict, bytes]]]


async def serve_state(p2p: P2P, run_id: str, provider: SnapshotProvider) -> None:
    async def handler(remote: str, request: bytes) -> AsyncIterator[bytes]:
        try:
            stage = int(json.loads(request)["stage"])
        except (ValueError, KeyError, TypeError) as exc:
            raise StateTransferError(f"bad state request: {exc}") from None
        header, blob = await provider(stage)
        header = {**header, "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
        log.info("sending stage %d state (%.1f MiB) to %s", stage, len(blob) / 2**20, remote[-8:])
        yield json.dumps(header).encode()
        view = memoryview(blob)
        for offset in range(0, len(view), streams.CHUNK):
            yield bytes(view[offset : offset + streams.CHUNK])

    await streams.serve(p2p, state_protocol(run_id), handler, max_request=4096)


async def fetch_state(
    p2p: P2P,
    run_id: str,
    peer_id: str,
    stage: int,
    *,
    timeout: float = 20.0,
    progress: Callable[[str], None] = log.info,
) -> tuple[dict, bytes]:
    """Download and verify the state of `stage` from `peer_id`; raises StateTransferError."""
    request = json.dumps({"stage": stage}).encode()
    frames = streams.request_stream(
        p2p,
        peer_id,
        state_protocol(run_id),
        request,
        timeout=timeout,
        max_response=streams.CHUNK + 4096,
    )
    header: dict | None = None
    digest, received, parts = hashlib.sha256(), 0, []
    started, last_report = time.monotonic(), 0.0
    try:
        async for frame in frames:
            if header is None:
                header = _parse_header(frame)
                continue
            received += len(frame)
            if received > header["bytes"]:
                raise StateTransferError(
                    f"{peer_id[-8:]} sent more than the announced {header['bytes']} bytes"
                )
            digest.update(frame)
            parts.append(frame)
            now = time.monotonic()
            if now - last_report >= 1.0 or received == header["bytes"]:
                last_report = now
                rate = received / max(now - started, 1e-6) / 2**20
                progress(
                    f"state of stage {stage} from {peer_id[-8:]}: {received / 2**20:.1f}/"
                    f"{header['bytes'] / 2**20:.1f} MiB ({100 * received / max(header['bytes'], 1):.0f}%, {rate:.1f} MiB/s)"
                )
    except streams.StreamError as exc:
        raise StateTransferError(str(exc)) from exc
    if header is None or received != header["bytes"]:
        raise StateTransferError(f"transfer from {peer_id[-8:]} ended early ({received} bytes)")
    if digest.hexdigest() != header["sha256"]:
        raise StateTransferError(f"checksum mismatch in state from {peer_id[-8:]}")
    return header, b"".join(parts)


def _parse_header(frame: bytes) -> dict:
    try:
        header = json.loads(frame)
        size, sha = int(header["bytes"]), str(header["sha256"])
    except (ValueError, KeyError, TypeError) as exc:
        raise StateTransferError(f"bad state header: {exc}") from None
    if not 0 <= size <= MAX_STATE_BYTES or len(sha) != 64:
        raise StateTransferError(f"implausible state header: {size} bytes")
    return header
