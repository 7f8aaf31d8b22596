"""The stage directory in the DHT: signed node records, the manifest, the run pointer.

Every node stores its signed `NodeRecord` under `agora/<run>/stage/<k>` with its
peer id as subkey and a short expiry, and refreshes it; a record that stops
being refreshed expires on its own. Every node also republishes the manifest,
so the bootstrap peer can die without taking the run's definition with it.
Reads verify every record and count what they reject (and why).
"""

from __future__ import annotations

import logging
from collections import Counter

from agora_node.comms.host import Host
from agora_node.protocol.identity import Identity
from agora_node.protocol.manifest import Manifest, ManifestError, manifest_from_canonical
from agora_node.protocol.names import manifest_key, run_pointer_key, stage_key
from agora_node.protocol.records import NodeRecord, NodeState, RecordError, verify_record

log = logging.getLogger(__name__)

RECORD_TTL_S = 15.0
MANIFEST_TTL_S = 120.0

Snapshot = dict[int, list[NodeRecord]]


class Directory:
    def __init__(self, host: Host, identity: Identity, run_id: str, num_stages: int) -> None:
        self.host, self.identity, self.run_id = host, identity, run_id
        self.num_stages = num_stages
        self.rejected: Counter[str] = Counter()
        self._last_expiry: dict[int, float] = {}

    async def publish(self, record: NodeRecord, ttl: float = RECORD_TTL_S) -> bool:
        return await self.host.store(
            stage_key(self.run_id, record.stage),
            record.sign(self.identity),
            ttl,
            subkey=record.peer_id,
        )

    async def withdraw(self, record: NodeRecord, ttl: float = RECORD_TTL_S) -> bool:
        """Mark our record as leaving. A DHT value cannot be deleted, and a store
        with an earlier expiry is refused, so the leaving record replaces it and
        readers drop leaving records from their view."""
        record.state = NodeState.LEAVING.value
        return await self.publish(record, ttl=ttl + 1.0)

    async def fetch_stage(self, stage: int) -> list[NodeRecord]:
        raw = await self.host.get(stage_key(self.run_id, stage))
        if not isinstance(raw, dict):
            return []
        records = []
        for subkey, value in raw.items():
            try:
                record = verify_record(value, run_id=self.run_id, peer_id=str(subkey))
            except RecordError as exc:
                self.rejected[exc.reason] += 1
                log.debug("ignoring record under %s: %s", str(subkey)[-8:], exc)
                continue
            if record.stage != stage:
                self.rejected["stage_mismatch"] += 1
                continue
            records.append(record)
        return records

    async def fetch(self, *, include_leaving: bool = False) -> Snapshot:
        """Verified records of every stage (leaving ones dropped unless asked for)."""
        snapshot: Snapshot = {}
        for stage in range(self.num_stages):
            records = await self.fetch_stage(stage)
            if not include_leaving:
                records = [r for r in records if r.state != NodeState.LEAVING.value]
            snapshot[stage] = records
        return snapshot


async def publish_manifest(host: Host, manifest: Manifest) -> bool:
    run_id = manifest.run_id
    ok = await host.store(manifest_key(run_id), manifest.canonical_bytes(), MANIFEST_TTL_S)
    ok &= await host.store(
        run_pointer_key(), manifest.run.name.encode(), MANIFEST_TTL_S, subkey=run_id
    )
    return ok


class RunDiscoveryError(RuntimeError):
    """The swarm does not tell which run to join, or tells something unusable."""


async def fetch_manifest(host: Host, local: Manifest | None) -> Manifest:
    """The manifest of the run the swarm serves; a local one must hash the same."""
    runs = await host.get(run_pointer_key()) or {}
    if local is not None:
        remote = await host.get(manifest_key(local.run_id))
        if remote is None:
            names = ", ".join(
                f"{rid} ({v.decode(errors='replace') if isinstance(v, bytes) else v})"
                for rid, v in runs.items()
            )
            raise RunDiscoveryError(
                f"the swarm does not serve your manifest (run id {local.run_id}); "
                f"it serves: {names or 'nothing visible yet'} - is your --manifest the same file?"
            )
        return _checked(remote, local.run_id)
    if not runs:
        raise RunDiscoveryError("no run is published in this swarm yet (is the bootstrap peer up?)")
    if len(runs) > 1:
        raise RunDiscoveryError(
            f"this swarm serves {len(runs)} runs ({', '.join(map(str, runs))}): pass --manifest to choose"
        )
    run_id = str(next(iter(runs)))
    remote = await host.get(manifest_key(run_id))
    if remote is None:
        raise RunDiscoveryError(f"run {run_id} is announced but its manifest is not in the DHT")
    return _checked(remote, run_id)


def _checked(raw: object, run_id: str) -> Manifest:
    if not isinstance(raw, bytes):
        raise RunDiscoveryError("the manifest in the DHT is not bytes")
    try:
        manifest = manifest_from_canonical(raw)
    except ManifestError as exc:
        raise RunDiscoveryError(
            f"the swarm's manifest is not valid for this version: {exc}"
        ) from None
    if manifest.run_id != run_id:
        raise RunDiscoveryError(
            f"the swarm's manifest hashes to {manifest.run_id}, not {run_id}: refusing it"
        )
    return manifest
