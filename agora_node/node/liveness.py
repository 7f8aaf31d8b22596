"""Who is alive, in the daemon: SWIM gossip (comms/membership), fed by the directory.

The directory only introduces peers; whether they are alive, dead or gone is
decided by SWIM with Lifeguard, so a crashed peer leaves routing in seconds
instead of a record TTL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agora_node.comms.host import Host
from agora_node.comms.membership.messages import MemberMeta, Status
from agora_node.comms.membership.p2p import MembershipService
from agora_node.protocol.identity import Identity
from agora_node.protocol.names import swim_namespace

MAX_INTRODUCED = 8192
"""Peers remembered as introduced (a forgotten one is merely introduced again)."""


class Liveness:
    def __init__(self) -> None:
        self.service: MembershipService | None = None
        self._introduced: dict[str, None] = {}  # bounded: oldest forgotten first

    async def start(
        self,
        host: Host,
        identity: Identity,
        run_id: str,
        seeds: list[str],
        meta: MemberMeta,
        on_refuse: Callable[[str, str], None] | None = None,
    ) -> None:
        self.service = MembershipService(
            host.p2p,
            identity,
            seeds=seeds,
            meta=meta,
            namespace=swim_namespace(run_id),
            on_refuse=on_refuse,
        )
        await self.service.start()

    def introduce(self, peers: list[str]) -> None:
        """Peers the directory shows: SWIM probes the ones it has not met yet."""
        fresh = [p for p in peers if p not in self._introduced]
        if fresh and self.service is not None:
            self.service.join(fresh)
            self._introduced.update(dict.fromkeys(fresh))
            for old in list(self._introduced)[: max(0, len(self._introduced) - MAX_INTRODUCED)]:
                del self._introduced[old]

    def gone(self) -> set[str]:
        """Peers declared dead or that left (faster than record expiry)."""
        if self.service is None:
            return set()
        return {m.peer_id for m in self.service.members() if m.status in (Status.DEAD, Status.LEFT)}

    def announce(self, stage: int, state: str) -> None:
        if self.service is not None:
            self.service.update_meta(stage=stage, state=state)

    async def leave(self, linger_s: float = 1.0) -> None:
        """Tell the others this is a leave, not a failure."""
        if self.service is not None:
            await self.service.leave(linger_s=linger_s)

    async def stop(self) -> None:
        if self.service is not None:
            await self.service.stop()

    def status(self) -> dict[str, Any]:
        if self.service is None:
            return {}
        return {
            "view": [
                {
                    "peer_id": m.peer_id,
                    "status": m.status.name.lower(),
                    "stage": m.meta.stage,
                    "state": m.meta.state,
                }
                for m in self.service.members()
            ],
            "counters": self.service.counters,
        }
