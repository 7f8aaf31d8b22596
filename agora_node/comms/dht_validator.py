"""hivemind glue for protocol/storable.py: every node's DHT refuses to store, and to
believe from other nodes, a value under a peer's subkey that the peer did not sign or
that claims to live longer than it says.

hivemind calls `validate` when another node asks this one to store a record, when a
node answers this one's read, and before this node stores its own values. It runs in
the DHT's process (the validator is pickled there), so refusals are not counted in
this node's status; readers' own checks (records.verify_record) still count what
reaches them.
"""

from __future__ import annotations

import logging

from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from agora_node.protocol.storable import refusal

log = logging.getLogger(__name__)


class SignedSubkeys(RecordValidatorBase):
    """Only a peer writes under its own peer id's subkey, and only for its value's lifetime."""

    def validate(self, record: DHTRecord) -> bool:
        try:
            subkey = MSGPackSerializer.loads(record.subkey) if record.subkey else None
        except Exception:  # noqa: BLE001 - not a subkey we wrote: its readers decide
            return True
        try:
            value = MSGPackSerializer.loads(record.value)
        except Exception:  # noqa: BLE001 - undecodable bytes: refused under a peer's subkey
            value = None
        why = refusal(subkey, value, record.expiration_time)
        if why is not None:
            log.debug("DHT refused a value under %s: %s", str(subkey)[-8:], why)
        return why is None
