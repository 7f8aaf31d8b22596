"""What a node's DHT stores, or believes from another node, under a peer's subkey.

Directory records and round entries live under their signer's peer id as subkey,
and hivemind keeps, per subkey, the value with the latest expiry. Checked only when
read, a stranger could store junk under another peer's subkey with an expiry far in
the future, or re-store a copy of that peer's own signed value so, and the peer's
later, honest stores would be refused by every node holding it: its record would
vanish from the swarm until then. So every node's DHT (comms/dht_validator.py)
stores and believes a value under a subkey that is an Ed25519 peer id only if:

- it is a signed value `{"r": JSON bytes, "s": signature}` of at most
  MAX_SIGNED_BYTES, the signature made by that peer id's key;
- it is stored under the key its body names (`named_key`), and signed no later than
  now plus FUTURE_SLACK_S;
- its DHT expiry lies at most its own lifetime past the time it was signed:
  `issued_at` + `ttl` for records (at most MAX_RECORD_TTL_S), `joined_at` +
  UNSTATED_LIFETIME_S for round entries (whose lifetime is not signed), plus
  STORE_SLACK_S for the clock skew and the withdraw's extra second.

Under a subkey that is a run id (16 hex digits: the run pointers), likewise only a
signed run pointer for that run, signed by the publisher it names, not outliving its
`ttl` (at most MAX_POINTER_TTL_S). A stranger may still publish its own pointer to a
run (that is what an open DHT allows; it names the same, content-addressed run), but
no longer junk that hides the run's pointers.

A plain value (no subkey) is only ever a run's manifest, under the key named by its own
bytes' hash (`manifest_key(run id)`, the run id being that hash): stored only there, at
most MAX_PLAIN_BYTES, living at most MAX_PLAIN_LIFETIME_S. hivemind replaces a key's
whole dictionary by a plain value with a later expiry, so one stranger's plain value
under a stage's key had emptied that stage's directory (and refused every honest record
after it) for as long as the expiry it chose. Subkeys of any other kind are refused:
no agora value uses one, and junk under them only grows what readers must fetch.

What this does not replace: readers
still check everything (run, stage, ranges, freshness); a node of an older version
without the check still stores junk, and a reader then discards that node's whole
answer for the key (hivemind validates a dictionary as one).

Pure functions, tested without a network.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from typing import Any

from agora_node.protocol.identity import IdentityError, public_key_from_peer_id, verify
from agora_node.protocol.names import outer_round_key, run_pointer_key, stage_key
from agora_node.protocol.records import MAX_CLOCK_SKEW_S, MAX_POINTER_TTL_S, MAX_RECORD_TTL_S

FUTURE_SLACK_S = 60.0
"""How far ahead of this DHT node's clock a value may say it was signed. Generous: hivemind
validates a key's whole dictionary on a read, so a value one node's clock made "future" at
another would have had it drop every value stored under that key; freshness is the
readers' business, record by record (5 s)."""

MAX_SIGNED_BYTES = 4096
"""What readers take at most (records and pointers 4096, round entries 1024): junk of 8 KiB
a value, stored only to be refused by every reader, filled keys twice as fast."""
UNSTATED_LIFETIME_S = 900.0
"""The most a signed value that states no `ttl` may live past its time (round entries
live 60 s; the matchmaker's retries stay within its window)."""
RUN_ID_CHARS = 16
MAX_PLAIN_BYTES = 64 << 10
"""Above any manifest's canonical bytes (a few hundred)."""
MAX_PLAIN_LIFETIME_S = 3600.0
"""Manifests are stored for 2 minutes and re-stored while a node serves the run."""
STORE_SLACK_S = MAX_CLOCK_SKEW_S + 5.0
"""Between signing and the store's expiry: the withdraw's extra second, a slow store."""


def is_peer_subkey(subkey: Any) -> bool:
    """Whether a subkey names an Ed25519 peer id (then only that peer may write it)."""
    if not isinstance(subkey, str) or not 40 <= len(subkey) <= 60:
        return False
    try:
        public_key_from_peer_id(subkey)
    except (IdentityError, ValueError):
        return False
    return True


def is_run_subkey(subkey: Any) -> bool:
    """Whether a subkey is a run id (a run pointer's)."""
    return (
        isinstance(subkey, str)
        and len(subkey) == RUN_ID_CHARS
        and all(c in "0123456789abcdef" for c in subkey)
    )


def refusal(
    subkey: Any,
    value: Any,
    expiration_time: float,
    *,
    key_of_run: Callable[[str], bool] | None = None,
    now: float | None = None,
    key_is: Callable[[str], bool] | None = None,
) -> str | None:
    """Why a DHT node must not store `value` under `subkey` until `expiration_time`, or
    None if it may (see the module docstring). For a plain value (subkey None):
    `key_of_run(run_id)`, whether the value's key is that run's manifest key (the DHT
    knows keys only by their hash); `now`, the DHT's time. For a signed value:
    `key_is(name)`, whether it is stored under the key `name` (its body names it: a
    record its stage's, an entry its round's, a pointer the pointers')."""
    if subkey is None:
        return _plain_refusal(value, expiration_time, key_of_run, now)
    if is_peer_subkey(subkey):
        signer, max_ttl = subkey, MAX_RECORD_TTL_S
    elif is_run_subkey(subkey):
        signer, max_ttl = None, MAX_POINTER_TTL_S  # the publisher it names
    else:
        return "a subkey no agora value uses"
    if (
        not isinstance(value, dict)
        or not isinstance(value.get("r"), bytes)
        or not isinstance(value.get("s"), bytes)
    ):
        return "unsigned value"
    data = value["r"]
    if len(data) > MAX_SIGNED_BYTES:
        return "oversized"
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return "not JSON"
    if not isinstance(body, dict):
        return "not an object"
    if signer is None:
        if body.get("run_id") != subkey or not is_peer_subkey(body.get("publisher")):
            return "not a run pointer for this run"
        signer = body["publisher"]
    if key_is is not None and not key_is(named_key(body, pointer=is_run_subkey(subkey))):
        # one signed value under a run's manifest key (a dictionary there, with a later
        # expiry) had every later store of the manifest refused, and nobody could join
        return "stored under a key its body does not name"
    signed_at = body.get("issued_at", body.get("joined_at"))
    if not finite_number(signed_at):
        return "no time of signing"
    if signed_at > (time.time() if now is None else now) + FUTURE_SLACK_S:
        return "signed in the future"  # and so stored for as long as it liked
    ttl = body.get("ttl")
    if ttl is None and max_ttl == MAX_RECORD_TTL_S:
        lifetime = UNSTATED_LIFETIME_S
    elif finite_number(ttl) and 0 < ttl <= max_ttl:
        lifetime = float(ttl)
    else:
        return "lifetime out of range"
    if not finite_number(expiration_time) or expiration_time > signed_at + lifetime + STORE_SLACK_S:
        return "expiry beyond the value's lifetime"
    if not verify(signer, data, value["s"]):  # last: the cheap checks cost no Ed25519 work
        return (
            "not signed by the subkey's peer" if signer == subkey else "not signed by its publisher"
        )
    return None


def named_key(body: dict[str, Any], *, pointer: bool) -> str:
    """The DHT key a signed value's body names ("" when it names none): a run pointer's is
    the pointers' key; a round entry's (it has a round) its round's; a record's its stage's."""
    if pointer:
        return run_pointer_key()
    run, stage, round_no = body.get("run_id"), body.get("stage"), body.get("round")
    if not isinstance(run, str) or not _integer(stage):
        return ""
    if "round" in body:
        return outer_round_key(run, stage, round_no) if _integer(round_no) else ""
    return stage_key(run, stage)


def _integer(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _plain_refusal(
    value: Any,
    expiration_time: float,
    key_of_run: Callable[[str], bool] | None,
    now: float | None,
) -> str | None:
    if not isinstance(value, bytes) or len(value) > MAX_PLAIN_BYTES:
        return "a plain value that is not a manifest's bytes"
    now = time.time() if now is None else now
    if not finite_number(expiration_time) or expiration_time > now + MAX_PLAIN_LIFETIME_S:
        return "expiry beyond a manifest's lifetime"
    run_id = hashlib.sha256(value).hexdigest()[:RUN_ID_CHARS]  # Manifest.run_id's hash
    if key_of_run is None or not key_of_run(run_id):
        return "a plain value away from its own manifest key"
    return None


def finite_number(x: Any) -> bool:
    """`x` is an int or float (not a bool) within float range: JSON allows integers of
    any size, and `math.isfinite(10**400)` raises instead of answering."""
    if not isinstance(x, int | float) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False
