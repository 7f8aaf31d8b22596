"""Node records: why a record is ignored is a field of the error, not parsed from its text."""

import json

import pytest

from agora_node.protocol.identity import Identity
from agora_node.protocol.records import NodeRecord, RecordError, verify_record

pytestmark = pytest.mark.timeout(60)


def signed(identity: Identity, **fields) -> dict[str, bytes]:
    return NodeRecord(run_id="r", peer_id=identity.peer_id, stage=0, **fields).sign(identity)


def resigned(identity: Identity, body: dict) -> dict[str, bytes]:
    data = json.dumps(body).encode()
    return {"r": data, "s": identity.sign(data)}


def test_a_valid_record_verifies():
    me = Identity.generate()
    assert verify_record(signed(me), run_id="r", peer_id=me.peer_id).peer_id == me.peer_id


def test_each_rejection_carries_its_status_label():
    # The labels are keys of records_rejected in the status JSON and of the metric.
    me, other = Identity.generate(), Identity.generate()
    good = signed(me)
    body = json.loads(good["r"])
    cases = [
        ("not", "junk", {}),
        ("oversized", {"r": b"x" * 5000, "s": b"s"}, {}),
        ("record", {"r": b"{", "s": b"s"}, {}),
        ("record", good, {"run_id": "other"}),
        ("record", good, {"peer_id": other.peer_id}),
        ("signature", {**good, "s": other.sign(good["r"])}, {}),
        ("missing", resigned(me, {k: v for k, v in body.items() if k != "stage"}), {}),
        ("field", resigned(me, {**body, "stage": "0"}), {}),
        ("bad", resigned(me, {**body, "addrs": [1]}), {}),
        ("unknown", resigned(me, {**body, "state": "dancing"}), {}),
    ]
    for reason, value, overrides in cases:
        kwargs = {"run_id": "r", "peer_id": me.peer_id, **overrides}
        with pytest.raises(RecordError) as info:
            verify_record(value, **kwargs)
        assert info.value.reason == reason, (reason, str(info.value))
