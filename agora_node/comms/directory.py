"""The stage directory in the DHT: signed node records, the manifest, the run pointer.

Every node stores its signed `NodeRecord` under `agora/<run>/stage/<k>` with its
peer id as subkey and a short expiry, and refreshes it; a record that stops
being refreshed expires on its own. Every node also republishes the manifest,
so the bootstrap peer can die without taking the run's definition with it.
Reads verify every record (signature, run, ranges, freshness: records.verify_record)
and count what they reject (and why). One read keeps at most `max_per_stage`
records per stage, peers it already knew first, then the freshest, so that a
stranger with thousands of fresh keys cannot flood the tables built from it;
and one record per peer (the newest), so an older record replayed under another
stage is not believed next to the peer's current one.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections import Counter
from collections.abc import Callable

from agora_node.comms.host import Host
from agora_node.protocol.identity import Identity
from agora_node.protocol.manifest import Manifest, ManifestError, manifest_from_canonical
from agora_node.protocol.names import manifest_key, run_pointer_key, stage_key
from agora_node.protocol.records import (
    DEFAULT_RECORD_TTL_S,
    NodeRecord,
    NodeState,
    RecordError,
    RecordLimits,
    RunPointer,
    verify_record,
    verify_run_pointer,
)

log = logging.getLogger(__name__)

RECORD_TTL_S = DEFAULT_RECORD_TTL_S
MANIFEST_TTL_S = 120.0
MAX_RECORDS_PER_STAGE = 256
"""Records one directory read keeps per stage (the rest is counted as "excess")."""

Snapshot = dict[int, list[NodeRecord]]


class Directory:
    def __init__(
        self,
        host: Host,
        identity: Identity,
        run_id: str,
        num_stages: int,
        *,
        limits: RecordLimits | None = None,
        max_per_stage: int = MAX_RECORDS_PER_STAGE,
        admit: Callable[[str], bool] | None = None,
    ) -> None:
        self.host, self.identity, self.run_id = host, identity, run_id
        self.admit = admit
        """A private swarm's allow list: records of other signers are never read (admit counts them)."""
        self.num_stages = num_stages
        self.limits = limits or RecordLimits(num_stages=num_stages)
        self.max_per_stage = max_per_stage
        self.rejected: Counter[str] = Counter()
        self._known: dict[int, set[str]] = {}
        """Per stage, the peers the last read kept (preferred when a read is over the bound)."""

    async def publish(self, record: NodeRecord, ttl: float = RECORD_TTL_S) -> bool:
        record.ttl = ttl  # signed: readers refuse the record once it is older than this
        return await self.host.store(
            stage_key(self.run_id, record.stage),
            record.sign(self.identity),
            ttl,
            subkey=record.peer_id,
        )

    async def withdraw(self, record: NodeRecord, ttl: float = RECORD_TTL_S) -> bool:
        """Mark our record as leaving. A DHT value cannot be deleted, and a store
        with an earlier expiry is refused, so the leaving record replaces it (its DHT
        expiry one second later) and readers drop leaving records from their view."""
        record.state = NodeState.LEAVING.value
        record.ttl = ttl
        return await self.host.store(
            stage_key(self.run_id, record.stage),
            record.sign(self.identity),
            ttl + 1.0,
            subkey=record.peer_id,
        )

    def keep(self, stage: int, raw: dict, *, now: float) -> list[NodeRecord]:
        """The records of `stage` worth using out of a DHT read ({subkey: value}):
        verified, counted when refused, at most `max_per_stage` of them."""
        records = []
        for subkey, value in raw.items():
            if self.admit is not None and not self.admit(str(subkey)):
                continue  # verify_record binds the signer to the subkey: unlisted signer
            try:
                record = verify_record(
                    value, run_id=self.run_id, peer_id=str(subkey), limits=self.limits, now=now
                )
            except RecordError as exc:
                self.rejected[exc.reason] += 1
                log.debug("ignoring record under %s: %s", str(subkey)[-8:], exc)
                continue
            if record.stage != stage:
                self.rejected["stage_mismatch"] += 1
                continue
            records.append(record)
        if len(records) > self.max_per_stage:
            known = self._known.get(stage, set())
            records.sort(key=lambda r: (r.peer_id not in known, -r.issued_at, r.peer_id))
            self.rejected["excess"] += len(records) - self.max_per_stage
            records = records[: self.max_per_stage]
        self._known[stage] = {r.peer_id for r in records}
        return records

    async def fetch(self, *, include_leaving: bool = False) -> Snapshot:
        """Verified records of every stage (leaving ones dropped unless asked for),
        one per peer: the newest, wherever it was stored. All stages in one DHT search."""
        keys = {stage: stage_key(self.run_id, stage) for stage in range(self.num_stages)}
        raw = await self.host.get_many(list(keys.values()))
        now = time.time()
        by_stage = {
            stage: self.keep(stage, raw[key], now=now) if isinstance(raw[key], dict) else []
            for stage, key in keys.items()
        }
        return newest_per_peer(by_stage, include_leaving=include_leaving)


class RecentPeers:
    """The peers whose records were read at each stage within the last `keep_s` seconds.

    Who may send a stage micro-batches, or ask it for its state: a leaving peer's record
    drops out of the view at once (it still drains), and a failed directory read empties
    the view for one refresh. Bounded: what `keep_s` of reads kept (256 per stage each)."""

    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self._seen: dict[tuple[int, str], float] = {}

    def note(self, view: Snapshot, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for stage, records in view.items():
            for r in records:
                self._seen[(stage, r.peer_id)] = now
        for key in [k for k, at in self._seen.items() if now - at > self.keep_s]:
            del self._seen[key]

    def seen(self, stage: int, peer: str, now: float | None = None) -> bool:
        """Whether `peer`'s record was read at `stage` within the last `keep_s` seconds
        (asked on every request: one lookup)."""
        at = self._seen.get((stage, peer))
        now = time.monotonic() if now is None else now
        return at is not None and now - at <= self.keep_s


def newest_per_peer(by_stage: Snapshot, *, include_leaving: bool = False) -> Snapshot:
    """One record per peer, its newest (a node that moved left an older one behind,
    and an older one may be replayed while still fresh); leaving ones dropped unless asked."""
    newest: dict[str, NodeRecord] = {}
    for records in by_stage.values():
        for r in records:
            if r.peer_id not in newest or r.issued_at > newest[r.peer_id].issued_at:
                newest[r.peer_id] = r
    return {
        stage: [
            r
            for r in records
            if newest[r.peer_id] is r and (include_leaving or r.state != NodeState.LEAVING.value)
        ]
        for stage, records in by_stage.items()
    }


async def publish_manifest(host: Host, manifest: Manifest, identity: Identity) -> bool:
    """Store the manifest (content-addressed) and a run pointer entry signed by us."""
    run_id = manifest.run_id
    ok = await host.store(manifest_key(run_id), manifest.canonical_bytes(), MANIFEST_TTL_S)
    pointer = RunPointer(
        run_id=run_id, name=manifest.run.name, publisher=identity.peer_id, ttl=MANIFEST_TTL_S
    )
    ok &= await host.store(run_pointer_key(), pointer.sign(identity), MANIFEST_TTL_S, subkey=run_id)
    return ok


MAX_RUNS = 16
"""Runs listed on the status page and in messages."""
MAX_POINTERS_READ = 1024
"""Run pointer entries checked per read (a random share when there are more); fetch_manifest
looks up the manifests of all that verify, so signed pointers of runs without a manifest
cannot hide the one that has one."""


class RunDiscoveryError(RuntimeError):
    """The swarm does not tell which run to join, or tells something unusable."""


class RunChoiceError(RunDiscoveryError):
    """Several valid runs are served and nothing says which one: waiting will not help."""


async def list_runs(
    host: Host, rejected: Counter[str] | None = None, *, limit: int = MAX_RUNS
) -> list[RunPointer]:
    """The runs the swarm's run pointer announces: signed, fresh entries only, one per run
    (forged ones are counted in `rejected` by reason and ignored), at most `limit` of them,
    by run id. A pointer says nothing a stranger could not sign: fetch_manifest keeps only
    the runs whose manifest is in the DHT."""
    raw = await host.get(run_pointer_key())
    if not isinstance(raw, dict):
        return []
    now, runs = time.time(), []
    entries = list(raw.items())
    if len(entries) > MAX_POINTERS_READ:  # a random share: junk cannot push a run past a cut
        entries = random.sample(entries, MAX_POINTERS_READ)
    for subkey, value in entries:
        try:
            runs.append(verify_run_pointer(value, subkey=str(subkey), now=now))
        except RecordError as exc:
            if rejected is not None:
                rejected[f"run_pointer_{exc.reason}"] += 1
            log.debug("ignoring run pointer under %s: %s", str(subkey)[:16], exc)
    return sorted(runs, key=lambda r: r.run_id)[:limit]


def describe_runs(runs: list[RunPointer]) -> str:
    return ", ".join(f"{r.run_id} ({r.name!r})" for r in runs) or "nothing visible yet"


async def fetch_manifest(host: Host, local: Manifest | None, run_id: str | None = None) -> Manifest:
    """The manifest of the run to join: `local`'s (the swarm must serve it), `run_id`'s,
    or the one run the swarm serves. Several valid runs and no choice: RunChoiceError,
    listing them (a joiner must never pick one silently)."""
    if local is not None or run_id:
        wanted = local.run_id if local is not None else run_id
        remote = await host.get(manifest_key(wanted))
        if remote is None:
            served = describe_runs(await list_runs(host))
            if local is not None:
                raise RunDiscoveryError(
                    f"the swarm does not serve your manifest (run id {wanted}); "
                    f"it serves: {served} - is your --manifest the same file?"
                )
            raise RunDiscoveryError(
                f"the swarm does not serve run {wanted} (--run); it serves: {served}"
            )
        return _checked(remote, wanted)
    pointers = await list_runs(host, limit=MAX_POINTERS_READ)
    if not pointers:
        raise RunDiscoveryError("no run is published in this swarm yet (is the bootstrap peer up?)")
    found = await host.get_many([manifest_key(p.run_id) for p in pointers])
    served: list[tuple[RunPointer, Manifest]] = []
    for pointer in pointers:
        remote = found.get(manifest_key(pointer.run_id))
        if remote is None:
            continue  # announced without a manifest: nothing to join
        try:
            manifest = _checked(remote, pointer.run_id)
        except RunDiscoveryError as exc:
            log.debug("ignoring run %s: %s", pointer.run_id, exc)
            continue
        # the manifest (its hash is the run id) names the run, not whoever signed a pointer
        served.append((dataclasses.replace(pointer, name=manifest.run.name), manifest))
    if not served:
        raise RunDiscoveryError(
            f"run(s) {describe_runs(pointers[:MAX_RUNS])} announced but no manifest is in the DHT"
        )
    if len(served) > 1:
        raise RunChoiceError(
            f"this swarm serves {len(served)} runs: "
            f"{describe_runs([p for p, _ in served[:MAX_RUNS]])}; "
            "choose one with --run RUN_ID or --manifest FILE"
        )
    return served[0][1]


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
