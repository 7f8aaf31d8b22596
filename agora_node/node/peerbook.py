"""Peers a node has seen, remembered in its data dir, so that a restart can rejoin the
swarm when the peers on its command line are gone (the bootstrap is only an entry point).

`peers.json` holds at most `MAX_ADDRS` multiaddrs (two of each of `MAX_PEERS` peers),
each ending in `/p2p/<peer id>` (libp2p refuses a connection to a host whose key is not
that peer's, so an address a hostile record lists can waste a dial, not redirect us).
The node writes it from the directory (`pick`: active peers, their most dialable
address, and a private one beside a public one) when the set changes, at most once
per `SAVE_EVERY_S`, atomically; `load` reads it back bounded and checked, and treats a
missing, oversized or malformed file as empty (one warning), never as a reason not to
start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from agora_node.comms.host import is_relayed, is_valid_maddr
from agora_node.comms.reachability import address_scope, addrs_by_peer
from agora_node.node.datadir import write_atomically
from agora_node.protocol.records import NodeRecord, NodeState

log = logging.getLogger(__name__)

FILE_NAME = "peers.json"
BOOTSTRAP_FILE_NAME = "bootstrap-peers.json"
"""A bootstrap's (it may share a data dir with a node of another run)."""
MAX_PEERS = 8
MAX_ADDRS = 2 * MAX_PEERS
"""Addresses kept: a public and a private one of each peer, at most."""
MAX_ADDR_CHARS = 256
MAX_FILE_BYTES = 16 * 1024
SAVE_EVERY_S = 30.0


def usable(addr: object) -> bool:
    """A multiaddr string that names the peer it reaches (`.../p2p/<id>`)."""
    if not isinstance(addr, str) or not 0 < len(addr) <= MAX_ADDR_CHARS or "/p2p/" not in addr:
        return False
    return is_valid_maddr(addr)


_NEVER = frozenset({"link-local", "multicast", "unspecified"})
_RANK = {"global": 0, "private": 1, "other": 2, "loopback": 3}


def _preference(addr: str) -> int:
    """Public addresses first, then private ones, then names and the like, loopback
    last: the one most likely dialable from elsewhere is remembered."""
    return _RANK.get(address_scope(addr), 4)


def _dialable(addr: str, suffix: str) -> str | None:
    """`addr` ending in `suffix` (the record's peer), or None for one that is a relay's,
    another peer's or no peer's (a stranger's record may list such addresses to aim our
    dials there: link-local, multicast, unspecified, a zoned IPv6 one). A DNS name is
    kept: where it resolves is not known here, and a dial to the wrong host fails on the
    peer's key."""
    if is_relayed(addr) or address_scope(addr) in _NEVER or addr.startswith("/ip6zone/"):
        return None
    if addr.endswith(suffix):
        full = addr
    elif "/p2p/" in addr:  # another peer's id: not an address of this one
        return None
    else:
        full = addr + suffix
    return full if usable(full) else None


def pick(
    records: Iterable[NodeRecord],
    me: str,
    salt: bytes = b"",
    answered: Callable[[str], bool] = lambda peer: False,
) -> list[str]:
    """The most dialable address of each active peer other than `me` (and its best
    private one too when that is a public one: hosts behind the same NAT may not reach
    their public address), for at most MAX_PEERS peers: first those that `answered`
    (the node's own membership probes, directly: a host runs behind that peer id), then
    the others, each in the order of sha256(salt + peer id): stable from one refresh to
    the next, and with a secret salt (PeerBook's) not an order a stranger can grind peer
    ids to come first in (by peer id, eight ground ids took every place). Records are
    free to publish, a host answering under each id is not: 100 strangers' records with
    no host behind them took 7 or 8 of the 8 places for 171 of 200 salts, and take none
    now while 8 peers answer."""
    chosen: list[str] = []
    peers = 0
    order = sorted(
        records,
        key=lambda r: (
            not answered(r.peer_id),
            hashlib.sha256(salt + r.peer_id.encode()).digest(),
        ),
    )
    for record in order:
        if record.peer_id == me or record.state != NodeState.ACTIVE:
            continue
        suffix = f"/p2p/{record.peer_id}"
        found = sorted(filter(None, (_dialable(a, suffix) for a in record.addrs)), key=_preference)
        if not found:
            continue
        chosen.append(found[0])
        private = [a for a in found if address_scope(a) == "private"]
        if address_scope(found[0]) == "global" and private:
            chosen.append(private[0])
        peers += 1
        if peers == MAX_PEERS:
            break
    return chosen


def load(data_dir: str | os.PathLike, file_name: str = FILE_NAME) -> list[str]:
    path = Path(data_dir) / file_name
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
        raw = json.loads(path.read_text())
        if not isinstance(raw, list):
            raise ValueError("not a list")
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        log.warning("ignoring remembered peers in %s: %s", path, exc)
        return []
    return [a for a in raw if usable(a)][:MAX_ADDRS]


def save(data_dir: str | os.PathLike, addrs: list[str], file_name: str = FILE_NAME) -> None:
    write_atomically(Path(data_dir) / file_name, json.dumps(addrs[:MAX_ADDRS]).encode())


class PeerBook:
    """The node's remembered peers: what to add to `--initial-peers`, and saving the view."""

    def __init__(
        self,
        data_dir: str | os.PathLike,
        clock=time.monotonic,  # noqa: ANN001
        file_name: str = FILE_NAME,
    ) -> None:
        self.data_dir, self.clock, self.file_name = data_dir, clock, file_name
        self.salt = os.urandom(16)
        self.saved = load(data_dir, file_name)
        self._saved_at = -SAVE_EVERY_S

    def initial_peers(self, given: list[str]) -> list[str]:
        """The peers given on the command line first, then the remembered ones."""
        return list(given) + [a for a in self.saved if a not in given]

    def to_meet(self, given: list[str]) -> dict[str, list[str]]:
        """`initial_peers(given)` as Host.meet takes them: peer id -> addresses to dial."""
        return addrs_by_peer(self.initial_peers(given))

    def update(
        self,
        records: Iterable[NodeRecord],
        me: str,
        answered: Callable[[str], bool] = lambda peer: False,
    ) -> bool:
        """Remember the directory's active peers if they changed (rate-limited), those that
        `answered` first (`pick`); True when the file was written. An empty view never
        replaces a remembered one."""
        chosen = pick(records, me, self.salt, answered)
        if not chosen or set(chosen) == set(self.saved):
            return False
        if self.clock() - self._saved_at < SAVE_EVERY_S:
            return False
        try:
            save(self.data_dir, chosen, self.file_name)
        except OSError as exc:
            log.warning("could not remember peers in %s: %s", self.data_dir, exc)
            return False
        self.saved, self._saved_at = chosen, self.clock()
        return True
