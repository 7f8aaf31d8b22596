"""This node's side of admission: its allow list in a private swarm (`--allow-keys`),
the refusals it counted, and whether the swarm's peers admit it (comms/admission.py).

In an open swarm there is no list (`allow` is None: every predicate is None, nothing
is refused) and the node still asks its peers, so an unlisted node learns it is one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from hivemind.p2p import P2P

from agora_node.comms import admission
from agora_node.node.errors import JoinError
from agora_node.protocol.allowlist import AllowList, AllowListError

log = logging.getLogger(__name__)


class Admittance:
    def __init__(self, allow_keys: str | None, peer_id: str) -> None:
        self.peer_id = peer_id
        self.allow = AllowList(allow_keys) if allow_keys else None
        if self.allow is not None and peer_id not in self.allow:
            raise JoinError(
                f"--allow-keys {allow_keys} does not list this node's own peer id "
                f"{peer_id}: add it (or use another identity) to join this private swarm"
            )
        self.refused_counts: dict[str, int] = {}
        """Inputs refused because their peer is not on the allow list, by kind."""
        self.asked = admission.Admission()

    def admit(self, what: str) -> Callable[[str], bool] | None:
        """The predicate an entry point of kind `what` checks peers with (None: open)."""
        return self.allow.admit(what) if self.allow is not None else None

    def take_refused(self) -> dict[str, int]:
        """Refusals since the last call, also added to `refused_counts`."""
        if self.allow is None:
            return {}
        new = self.allow.take_refused()
        for what, count in new.items():
            self.refused_counts[what] = self.refused_counts.get(what, 0) + count
        return new

    async def ask(self, p2p: P2P, run_id: str, peers: list[str]) -> str | None:
        """Ask the peers not asked yet (or not lately) whether they admit this node; the
        one line to stop with, when `Admission.refusal` gives one."""
        now = time.monotonic()
        due = self.asked.to_ask(peers, now)
        if not due:
            return None
        return await admission.ask_all(p2p, run_id, due, self.asked, now)

    def reload(self, *, only_if_changed: bool = False) -> None:
        """Re-read --allow-keys (SIGUSR1, or its file changed); a bad file keeps the old list."""
        if self.allow is None:
            return
        try:
            reload = self.allow.reload_if_changed if only_if_changed else self.allow.reload
            if not reload():
                return
        except AllowListError as exc:
            log.error("--allow-keys not reloaded: %s", exc)
            return
        log.info("--allow-keys reloaded: %d keys", len(self.allow.keys))
        if self.peer_id not in self.allow:
            log.warning("--allow-keys no longer lists this node (%s)", self.peer_id)
