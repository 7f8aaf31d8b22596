"""Who is alive, in the daemon: SWIM gossip (comms/membership), fed by the directory.

The directory only introduces peers; whether they are alive, dead or gone is
decided by SWIM with Lifeguard, so a crashed peer leaves routing in seconds
instead of a record TTL.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from agora_node.comms.host import Host
from agora_node.comms.membership.members import LIVE, MemberView
from agora_node.comms.membership.messages import MemberMeta, Status
from agora_node.comms.membership.p2p import MembershipService
from agora_node.protocol.identity import Identity
from agora_node.protocol.names import swim_namespace

RECENT_EVENTS = 50
"""Membership events the status page lists (`Liveness.events`)."""
_EVENT = {Status.SUSPECT: "suspected", Status.DEAD: "dead", Status.LEFT: "left"}


def membership_event(previous: Status | None, view: MemberView) -> str | None:
    """What a member's change of status means to an operator: "joined" (first seen
    alive), "suspected", "dead", "left", "alive" (back from suspected or dead); None
    when its status did not change."""
    if previous == view.status:
        return None
    if view.status == Status.ALIVE:
        return "joined" if previous is None else "alive"
    return _EVENT.get(view.status)


MAX_INTRODUCED = 8192
"""Peers remembered as introduced (a forgotten one is merely introduced again)."""
MAX_LAST = 2 * 8192
"""Members whose last status is kept (twice SWIM's table): SWIM's table is bounded by
eviction, this one was not (self-signed records of fresh keys grew it without end)."""


class Liveness:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.service: MembershipService | None = None
        self._introduced: dict[str, None] = {}  # bounded: oldest forgotten first
        self._clock = clock
        self._last: dict[str, tuple[Status, int | None]] = {}
        self.events: deque[dict[str, Any]] = deque(maxlen=RECENT_EVENTS)
        """Recent membership changes as this node saw them, oldest first."""
        self.on_gone: list[Callable[[str], None]] = []
        """Called with a peer's id when SWIM declares it dead or it leaves."""

    async def start(
        self,
        host: Host,
        identity: Identity,
        run_id: str,
        seeds: list[str],
        meta: MemberMeta,
        admit: Callable[[str], bool] | None = None,
        on_refuse: Callable[[str, str], None] | None = None,
    ) -> None:
        """`admit`: a private swarm's allow list (messages and members of others are dropped)."""
        self.service = MembershipService(
            host.p2p,
            identity,
            seeds=seeds,
            meta=meta,
            namespace=swim_namespace(run_id),
            admit=admit,
            on_refuse=on_refuse,
        )
        self.service.subscribe(self.note)
        await self.service.start()

    def note(self, view: MemberView) -> None:
        """SWIM's listener: keep status changes and stage moves as events."""
        previous = self._last.pop(view.peer_id, None)
        status, stage = previous or (None, None)
        self._last[view.peer_id] = (view.status, view.meta.stage)  # newest last
        if len(self._last) > MAX_LAST:  # fresh keys are free: forget the longest quiet
            del self._last[next(iter(self._last))]
        event = membership_event(status, view)
        if event is None and stage is not None and stage >= 0 and view.meta.stage != stage:
            event = "moved"
        if event in ("dead", "left"):
            for listener in self.on_gone:
                listener(view.peer_id)
        if event is not None:
            self.events.append(
                {
                    "at": self._clock(),
                    "peer_id": view.peer_id,
                    "event": event,
                    "stage": view.meta.stage,
                }
            )

    def introduce(self, peers: list[str]) -> None:
        """Peers the directory shows: SWIM probes the ones it has not met yet."""
        fresh = [p for p in peers if p not in self._introduced]
        if fresh and self.service is not None:
            self.service.join(fresh)
            self._introduced.update(dict.fromkeys(fresh))
            for old in list(self._introduced)[: max(0, len(self._introduced) - MAX_INTRODUCED)]:
                del self._introduced[old]

    def unlisted(self, listed: set[str], limit: int) -> list[str]:
        """Up to `limit` peers SWIM finds alive that are not in `listed` (the directory):
        after a healed partition, the other half (SWIM meets it again, the DHT does not:
        Host.meet). Random, so a crowd of unlisted strangers cannot hide the others."""
        if self.service is None:
            return []
        found = [m.peer_id for m in self.service.alive_members() if m.peer_id not in listed]
        return random.sample(found, min(limit, len(found)))

    def gone(self) -> set[str]:
        """Peers declared dead or that left (faster than record expiry)."""
        if self.service is None:
            return set()
        return {m.peer_id for m in self.service.members() if m.status in (Status.DEAD, Status.LEFT)}

    def rtt(self, peer_id: str) -> float | None:
        """Our probes' round trip to a peer (seconds), None until one was answered."""
        return None if self.service is None else self.service.rtt(peer_id)

    def answered(self, peer_id: str) -> bool:
        """Alive (or suspected) and answered our own probes directly at least once: a host
        runs behind that peer id (an ack counts only from the peer probed, authenticated
        by libp2p; a late one too: a peer farther than the probe timeout never had a round
        trip, and never counted). A dead member keeps its round trips for a while: it does
        not count."""
        if self.service is None:
            return False
        member = self.service.get(peer_id)
        if member is None or member.status not in LIVE:
            return False
        return member.acked or self.rtt(peer_id) is not None

    def rtt_ms(self, peer_id: str) -> float | None:
        """`rtt` in milliseconds, rounded for the status page."""
        rtt = self.rtt(peer_id)
        return None if rtt is None else round(rtt * 1000, 1)

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
                    "rtt_ms": self.rtt_ms(m.peer_id),
                }
                for m in self.service.members()
            ],
            "counters": self.service.counters,
            "events": list(self.events),
        }
