"""Signed node records: what a node asserts about itself in the stage directory.

A `NodeRecord` is what a node asserts about itself in the stage directory. It is
signed over its canonical encoding (sorted-key compact JSON) with the key its
peer id commits to; a reader keeps it only if the signature verifies, the
record is for this run, and it parses. Unknown fields are tolerated and kept in
the signed bytes, so a newer peer can talk to an older one.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any

from agora_node.protocol.identity import Identity, verify

MAX_RECORD_BYTES = 4096  # hivemind DHT values above ~8 KiB are unsafe (HIVEMIND_NOTES.md)
MAX_ADDRS = 8


class NodeState(StrEnum):
    JOINING = "joining"
    WARMING = "warming"
    ACTIVE = "active"
    LEAVING = "leaving"


class RecordError(ValueError):
    """A record that must be ignored (bad signature, wrong run, malformed).

    `reason` is its label in the status page and metrics (records_rejected). The labels
    are the first word of each message, as they were when readers derived them from it;
    kept so that dashboards and status consumers see the same keys.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(kw_only=True)
class NodeRecord:
    run_id: str
    peer_id: str
    stage: int
    state: str = NodeState.JOINING.value
    throughput: float = 0.0
    """Compute rate: tokens per compute-second of forward + backward on this node's
    stage, each micro-batch counted once, over the last minute. A node's speed when
    busy, comparable across stages; not the swarm's tokens/s."""
    queue: int = 0
    """Micro-batches waiting or in flight at this node."""
    version: str = ""
    inner_step: int = 0
    outer_step: int = 0
    tokens_seen: int = 0
    pinned: int = 0
    """1 when the operator fixed this node's stage (--stage N): it never moves."""
    addrs: list[str] = field(default_factory=list)
    issued_at: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)
    """Fields this version does not know (from newer peers); signed, passed through."""
    anchor_round: int = 0
    """The outer round of the anchor attested below (docs/security.md, "State transfer")."""
    anchor_digest: str = ""
    """Digest of this replica's outer anchor (OuterState.digest()); "" attests nothing."""
    outer_digest: str = ""
    """Digest of anchor and outer momentum (OuterState.digest(with_momentum=True))."""

    def canonical_bytes(self) -> bytes:
        body = {k: v for k, v in asdict(self).items() if k != "extra"}
        body.update(self.extra)
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    def sign(self, identity: Identity) -> dict[str, bytes]:
        """The DHT value: canonical record bytes and their signature."""
        if identity.peer_id != self.peer_id:
            raise ValueError("a node may only sign its own record")
        data = self.canonical_bytes()
        if len(data) > MAX_RECORD_BYTES:
            raise ValueError(f"record is {len(data)} bytes, limit {MAX_RECORD_BYTES}")
        return {"r": data, "s": identity.sign(data)}


_KNOWN = {f.name: f for f in fields(NodeRecord) if f.name != "extra"}
_TYPES = {"str": str, "int": int, "float": (int, float), "list[str]": list}


def _from_body(body: dict[str, Any]) -> NodeRecord:
    known, extra = {}, {}
    for key, value in body.items():
        if key not in _KNOWN:
            extra[key] = value
            continue
        expected = _TYPES[_KNOWN[key].type]
        if isinstance(value, bool) or not isinstance(value, expected):
            raise RecordError("field", f"field {key} has type {type(value).__name__}")
        known[key] = value
    for key in ("run_id", "peer_id", "stage"):
        if key not in known:
            raise RecordError("missing", f"missing field {key}")
    if (
        not all(isinstance(a, str) for a in known.get("addrs", []))
        or len(known.get("addrs", [])) > MAX_ADDRS
    ):
        raise RecordError("bad", "bad addrs")
    if known.get("state", NodeState.JOINING.value) not in set(NodeState):
        raise RecordError("unknown", f"unknown state {known['state']!r}")
    return NodeRecord(**known, extra=extra)


def verify_record(value: Any, *, run_id: str, peer_id: str | None = None) -> NodeRecord:
    """Parse and check a DHT value; raises RecordError if it must be ignored."""
    if (
        not isinstance(value, dict)
        or not isinstance(value.get("r"), bytes)
        or not isinstance(value.get("s"), bytes)
    ):
        raise RecordError("not", "not a signed record")
    data = value["r"]
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError("oversized", "oversized record")
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise RecordError("record", "record is not JSON") from None
    if not isinstance(body, dict):
        raise RecordError("record", "record is not an object")
    record = _from_body(body)
    if peer_id is not None and record.peer_id != peer_id:
        raise RecordError("record", "record stored under another peer's subkey")
    if not verify(record.peer_id, data, value["s"]):
        raise RecordError("signature", "signature does not verify")
    if record.run_id != run_id:
        raise RecordError("record", f"record is for run {record.run_id}, not {run_id}")
    return record
