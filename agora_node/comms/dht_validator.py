"""hivemind glue for protocol/storable.py: every node's DHT refuses to store, and to
believe from other nodes, a value under a peer's subkey that the peer did not sign or
that claims to live longer than it says, a plain value anywhere but under the manifest
key its own bytes hash to, and values under subkeys of any other kind.

hivemind calls `validate` when another node asks this one to store a record, when a
node answers this one's read, and before this node stores its own values. It runs in
the DHT's process (the validator is pickled there), so refusals are not counted in
this node's status; readers' own checks (records.verify_record) still count what
reaches them.
"""

from __future__ import annotations

import logging

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from agora_node.protocol.names import manifest_key
from agora_node.protocol.storable import refusal

log = logging.getLogger(__name__)


class SignedSubkeys(RecordValidatorBase):
    """Only a peer writes under its own peer id's subkey, and only for its value's lifetime;
    a plain value only as a run's manifest under its own key (protocol/storable.py)."""

    def validate(self, record: DHTRecord) -> bool:
        try:
            subkey = MSGPackSerializer.loads(record.subkey) if record.subkey else None
        except Exception:  # noqa: BLE001 - not a subkey we wrote
            return False
        try:
            value = MSGPackSerializer.loads(record.value)
        except Exception:  # noqa: BLE001 - undecodable bytes: refused
            value = None

        def key_of_run(run_id: str) -> bool:
            return DHTID.generate(source=manifest_key(run_id)).to_bytes() == record.key

        def key_is(name: str) -> bool:
            return bool(name) and DHTID.generate(source=name).to_bytes() == record.key

        try:
            why = refusal(
                subkey,
                value,
                record.expiration_time,
                key_of_run=key_of_run,
                now=get_dht_time(),
                key_is=key_is,
            )
        except Exception as exc:  # noqa: BLE001 - a value no check foresaw: refused, not raised
            why = f"{type(exc).__name__} while checking it"  # (into hivemind's batched answer)
        if why is not None:
            log.debug("DHT refused a value under %s: %s", str(subkey)[-8:], why)
        return why is None
