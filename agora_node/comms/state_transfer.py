"""Streaming a stage's attested state (outer anchor and momentum) from a live replica.

The server serializes one consistent copy per outer state (cached, one at a
time, off the worker thread: OuterRounds.transfer_blob) and streams it in
1 MiB frames after a JSON header that gives the size and sha256. Each joiner
may hold one transfer at a time, a few at most run together, each has read,
drain and overall deadlines (`LIMITS`, enforced by comms/guard.py). The client refuses a header announcing more than the bound
the stage's parameter count gives (before it buffers anything) and checks the
sha256 (integrity only: authenticity comes from the replicas' attestations,
state_search.load_state), and reports progress as it goes. A server whose transfers still send two older copies
of its state answers "busy" instead of making a third (node/rounds.py, lend_blob).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

from hivemind.p2p import P2P

from agora_node.comms import streams
from agora_node.comms.guard import Guard, Limits
from agora_node.protocol.names import state_protocol

log = logging.getLogger(__name__)

MAX_STATE_BYTES = 16 << 30
"""Absolute ceiling; callers pass the stage's own bound (state_blob.max_bytes)."""
SEND_DEADLINE_S = 600.0
LIMITS = Limits(
    max_streams=4,  # transfers a replica serves at once
    max_streams_per_peer=1,  # each joiner one at a time
    rate_per_s=1.0,  # a joiner asks a source at most once per pass (STATE_POLL_S apart)
    burst=5,
    read_deadline_s=10.0,
    deadline_s=SEND_DEADLINE_S,
)


class StateTransferError(streams.BadRequest, RuntimeError):
    pass


# Lends (header fields, serialized state) for the requested stage for as long as the
# transfer lasts (an async context manager; raises to refuse, "busy" included). A provider
# that caches its blob may put its "sha256" in the header (else it is computed per send).
SnapshotProvider = Callable[[int], AbstractAsyncContextManager[tuple[dict, bytes]]]


async def serve_state(
    p2p: P2P,
    run_id: str,
    provider: SnapshotProvider,
    *,
    deadline_s: float = SEND_DEADLINE_S,
    refuse: Callable[[str], str | None] | None = None,
    on_refuse: Callable[[str, str], None] | None = None,
) -> None:
    limits = dataclasses.replace(LIMITS, deadline_s=deadline_s)

    async def handler(remote: str, request: bytes) -> AsyncIterator[bytes]:
        try:
            stage = int(json.loads(request)["stage"])
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
            raise StateTransferError(f"bad state request: {exc}") from None
        async with provider(stage) as (header, blob):
            if "sha256" not in header:  # providers cache it; hashing GBs must not hold the loop
                header = {**header, "sha256": await asyncio.to_thread(_sha256, blob)}
            header = {**header, "bytes": len(blob)}
            mib = len(blob) / 2**20
            log.info("sending stage %d state (%.1f MiB) to %s", stage, mib, remote[-8:])
            yield json.dumps(header).encode()
            view = memoryview(blob)
            for offset in range(0, len(view), streams.CHUNK):
                yield bytes(view[offset : offset + streams.CHUNK])

    guard = Guard("state", limits, on_refuse=on_refuse)
    await streams.serve(
        p2p, state_protocol(run_id), handler, max_request=4096, guard=guard, refuse=refuse
    )


def _sha256(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


async def fetch_state(
    p2p: P2P,
    run_id: str,
    peer_id: str,
    stage: int,
    *,
    max_bytes: int = MAX_STATE_BYTES,
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
        max_total=max_bytes + streams.CHUNK + 4096,  # the state and its header frame
    )
    header: dict | None = None
    digest, received, parts = hashlib.sha256(), 0, []
    started, last_report = time.monotonic(), 0.0
    try:
        async for frame in frames:
            if header is None:
                header = _parse_header(frame, max_bytes)
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
    return header, await asyncio.to_thread(b"".join, parts)  # the whole state: off the loop


def _parse_header(frame: bytes, max_bytes: int = MAX_STATE_BYTES) -> dict:
    try:
        header = json.loads(frame)
        size, sha = int(header["bytes"]), str(header["sha256"])
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
        # OverflowError: "bytes": 1e999; RecursionError: a deeply nested "[[[[..."
        raise StateTransferError(f"bad state header: {exc}") from None
    if not 0 <= size <= min(max_bytes, MAX_STATE_BYTES) or len(sha) != 64:
        raise StateTransferError(f"implausible state header: {size} bytes (limit {max_bytes})")
    return {**header, "bytes": size, "sha256": sha}  # what was checked, not what was sent
