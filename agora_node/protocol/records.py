"""Signed node records: what a node asserts about itself in the stage directory.

A `NodeRecord` is what a node asserts about itself in the stage directory. It is
signed over its canonical encoding (sorted-key compact JSON) with the key its
peer id commits to; a reader keeps it only if the signature verifies, the
record is for this run, and it parses. Unknown fields are tolerated and kept in
the signed bytes, so a newer peer can talk to an older one.

A signed record is also refused when its numbers could not come from a real node
(`RecordLimits`: not finite, negative, or beyond physical bounds) and when it is
not fresh: `issued_at` older than the record's own signed `ttl` plus
`MAX_CLOCK_SKEW_S`, or later than now plus that skew. So a stranger cannot skew
placement with `throughput = inf`, nor replay an old signed record of a node
that has left (docs/security.md, "Records").
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any

from agora_node.protocol.identity import Identity, verify
from agora_node.protocol.manifest import Manifest

MAX_RECORD_BYTES = 4096  # hivemind DHT values above ~8 KiB are unsafe (HIVEMIND_NOTES.md)
MAX_ADDRS = 8

DEFAULT_RECORD_TTL_S = 15.0
"""The lifetime a record without a `ttl` field (from a peer older than that field) is
given; also the daemon's default `--record-ttl`."""
MAX_RECORD_TTL_S = 300.0
"""The longest lifetime a record may claim (and `--record-ttl` may ask for): bounds
how long a signed record can be replayed."""
MAX_CLOCK_SKEW_S = 5.0
"""How far apart two honest hosts' clocks may be. NTP keeps hosts within tens of
milliseconds; hivemind's DHT stores absolute expiry times, so peers seconds apart
already lose each other's records. A record issued more than this in the future,
or older than its ttl plus this, is refused."""

PEAK_FLOPS = 1e16
"""FLOP/s no single node reaches (10 PFLOP/s: several times a 2026 accelerator's dense
bf16 rate). Bounds the compute rate a record may announce."""
MAX_QUEUE = 1 << 16
"""Micro-batches waiting or in flight at one node (--max-in-flight and max_queue stay far below)."""
MAX_STEP = 1 << 40
"""Inner or outer steps: 10^12, thirty years at a thousand steps a second."""
MAX_TOKENS = 1 << 53
"""Tokens a node has trained on; also the largest integer a float (and JSON in a browser)
holds exactly."""
MAX_STAGES = 1 << 12
"""Stage numbers when the manifest is not known (a manifest gives the exact count)."""


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
    """1 when the operator fixed this node's stage (--stage N), or the node cannot hold
    every stage: it never moves, and others never elect it to."""
    addrs: list[str] = field(default_factory=list)
    issued_at: float = field(default_factory=time.time)
    ttl: float = DEFAULT_RECORD_TTL_S
    """Seconds this record is meant to live (its DHT expiry); signed, so that a reader
    refuses it once it is older than that (plus clock skew) even if re-stored."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Fields this version does not know (from newer peers); signed, passed through."""
    anchor_round: int = 0
    """The outer round of the anchor attested below (docs/security.md, "State transfer")."""
    anchor_digest: str = ""
    """Digest of this replica's outer anchor (OuterState.digest()); "" attests nothing."""
    outer_digest: str = ""
    """Digest of anchor and outer momentum (OuterState.digest(with_momentum=True))."""
    utilization: float = 0.0
    """Fraction of wall time this node computed over the last minute (0..1): with the
    compute rate, tells a slow node from an idle one. Shown on status pages only."""

    def canonical_bytes(self) -> bytes:
        body = {k: v for k, v in asdict(self).items() if k != "extra"}
        body.update(self.extra)
        # allow_nan=False: a node never signs a number other nodes must refuse.
        return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()

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


@dataclass(frozen=True)
class RecordLimits:
    """The ranges a record's numbers must lie in; beyond them no real node can be.

    `for_manifest` derives what the run's manifest tells: the stage count and, per
    stage, the most tokens per compute-second any node could reach there
    (`PEAK_FLOPS` over a lower bound of the stage's forward + backward FLOPs per
    token). The defaults hold for any run.
    """

    num_stages: int = MAX_STAGES
    max_throughput: tuple[float, ...] = ()
    """Per stage; empty: `PEAK_FLOPS` over one tiny block's cost, the same for every stage."""

    @classmethod
    def for_manifest(cls, manifest: Manifest) -> RecordLimits:
        d = manifest.model.d_model
        per_stage = []
        for stage in range(manifest.num_stages):
            # Each block does at least its query and output projections (2 d x d matmuls,
            # 2 FLOPs per multiply-add) forward, and backward costs about twice that.
            layers = len(manifest.stage_layers(stage))
            per_stage.append(PEAK_FLOPS / (3 * 2 * 2 * d * d * layers))
        return cls(num_stages=manifest.num_stages, max_throughput=tuple(per_stage))

    def throughput_cap(self, stage: int) -> float:
        if 0 <= stage < len(self.max_throughput):
            return self.max_throughput[stage]
        return PEAK_FLOPS / (3 * 2 * 2 * 8 * 8)  # a block of width 8: nothing is smaller

    def check(self, record: NodeRecord) -> None:
        """Raise RecordError("nonfinite" / "range") for a number no real node announces."""
        for name in ("throughput", "utilization"):
            value = getattr(record, name)
            if not isinstance(value, int) and not math.isfinite(value):
                raise RecordError("nonfinite", f"{name} {value} is not finite")
        if not isinstance(record.issued_at, int) and not math.isfinite(record.issued_at):
            raise RecordError("nonfinite", f"issued_at {record.issued_at} is not finite")
        if not isinstance(record.ttl, int) and not math.isfinite(record.ttl):
            raise RecordError("nonfinite", f"ttl {record.ttl} is not finite")
        bounds = (
            ("stage", record.stage, 0, self.num_stages - 1),
            ("throughput", record.throughput, 0, self.throughput_cap(record.stage)),
            ("utilization", record.utilization, 0, 1),
            ("queue", record.queue, 0, MAX_QUEUE),
            ("inner_step", record.inner_step, 0, MAX_STEP),
            ("outer_step", record.outer_step, 0, MAX_STEP),
            ("tokens_seen", record.tokens_seen, 0, MAX_TOKENS),
            ("pinned", record.pinned, 0, 1),
            ("ttl", record.ttl, 0, MAX_RECORD_TTL_S),
            ("issued_at", record.issued_at, 0, 1e11),  # year 5138: guards the arithmetic
        )
        for name, value, low, high in bounds:
            if not low <= value <= high:
                raise RecordError("range", f"{name} {value} outside [{low}, {high}]")
        if record.ttl <= 0:
            raise RecordError("range", f"ttl {record.ttl} must be positive")


def check_fresh(issued_at: float, ttl: float, now: float, what: str = "record") -> None:
    """Raise RecordError("stale" / "future") unless `issued_at` is within [now - ttl - skew,
    now + skew]: an old signed value re-stored by anyone is not believed."""
    if issued_at > now + MAX_CLOCK_SKEW_S:
        raise RecordError(
            "future",
            f"{what} issued {issued_at - now:.1f}s in the future (skew limit {MAX_CLOCK_SKEW_S:g}s)",
        )
    if issued_at < now - ttl - MAX_CLOCK_SKEW_S:
        raise RecordError(
            "stale",
            f"{what} issued {now - issued_at:.1f}s ago, lives {ttl:g}s (+{MAX_CLOCK_SKEW_S:g}s skew)",
        )


def _refuse_constant(name: str) -> None:
    raise RecordError("nonfinite", f"record holds {name}")


def _finite_float(text: str) -> float:
    number = float(text)  # "1e999" parses as inf
    if not math.isfinite(number):
        raise RecordError("nonfinite", f"record holds {text[:32]}, not a finite number")
    return number


def verify_record(
    value: Any,
    *,
    run_id: str,
    peer_id: str | None = None,
    limits: RecordLimits | None = None,
    now: float | None = None,
) -> NodeRecord:
    """Parse and check a DHT value; raises RecordError if it must be ignored.

    Checked: shape and size, field types, the subkey, the signature, the run, every
    number's range (`limits`, default: bounds that hold for any run) and freshness
    against `now` (default: this host's clock).
    """
    data, body = _signed_body(value, "record")
    if not isinstance(body, dict):
        raise RecordError("record", "record is not an object")
    record = _from_body(body)
    if peer_id is not None and record.peer_id != peer_id:
        raise RecordError("record", "record stored under another peer's subkey")
    if record.run_id != run_id:
        raise RecordError("record", f"record is for run {record.run_id}, not {run_id}")
    # Cheap checks before the signature: a flood of impossible records costs no Ed25519 work.
    (limits or RecordLimits()).check(record)
    check_fresh(record.issued_at, record.ttl, time.time() if now is None else now)
    if not verify(record.peer_id, data, value["s"]):
        raise RecordError("signature", "signature does not verify")
    return record


def _signed_body(value: Any, what: str) -> tuple[bytes, Any]:
    """The signed bytes of a `{"r": bytes, "s": bytes}` DHT value and their JSON body, with
    size and number checks before anything else (the signature is checked by the caller)."""
    if (
        not isinstance(value, dict)
        or not isinstance(value.get("r"), bytes)
        or not isinstance(value.get("s"), bytes)
    ):
        raise RecordError("not", f"not a signed {what}")
    data = value["r"]
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError("oversized", f"oversized {what}")
    try:
        # NaN / Infinity / -Infinity are not JSON; Python would parse them.
        body = json.loads(data, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        if isinstance(exc, RecordError):
            raise
        raise RecordError("record", f"{what} is not JSON") from None
    return data, body


# ---- the run pointer -----------------------------------------------------------------

MAX_RUN_NAME = 128
MAX_POINTER_TTL_S = 600.0
"""The longest a run pointer entry may claim to live (the daemon republishes every 30 s,
with a 120 s lifetime)."""


@dataclass(kw_only=True)
class RunPointer:
    """One entry under the run pointer key (subkey: `run_id`): "this swarm serves run
    `run_id`, named `name`", signed by `publisher`, the peer that stored it. It lets a
    joiner without --manifest find the run; the manifest itself is content-addressed
    (its hash is the run id), so a pointer only has to be authentic and fresh."""

    run_id: str
    name: str
    publisher: str
    issued_at: float = field(default_factory=time.time)
    ttl: float = 120.0

    def canonical_bytes(self) -> bytes:
        return json.dumps(
            asdict(self), sort_keys=True, separators=(",", ":"), allow_nan=False
        ).encode()

    def sign(self, identity: Identity) -> dict[str, bytes]:
        if identity.peer_id != self.publisher:
            raise ValueError("a run pointer is signed by its publisher")
        data = self.canonical_bytes()
        return {"r": data, "s": identity.sign(data)}


def verify_run_pointer(value: Any, *, subkey: str, now: float | None = None) -> RunPointer:
    """Parse and check one run pointer entry; raises RecordError if it must be ignored."""
    data, body = _signed_body(value, "run pointer")
    types = {
        "run_id": str,
        "name": str,
        "publisher": str,
        "issued_at": (int, float),
        "ttl": (int, float),
    }
    if not isinstance(body, dict) or set(body) != set(types):
        raise RecordError(
            "field", "run pointer fields are not run_id, name, publisher, issued_at, ttl"
        )
    for key, expected in types.items():
        if isinstance(body[key], bool) or not isinstance(body[key], expected):
            raise RecordError(
                "field", f"run pointer field {key} has type {type(body[key]).__name__}"
            )
    pointer = RunPointer(**body)
    if pointer.run_id != subkey:
        raise RecordError("record", "run pointer stored under another run's subkey")
    if len(pointer.name) > MAX_RUN_NAME or not pointer.name.isprintable():
        raise RecordError("range", "run name too long or not printable")
    if not 0 < pointer.ttl <= MAX_POINTER_TTL_S or not 0 <= pointer.issued_at <= 1e11:
        raise RecordError("range", f"run pointer ttl {pointer.ttl} or issued_at out of range")
    check_fresh(pointer.issued_at, pointer.ttl, time.time() if now is None else now, "run pointer")
    if not verify(pointer.publisher, data, value["s"]):
        raise RecordError("signature", "run pointer signature does not verify")
    return pointer
