"""A real agora-node daemon made hostile for tests: `python -m tests.integration.hostile_node
join ...` with AGORA_HOSTILE_STATE set to one attack.

It trains and takes part in outer rounds like any replica, announces the attestation most
of its stage's other replicas announce (copied from its directory view, so that it is a
source whenever there is a majority to copy), claims to be far ahead, idle and fast
(inner_step 10^9, queue 0, throughput 10^6) so that a joiner tries it first, and serves
joiners a state it altered:

- altered: finite weights, the anchor shifted (a well-formed lie);
- nan: one anchor value NaN;
- garbage: random bytes of the expected size.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import sys
from collections import Counter

import torch

from agora_node.node import daemon, snapshot
from agora_node.node.service import StageService

ATTACK = os.environ.get("AGORA_HOSTILE_STATE", "altered")


def _lying_record(node):  # noqa: ANN001, ANN202
    record = _honest_record(node)
    record.inner_step, record.queue, record.throughput = 10**9, 0, 1e6
    claims = Counter(
        (r.anchor_round, r.anchor_digest, r.outer_digest)
        for r in node.view.get(record.stage, [])
        if r.peer_id != record.peer_id and getattr(r, "anchor_digest", "")
    )
    if claims:
        (record.anchor_round, record.anchor_digest, record.outer_digest), _ = max(
            claims.items(), key=lambda kv: (kv[1], kv[0][0])
        )
    return record


def _alter(values: torch.Tensor) -> torch.Tensor:
    values = values.clone().float()
    if ATTACK == "nan":
        values[0] = float("nan")
    else:
        values += 0.5
    return values


def _tamper(blob: bytes) -> bytes:
    if ATTACK == "garbage":
        return os.urandom(len(blob))
    try:
        from agora_node.protocol import state_blob
    except ImportError:  # an older daemon: torch.save'd weights, optimizer and outer state
        state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        state["model"] = {k: _alter(v) for k, v in state["model"].items()}
        state["outer"]["anchor"] = _alter(state["outer"]["anchor"])
        buf = io.BytesIO()
        torch.save(state, buf)
        return buf.getvalue()
    numel = (len(blob) - state_blob.HEADER_BYTES) // 8
    got = state_blob.decode(blob, numel)
    return state_blob.encode(got.round, _alter(got.anchor), got.momentum)


@contextlib.asynccontextmanager
async def _tampered_snapshot(self):  # noqa: ANN001, ANN202 - lends as state_snapshot does
    async with _honest_snapshot(self) as (header, blob):
        blob = _tamper(blob)
        header = {**header, "sha256": hashlib.sha256(blob).hexdigest()}  # integrity holds
        print(f"hostile: serving a {ATTACK} state", flush=True)
        yield header, blob


_honest_record = snapshot.node_record
_honest_snapshot = StageService.state_snapshot
daemon.node_record = _lying_record
StageService.state_snapshot = _tampered_snapshot

if __name__ == "__main__":
    from agora_node.node.cli import entry

    sys.exit(entry())
