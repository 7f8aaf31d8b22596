"""Round entries: what a replica of a stage signs to enter an outer round (groups.py).

Each entry is a small JSON object signed with the Ed25519 key its peer id commits to,
verified on every read against the subkey it is stored under and the run, stage and
round it is read for. Fields of newer peers are ignored, fields of the wrong type make
the entry ignored (`EntryError`), and entries stay far below the 8 KiB limit of
hivemind DHT values.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from dataclasses import asdict, dataclass
from typing import Any

from agora_node.protocol.identity import Identity, verify
from agora_node.protocol.storable import finite_number

MAX_ENTRY_BYTES = 1024
MAX_FLAGS = 8
"""Peers one entry may name as banned (8 peer ids keep an entry under MAX_ENTRY_BYTES)."""
MAX_PEER_ID_CHARS = 64
VIEW_DIGEST_CHARS = 32


class EntryError(ValueError):
    """A round entry that must be ignored."""


@dataclass(frozen=True, kw_only=True)
class RoundEntry:
    peer_id: str
    run_id: str
    stage: int
    round: int
    joined_at: float
    digest: str = ""
    """Hash of the peer's anchor: a group whose anchors all agree skips the anchor mix."""
    warming: bool = False
    flags: tuple[str, ...] = ()
    """Peers its author has banned (node/suspects.py); older peers ignore the field."""
    done: bool = False
    """Its author finished the round (`Matchmaker.finish`): it takes part in no more of the
    round's mixes."""
    view: str = ""
    """With `done`: the digest of the participant list its author closed the round with
    (`view_digest`); a peer still gathering the round compares its own with it
    (`finished_apart`)."""

    @classmethod
    def _from_body(cls, body: Any) -> RoundEntry:
        return cls(**_check_fields(body))

    def canonical_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    def sign(self, identity: Identity) -> dict[str, bytes]:
        data = self.canonical_bytes()
        return {"r": data, "s": identity.sign(data)}

    @classmethod
    def verified(
        cls, value: Any, *, peer_id: str, run_id: str, stage: int, round_no: int
    ) -> RoundEntry:
        if not isinstance(value, dict) or not isinstance(value.get("r"), bytes):
            raise EntryError("not a signed entry")
        data, sig = value["r"], value.get("s")
        if len(data) > MAX_ENTRY_BYTES or not isinstance(sig, bytes):
            raise EntryError("oversized or unsigned entry")
        if not verify(peer_id, data, sig):
            raise EntryError("signature does not verify")
        try:
            body = json.loads(data)
        except (ValueError, RecursionError) as exc:  # signed "[[[[..." nests too deep
            raise EntryError(f"malformed entry: {exc}") from None
        entry = cls._from_body(body)
        if (entry.peer_id, entry.run_id, entry.stage, entry.round) != (
            peer_id,
            run_id,
            stage,
            round_no,
        ):
            raise EntryError("entry for another peer, run, stage or round")
        return entry


_FIELD_TYPES = {
    "peer_id": str,
    "run_id": str,
    "stage": int,
    "round": int,
    "joined_at": (int, float),
    "digest": str,
    "warming": bool,
    "flags": list,
    "done": bool,
    "view": str,
}


def _check_fields(body: Any) -> dict[str, Any]:
    """Known fields with the right types; unknown fields (newer peers) are ignored."""
    if not isinstance(body, dict):
        raise EntryError("entry is not an object")
    # an optional field sent as null takes its default (it never reaches the entry as None)
    known = {k: v for k, v in body.items() if k in _FIELD_TYPES and v is not None}
    for key, kind in _FIELD_TYPES.items():
        value = known.get(key)
        if key in ("digest", "warming", "flags", "done", "view") and value is None:
            continue
        bad_bool = isinstance(value, bool) and kind is not bool
        if not isinstance(value, kind) or bad_bool:
            raise EntryError(f"field {key} missing or of type {type(value).__name__}")
    if not finite_number(known["joined_at"]):
        raise EntryError("joined_at is not a finite number")
    flags = known.get("flags", [])
    if len(flags) > MAX_FLAGS or not all(
        isinstance(f, str) and 0 < len(f) <= MAX_PEER_ID_CHARS for f in flags
    ):
        raise EntryError("flags are not a short list of peer ids")
    known["flags"] = tuple(dict.fromkeys(flags))
    if len(known.get("view", "")) > VIEW_DIGEST_CHARS:
        raise EntryError("view digest too long")
    return known


def view_digest(entries: Collection[RoundEntry]) -> str:
    """A closed participant list, as a short digest (the same list gives the same one)."""
    ids = "\n".join(sorted({e.peer_id for e in entries}))
    return hashlib.sha256(ids.encode()).hexdigest()[:VIEW_DIGEST_CHARS]
