"""The directory under a stranger's identities and run pointers: bounded, fresh, one record
per peer; run discovery that never picks silently. Pure logic (the DHT is faked as a dict)."""

from __future__ import annotations

import asyncio
import time

import pytest

from agora_node.comms.directory import (
    Directory,
    RunChoiceError,
    RunDiscoveryError,
    fetch_manifest,
    newest_per_peer,
)
from agora_node.protocol.identity import Identity
from agora_node.protocol.names import manifest_key, run_pointer_key
from agora_node.protocol.records import NodeRecord, RunPointer
from agora_node.stages.manifest_files import load_manifest

pytestmark = pytest.mark.timeout(60)


# ---- the directory keeps a bounded, fresh, one-per-peer view ------------------------------


def _signed(identity: Identity, stage: int, issued_at: float, **fields) -> dict[str, bytes]:
    return NodeRecord(
        run_id="run0", peer_id=identity.peer_id, stage=stage, issued_at=issued_at, **fields
    ).sign(identity)


def test_a_flood_of_fresh_identities_does_not_displace_known_peers():
    now = time.time()
    d = Directory(None, None, "run0", 2, max_per_stage=8)  # keep() needs no host
    known = [Identity.generate() for _ in range(3)]
    first = d.keep(0, {k.peer_id: _signed(k, 0, now - 2) for k in known}, now=now)
    assert {r.peer_id for r in first} == {k.peer_id for k in known}
    sybils = [Identity.generate() for _ in range(200)]
    raw = {s.peer_id: _signed(s, 0, now) for s in sybils}  # fresher than the known ones
    raw.update({k.peer_id: _signed(k, 0, now - 2) for k in known})
    kept = d.keep(0, raw, now=now)
    assert len(kept) == 8
    assert {k.peer_id for k in known} <= {r.peer_id for r in kept}
    assert d.rejected["excess"] == 195


def test_a_replayed_older_record_loses_to_the_peers_newer_one():
    me, now = Identity.generate(), time.time()
    old = NodeRecord(run_id="run0", peer_id=me.peer_id, stage=1, state="active", issued_at=now - 4)
    new = NodeRecord(run_id="run0", peer_id=me.peer_id, stage=0, state="active", issued_at=now)
    view = newest_per_peer({0: [new], 1: [old]})
    assert view == {0: [new], 1: []}
    gone = NodeRecord(run_id="run0", peer_id=me.peer_id, stage=0, state="leaving", issued_at=now)
    assert newest_per_peer({0: [gone], 1: [old]}) == {0: [], 1: []}


# ---- run discovery: signed pointers, several runs listed, never a silent pick ---------------


class FakeDHT:
    """Just the two calls fetch_manifest makes, over a dict."""

    def __init__(self, data: dict) -> None:
        self.data = data

    async def get(self, key: str, latest: bool = True):
        return self.data.get(key)

    async def get_many(self, keys, latest: bool = True):  # noqa: ANN001
        return {key: self.data.get(key) for key in keys}


def _run(manifest, publisher: Identity, **fields) -> tuple[str, dict]:
    pointer = RunPointer(
        run_id=manifest.run_id, name=manifest.run.name, publisher=publisher.peer_id, **fields
    )
    return manifest.run_id, pointer.sign(publisher)


def _other_manifest(name: str):
    text = load_manifest("tiny").to_toml().replace('name = "tiny"', f'name = "{name}"')
    from agora_node.protocol.manifest import parse_manifest

    return parse_manifest(text)


def test_forged_pointers_are_ignored_and_several_valid_runs_fail_in_one_line():
    tiny, boot, stranger = load_manifest("tiny"), Identity.generate(), Identity.generate()
    other = _other_manifest("not-yours")
    pointers = dict([_run(tiny, boot)])
    pointers["f" * 16] = b"hijack"  # unsigned, as main stores it
    pointers["e" * 16] = {"r": b"{}", "s": b"x"}
    data = {
        run_pointer_key(): pointers,
        manifest_key(tiny.run_id): tiny.canonical_bytes(),
        manifest_key(other.run_id): other.canonical_bytes(),
    }
    # Only forged extras: the one real run is joined.
    assert asyncio.run(fetch_manifest(FakeDHT(data), None)).run_id == tiny.run_id
    # A pointer signed by a stranger for a run whose manifest is missing: ignored too.
    lone = _other_manifest("no-manifest")
    pointers.update(dict([_run(lone, stranger)]))
    assert asyncio.run(fetch_manifest(FakeDHT(data), None)).run_id == tiny.run_id
    # A second valid run: one line naming both, and how to choose.
    pointers.update(dict([_run(other, stranger)]))
    with pytest.raises(RunChoiceError) as info:
        asyncio.run(fetch_manifest(FakeDHT(data), None))
    message = str(info.value)
    assert "\n" not in message
    for needle in (tiny.run_id, "'tiny'", other.run_id, "'not-yours'", "--run", "--manifest"):
        assert needle in message, message
    assert "f" * 16 not in message and lone.run_id not in message
    # --run chooses; an unknown --run says what is served.
    assert asyncio.run(fetch_manifest(FakeDHT(data), None, other.run_id)).run.name == "not-yours"
    with pytest.raises(RunDiscoveryError, match="does not serve your manifest.*'tiny'"):
        asyncio.run(fetch_manifest(FakeDHT(data), _other_manifest("mine")))
    with pytest.raises(RunDiscoveryError, match="does not serve run 0123456789abcdef"):
        asyncio.run(fetch_manifest(FakeDHT(data), None, "0123456789abcdef"))


def test_a_pointer_that_lies_about_the_name_neither_renames_nor_hides_the_run():
    """A stranger's pointer for the real run id under another name (with a longer ttl it
    outlives the publisher's under the same subkey): the run is still joined, under the
    name its manifest gives; one more run announced, the choice names it rightly."""
    tiny, stranger = load_manifest("tiny"), Identity.generate()
    liar = RunPointer(run_id=tiny.run_id, name="free-gpus", publisher=stranger.peer_id)
    other = _other_manifest("not-yours")
    data = {
        run_pointer_key(): {tiny.run_id: liar.sign(stranger)},
        manifest_key(tiny.run_id): tiny.canonical_bytes(),
        manifest_key(other.run_id): other.canonical_bytes(),
    }
    assert asyncio.run(fetch_manifest(FakeDHT(data), None)).run_id == tiny.run_id
    data[run_pointer_key()].update(dict([_run(other, stranger)]))
    with pytest.raises(RunChoiceError) as info:
        asyncio.run(fetch_manifest(FakeDHT(data), None))
    assert "'tiny'" in str(info.value) and "free-gpus" not in str(info.value)


def test_pointers_without_a_manifest_cannot_crowd_out_the_run():
    """Many signed pointers whose run ids sort before the real one (free to make): the run
    whose manifest is in the DHT is still found."""
    tiny, stranger = load_manifest("tiny"), Identity.generate()
    pointers = dict([_run(tiny, Identity.generate())])
    for i in range(40):
        fake = RunPointer(run_id=f"{i:016x}", name="x", publisher=stranger.peer_id)
        pointers[fake.run_id] = fake.sign(stranger)
    assert all(k < tiny.run_id for k in pointers if k != tiny.run_id)
    data = {run_pointer_key(): pointers, manifest_key(tiny.run_id): tiny.canonical_bytes()}
    assert asyncio.run(fetch_manifest(FakeDHT(data), None)).run_id == tiny.run_id
