"""What a DHT node stores under a peer's subkey (protocol/storable.py)."""

import json
import time

import pytest

from agora_node.comms.collective.entries import RoundEntry
from agora_node.protocol.identity import Identity
from agora_node.protocol.records import NodeRecord, RunPointer
from agora_node.protocol.storable import STORE_SLACK_S, UNSTATED_LIFETIME_S, refusal

pytestmark = pytest.mark.timeout(30)


def _record(owner: Identity, ttl: float = 6.0) -> tuple[dict, float]:
    record = NodeRecord(run_id="r" * 16, peer_id=owner.peer_id, stage=0, state="active", ttl=ttl)
    return record.sign(owner), record.issued_at


def test_the_owner_s_record_within_its_lifetime_is_stored():
    owner = Identity.generate()
    value, issued = _record(owner)
    assert refusal(owner.peer_id, value, issued + 6.0) is None
    assert refusal(owner.peer_id, value, issued + 7.0) is None  # withdraw: one second more


def test_junk_or_another_signer_under_a_peer_s_subkey_is_refused():
    owner, stranger = Identity.generate(), Identity.generate()
    later = time.time() + 10
    assert refusal(owner.peer_id, b"junk", later) == "unsigned value"
    assert refusal(owner.peer_id, {"r": b"{}", "s": b"x"}, later) == "no time of signing"
    theirs, issued = _record(stranger)
    assert refusal(owner.peer_id, theirs, issued + 5) == "not signed by the subkey's peer"
    forged = dict(_record(owner)[0])
    forged["r"] = forged["r"].replace(b'"stage":0', b'"stage":1')
    assert refusal(owner.peer_id, forged, issued + 5) == "not signed by the subkey's peer"
    big = {"r": b" " * 9000, "s": b"x"}
    assert refusal(owner.peer_id, big, later) == "oversized"


def test_a_copy_of_the_owner_s_record_with_a_far_expiry_is_refused():
    """The squatting attack: a real signed record re-stored to outlive the owner's stores."""
    owner = Identity.generate()
    value, issued = _record(owner)
    assert refusal(owner.peer_id, value, issued + 6.0 + STORE_SLACK_S + 1) == (
        "expiry beyond the value's lifetime"
    )
    assert refusal(owner.peer_id, value, issued + 3600) is not None
    assert refusal(owner.peer_id, value, float("inf")) is not None


def test_lifetimes_out_of_range_are_refused_before_any_signature_work():
    owner = Identity.generate()
    for ttl in (0, -1, 10**9, "6", True):
        body = {"issued_at": time.time(), "ttl": ttl}
        data = json.dumps(body).encode()
        assert refusal(owner.peer_id, {"r": data, "s": owner.sign(data)}, time.time()) == (
            "lifetime out of range"
        )


def test_numbers_beyond_float_range_are_refused_not_raised():
    """JSON allows integers of any size: math.isfinite(10**400) raises OverflowError, which
    inside hivemind's store would throw away the whole batched answer."""
    owner = Identity.generate()
    for body in ({"issued_at": 10**400}, {"issued_at": time.time(), "ttl": 10**400}):
        data = json.dumps(body).encode()
        assert refusal(owner.peer_id, {"r": data, "s": owner.sign(data)}, time.time()) in (
            "no time of signing",
            "lifetime out of range",
        )
    record, issued = _record(owner)
    assert refusal(owner.peer_id, record, 10**400) == "expiry beyond the value's lifetime"


def test_round_entries_live_their_unstated_lifetime():
    owner = Identity.generate()
    entry = RoundEntry(
        peer_id=owner.peer_id, run_id="r" * 16, stage=0, round=3, joined_at=time.time()
    )
    value = entry.sign(owner)
    assert refusal(owner.peer_id, value, entry.joined_at + 60) is None
    assert refusal(owner.peer_id, value, entry.joined_at + UNSTATED_LIFETIME_S + 60) is not None


def test_run_pointers_only_for_their_run_signed_by_their_publisher_within_their_ttl():
    publisher, stranger = Identity.generate(), Identity.generate()
    run = "0123456789abcdef"
    pointer = RunPointer(run_id=run, name="tiny", publisher=publisher.peer_id)
    value = pointer.sign(publisher)
    assert refusal(run, value, pointer.issued_at + 120) is None
    assert refusal(run, value, pointer.issued_at + 3600) == "expiry beyond the value's lifetime"
    assert refusal("fedcba9876543210", value, pointer.issued_at + 60) == (
        "not a run pointer for this run"
    )
    assert refusal(run, b"hijack", pointer.issued_at + 60) == "unsigned value"
    forged = {"r": value["r"], "s": stranger.sign(value["r"])}
    assert refusal(run, forged, pointer.issued_at + 60) == "not signed by its publisher"


def test_other_subkeys_are_refused():
    """They were left to their readers, and a stranger's junk under them was kept."""
    for subkey in ("f" * 15, "x", "12D3KooWnot-a-peer-id-at-all-really-not-one-no", 7):
        assert refusal(subkey, b"anything", time.time() + 60) == "a subkey no agora value uses"


def test_a_plain_value_is_stored_only_as_a_manifest_under_its_own_key():
    """A plain value with a later expiry replaces a key's whole dictionary in hivemind: one
    under a stage's key emptied its directory for as long as the stranger chose."""
    from agora_node.stages.manifest_files import load_manifest

    manifest = load_manifest("tiny")
    raw, now = manifest.canonical_bytes(), time.time()
    at_its_key = {manifest.run_id}.__contains__  # the DHT's key is this run's manifest key
    elsewhere = {"0" * 16}.__contains__  # e.g. a stage's key
    assert refusal(None, raw, now + 120, key_of_run=at_its_key, now=now) is None
    assert refusal(None, raw, now + 120, key_of_run=elsewhere, now=now) == (
        "a plain value away from its own manifest key"
    )
    assert refusal(None, raw, now + 1e7, key_of_run=at_its_key, now=now) == (
        "expiry beyond a manifest's lifetime"
    )
    for junk in ({"r": b"x", "s": b"y"}, "text", b"\0" * (65 << 10)):
        assert refusal(None, junk, now + 60, key_of_run=lambda _: True, now=now) == (
            "a plain value that is not a manifest's bytes"
        )


def test_a_signed_value_is_stored_only_under_the_key_its_body_names():
    """One signed value under a run's manifest key became a dictionary there (later
    expiry): every later store of the manifest was refused, and nobody could join."""
    from agora_node.protocol.names import manifest_key, outer_round_key, stage_key

    owner, run = Identity.generate(), "0123456789abcdef"
    record = NodeRecord(run_id=run, peer_id=owner.peer_id, stage=2, state="active", ttl=6.0)
    value = record.sign(owner)

    def under(name: str):  # noqa: ANN202
        return lambda named: named == name

    later = record.issued_at + 5
    assert refusal(owner.peer_id, value, later, key_is=under(stage_key(run, 2))) is None
    for elsewhere in (manifest_key(run), stage_key(run, 1), outer_round_key(run, 2, 0)):
        assert refusal(owner.peer_id, value, later, key_is=under(elsewhere)) == (
            "stored under a key its body does not name"
        )
    entry = RoundEntry(peer_id=owner.peer_id, run_id=run, stage=2, round=7, joined_at=time.time())
    key = under(outer_round_key(run, 2, 7))
    assert refusal(owner.peer_id, entry.sign(owner), entry.joined_at + 60, key_is=key) is None


def test_a_value_signed_in_the_future_or_larger_than_readers_take_is_refused():
    """Signed 95 years ahead, a value lived as long (its expiry bounded only by its own
    signing time); and 8 KiB values no reader takes filled a key twice as fast."""
    owner = Identity.generate()
    ahead = NodeRecord(
        run_id="r" * 16, peer_id=owner.peer_id, stage=0, state="active", ttl=6.0,
        issued_at=time.time() + 3e9,
    )  # fmt: skip
    assert refusal(owner.peer_id, ahead.sign(owner), ahead.issued_at + 6) == "signed in the future"
    big = json.dumps({"issued_at": time.time(), "ttl": 6, "pad": "x" * 4200}).encode()
    assert refusal(owner.peer_id, {"r": big, "s": owner.sign(big)}, time.time()) == "oversized"


def test_a_run_pointer_is_stored_under_the_pointers_key_only():
    from agora_node.protocol.names import manifest_key, run_pointer_key

    publisher, run = Identity.generate(), "0123456789abcdef"
    pointer = RunPointer(run_id=run, name="tiny", publisher=publisher.peer_id)
    value, later = pointer.sign(publisher), pointer.issued_at + 60
    assert refusal(run, value, later, key_is=lambda k: k == run_pointer_key()) is None
    assert refusal(run, value, later, key_is=lambda k: k == manifest_key(run)) is not None
