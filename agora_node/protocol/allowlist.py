"""The allow list of a private swarm (`--allow-keys FILE`): which peer ids take part.

The file lists one key per line: a peer id (`12D3KooW...`, an Ed25519 identity
peer id) or a raw Ed25519 public key as 64 hex digits (turned into its peer id).
`#` starts a comment; blank lines are skipped. Every entry is checked, and a bad
line is reported as `FILE:LINE: why`, so a typo never silently locks a peer out.

Everything a node believes is attributed to a peer id that libp2p or a signature
authenticates (the remote of a stream or RPC, the signer of a record or round
entry), so the list is enforced by that id alone. `AllowList.check` answers and
counts each refusal by what was refused ("record", "stream", ...). The file is
re-read when its modification time changes (`reload_if_changed`); a reload that
fails keeps the previous list and says why.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from pathlib import Path

from agora_node.protocol.identity import (
    IdentityError,
    peer_id_from_public_key,
    public_key_from_peer_id,
)

MAX_KEYS = 65536
"""More lines than any private swarm needs: a bound on what one file may hold."""


class AllowListError(ValueError):
    """An allow-list file that cannot be used (one line for the operator)."""


def parse_key(text: str) -> str:
    """The peer id one entry names (a peer id or 64 hex digits of an Ed25519 public key)."""
    if len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text):
        return peer_id_from_public_key(bytes.fromhex(text))
    try:
        public_key_from_peer_id(text)
    except IdentityError:
        raise AllowListError(
            f"{text[:60]!r} is neither an Ed25519 peer id (12D3KooW...) nor a 64-hex-digit "
            "Ed25519 public key"
        ) from None
    return text


def parse_allow_keys(text: str, source: str = "<allow-keys>") -> frozenset[str]:
    """The peer ids listed in `text`; AllowListError naming `source:line` for a bad line
    and for a list with no key at all (a private swarm of nobody is a mistake)."""
    keys: set[str] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        if len(entry.split()) != 1:
            raise AllowListError(f"{source}:{number}: one key per line, not {entry[:60]!r}")
        try:
            keys.add(parse_key(entry))
        except (AllowListError, IdentityError) as exc:
            raise AllowListError(f"{source}:{number}: {exc}") from None
        if len(keys) > MAX_KEYS:
            raise AllowListError(f"{source}:{number}: more than {MAX_KEYS} keys")
    if not keys:
        raise AllowListError(f"{source}: lists no key (a private swarm needs at least this node)")
    return frozenset(keys)


def read_allow_keys(path: str | os.PathLike) -> tuple[frozenset[str], float]:
    """The keys in the file at `path` and its modification time."""
    try:
        stat = os.stat(path)
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise AllowListError(f"{path}: no such allow-keys file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise AllowListError(f"{path}: cannot read it ({exc})") from None
    return parse_allow_keys(text, str(path)), stat.st_mtime_ns


def refusal_message(remote: str, me: str) -> str:
    """What an unlisted peer is told (and logs) when a listed node refuses it."""
    return f"this swarm admits only listed keys; {remote} is not on {me}'s list"


class AllowList:
    """The peer ids of a private swarm, reloadable, with a count of what it refused."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        self.keys, self._mtime = read_allow_keys(path)
        self.refused: Counter[str] = Counter()
        """Refusals by what was refused (record, round_entry, stream, rpc, membership, ...)."""
        self._lock = threading.Lock()  # counted from the event loop and the DHT's callbacks

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self.keys

    def check(self, peer_id: str, what: str) -> bool:
        """Whether `peer_id` is listed; a refusal is counted under `what`."""
        if peer_id in self.keys:
            return True
        with self._lock:
            self.refused[what] += 1
        return False

    def admit(self, what: str):  # noqa: ANN201 - a predicate for one kind of input
        """`check` for one kind of input, as the `admit(peer_id) -> bool` the comms layer takes."""
        return lambda peer_id: self.check(peer_id, what)

    def take_refused(self) -> Counter[str]:
        """The refusals counted since the last call (and reset)."""
        with self._lock:
            taken, self.refused = self.refused, Counter()
        return taken

    def reload_if_changed(self) -> bool:
        """Re-read the file if its modification time changed; True if the list was replaced.
        A file that became unreadable or invalid raises AllowListError and keeps the old list."""
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError as exc:
            raise AllowListError(f"{self.path}: cannot read it ({exc}); keeping the list") from None
        if mtime == self._mtime:
            return False
        self._mtime = mtime  # a bad file is reported once, not on every check
        return self.reload()

    def reload(self) -> bool:
        """Re-read the file now; True if the list changed (AllowListError keeps the old one)."""
        keys, mtime = read_allow_keys(self.path)
        changed, self.keys, self._mtime = keys != self.keys, keys, mtime
        return changed
