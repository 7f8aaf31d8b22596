"""Every DHT key and libp2p name of a run, in one place.

These strings are the wire: a peer that spells one differently does not find, or
is not found by, the others. So each is defined here once, every module imports it,
and tests/foundation/test_names.py pins the exact spellings; changing one is a
protocol change. The run id prefixes everything run-scoped, so peers of different
runs or manifest versions never meet under the same key or protocol.
"""

from __future__ import annotations

# ---- DHT keys --------------------------------------------------------------------------


def stage_key(run_id: str, stage: int) -> str:
    """Stage directory: one signed NodeRecord per replica of `stage` (subkey: its peer id)."""
    return f"agora/{run_id}/stage/{stage}"


def manifest_key(run_id: str) -> str:
    """The run's manifest, canonical bytes."""
    return f"agora/{run_id}/manifest"


def run_pointer_key() -> str:
    """Where a bootstrap advertises which run it serves (lets a joiner skip --manifest)."""
    return "agora/current-run"


def outer_round_key(run_id: str, stage: int, round_no: int) -> str:
    """Entries of the replicas of `stage` that take part in outer round `round_no`.
    v2: parts are signed (comms/collective/proofs.py); a v1 peer must not be grouped."""
    return f"agora/{run_id}/outer-v2/{stage}/{round_no}"


# ---- libp2p handler namespaces and stream protocols -------------------------------------


def outer_namespace(run_id: str, stage: int) -> str:
    """Namespace of the collective RPCs among the replicas of `stage` (v2: signed parts)."""
    return f"agora/{run_id}/outer-v2/{stage}"


def outer_stream_protocol(namespace: str) -> str:
    """Stream protocol carrying the collective's requests of `namespace`
    (`outer_namespace`) whole, for peers reached through a relay (comms/relay.py)."""
    return f"/{namespace}/stream/1"


def swim_namespace(run_id: str) -> str:
    """Namespace of the SWIM membership RPCs of a run."""
    return f"agora/{run_id}/swim"


STANDALONE_SWIM_NAMESPACE = "agora-membership"
"""SWIM namespace of a membership peer run outside any run (tests/membership/run_peer.py)."""


def forward_protocol(run_id: str) -> str:
    """Stream protocol for micro-batches between pipeline stages."""
    return f"/agora/{run_id}/forward/1"


def state_protocol(run_id: str) -> str:
    """Stream protocol for a stage's state, fetched from a live replica on join."""
    return f"/agora/{run_id}/state/2"  # 2: attested anchor state (protocol/state_blob.py)


def cell_protocol(run_id: str) -> str:
    """Stream protocol for K/V frames between the members of a context-parallel cell."""
    return f"/agora/{run_id}/cell/1"


def cell_work_protocol(run_id: str) -> str:
    """Stream protocol on which a cell's leader hands a helper its chunk of a micro-batch."""
    return f"/agora/{run_id}/cellwork/1"


def admission_protocol(run_id: str) -> str:
    """Stream protocol a joiner asks peers it sees "do you admit me?" (private swarms)."""
    return f"/agora/{run_id}/admission/1"


def reachability_protocol(run_id: str) -> str:
    """Stream protocol a node asks peers "dial me back" with (comms/reachability.py)."""
    return f"/agora/{run_id}/reachability/1"


def protocol_prefix(run_id: str) -> str:
    """What every stream protocol of a run starts with (a relay passes on only these)."""
    return f"/agora/{run_id}/"


def relay_protocol(run_id: str) -> str:
    """Stream protocol a caller sends a request on to a relay, for a peer nobody can dial
    (comms/relay.py)."""
    return f"/agora/{run_id}/relay/1"


def relayed_protocol(run_id: str) -> str:
    """Stream protocol a relay passes a caller's request on to its target with."""
    return f"/agora/{run_id}/relayed/1"


COLLECTIVE_PART_DOMAIN = b"agora-collective-part/2\n"
"""What a collective part's signed statement starts with (comms/collective/proofs.py)."""

COLLECTIVE_RECEIPT_DOMAIN = b"agora-collective-receipt/2\n"
"""What a witness's signed inventory receipt starts with (comms/collective/proofs.py)."""


def telemetry_prefix(run_id: str, peer_id: str) -> str:
    """MQTT topic prefix of a node's telemetry (`/status`, `/events` below it)."""
    return f"agora/{run_id}/{peer_id}"
