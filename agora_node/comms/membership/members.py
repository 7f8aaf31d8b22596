"""The member table of one node: what it knows of every other member, the
precedence rules for news about them, and the indexes the protocol needs
(live count, dead and left members until forgotten, the probe round-robin)."""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field

from agora_node.comms.membership.lifeguard import Suspicion
from agora_node.comms.membership.messages import Item, MemberMeta, Status

LIVE = (Status.ALIVE, Status.SUSPECT)
RTT_SAMPLES = 8
"""Probe round trips remembered per member (a member is probed about every
members x probe interval, so this spans a few minutes in a swarm of tens)."""
ACCUSATIONS = (Status.SUSPECT, Status.DEAD)


@dataclass(frozen=True, slots=True)
class MemberView:
    """A member as this node sees it; also the event passed to listeners."""

    peer_id: str
    status: Status
    incarnation: int
    meta: MemberMeta
    since: float
    acked: bool = False
    """It answered one of this node's pings itself (a host runs behind its id)."""


@dataclass(slots=True)
class Member:
    peer_id: str
    status: Status
    incarnation: int
    meta: MemberMeta
    record: bytes  # its latest self-signed ALIVE or LEFT item, relayed verbatim
    since: float
    suspicion: Suspicion | None = None
    accusation: Item | None = None  # the signed SUSPECT/DEAD item behind its status
    rtts: list[float] = field(default_factory=list)
    """Round trips of our latest direct probes answered directly (seconds, newest last)."""
    acked: bool = False
    """It answered a ping of ours itself, in time for a round trip or not (a far peer)."""

    def add_rtt(self, seconds: float) -> None:
        self.rtts.append(seconds)
        del self.rtts[:-RTT_SAMPLES]

    def rtt(self) -> float | None:
        """The least of the recent round trips: a probe's time is the link's plus whatever
        both ends' event loops added, and the least is the nearest to the link's own."""
        return min(self.rtts) if self.rtts else None

    def view(self) -> MemberView:
        return MemberView(
            self.peer_id, self.status, self.incarnation, self.meta, self.since, self.acked
        )


class MemberTable:
    """Other members by peer id. Lists are kept in insertion order (never sets),
    so that a seeded simulation replays exactly."""

    def __init__(self, rng: random.Random) -> None:
        self.by_id: dict[str, Member] = {}
        self.live = 0  # members that are ALIVE or SUSPECT
        self._gone: dict[str, None] = {}  # DEAD or LEFT, until reaped
        self._recent_dead: list[tuple[float, str]] = []  # (since, peer), oldest first
        self._order: list[str] = []  # probe round-robin, may hold stale entries
        self._index = 0
        self._rng = rng

    def get(self, peer_id: str) -> Member | None:
        return self.by_id.get(peer_id)

    def add(self, member: Member) -> None:
        self.by_id[member.peer_id] = member
        self._track(member, was_live=False, changed=True)

    def set_status(self, member: Member, status: Status, incarnation: int, now: float) -> bool:
        """Move a member to (status, incarnation); True if its status changed."""
        was_live, changed = member.status in LIVE, member.status != status
        member.status, member.incarnation = status, incarnation
        if changed:
            member.since = now
        if status != Status.SUSPECT:
            member.suspicion = None
        self._track(member, was_live, changed)
        return changed

    def _track(self, member: Member, was_live: bool, changed: bool) -> None:
        is_live = member.status in LIVE
        self.live += is_live - was_live
        if is_live:
            self._gone.pop(member.peer_id, None)
            if not was_live:  # a new or returning member joins the round at a random place
                self._order.insert(self._rng.randint(0, len(self._order)), member.peer_id)
        else:
            self._gone[member.peer_id] = None
            if changed and member.status == Status.DEAD:
                self._recent_dead.append((member.since, member.peer_id))

    def next_probe_target(self) -> str | None:
        """Round-robin over a shuffled list of live members, reshuffled each round."""
        for _ in range(2):
            while self._index < len(self._order):
                peer = self._order[self._index]
                self._index += 1
                member = self.by_id.get(peer)
                if member is not None and member.status in LIVE:
                    return peer
            self._order = [p for p, m in self.by_id.items() if m.status in LIVE]
            self._rng.shuffle(self._order)
            self._index = 0
        return None

    def sample(
        self, count: int, *, exclude: str | None = None, dead_since: float | None = None
    ) -> list[str]:
        """Up to `count` distinct random ALIVE members, in O(count): sampled from
        the probe list (stale entries skipped); with `dead_since`, one member dead
        since then may be among them."""
        order, rng, by_id = self._order, self._rng, self.by_id
        dead = self._recent(dead_since) if dead_since is not None else []
        picked: list[str] = []
        for _ in range(4 * count):
            if len(picked) >= count or not (order or dead):
                break
            if rng.random() * (len(order) + len(dead)) < len(dead):
                since, peer = rng.choice(dead)
                dead = []  # one dead target per call: after mass deaths most are truly gone
                member = by_id.get(peer)
                if member is None or member.status != Status.DEAD or member.since != since:
                    continue
            else:
                peer = rng.choice(order)
                member = by_id.get(peer)
                if member is None or member.status != Status.ALIVE:
                    continue
            if peer != exclude and peer not in picked:
                picked.append(peer)
        return picked

    def _recent(self, horizon: float) -> list[tuple[float, str]]:
        """Deaths since `horizon` (oldest dropped; entries may be stale)."""
        recent = self._recent_dead
        if recent and recent[0][0] < horizon:
            del recent[: bisect.bisect_left(recent, (horizon, ""))]
        return recent

    def dead(self) -> list[str]:
        """Members declared dead (not left) and not yet forgotten."""
        return [p for p in self._gone if self.by_id[p].status == Status.DEAD]

    def evict_gone(self) -> str | None:
        """Forget the member that went first of those dead or left (to make room); its id,
        or None."""
        if not self._gone:
            return None
        peer = next(iter(self._gone))
        del self.by_id[peer]
        del self._gone[peer]
        return peer

    def reap(self, horizon: float) -> list[str]:
        """Forget members dead or left since before `horizon`; return their ids."""
        old = [p for p in self._gone if self.by_id[p].since < horizon]
        for peer in old:
            del self.by_id[peer]
            del self._gone[peer]
        return old


def precedence(member: Member | None, item: Item) -> str | None:
    """What an item about another member does: 'apply', 'confirm', or None (stale).
    Higher incarnation wins; at equal incarnation LEFT > DEAD > SUSPECT > ALIVE. An
    accusation is taken only at the incarnation we know the member at."""
    kind, inc = item.kind, item.incarnation
    if member is None:
        return "apply" if kind in (Status.ALIVE, Status.LEFT) else None
    status, current = member.status, member.incarnation
    if kind == Status.ALIVE:
        return "apply" if inc > current else None
    if status == Status.LEFT or inc < current:
        return None
    if kind == Status.LEFT:  # signed by the member itself
        return "apply"
    if inc > current:
        # an accusation above the incarnation we know, which the member's own records set
        # and at which accusers accuse: nobody's honest view (a stranger's, to push the
        # member's incarnation out of reach; if we missed a refutation, our probes decide)
        return None
    if status == Status.DEAD:
        return None
    if kind == Status.DEAD:
        return "apply"
    # SUSPECT about a live member
    if status == Status.ALIVE:
        return "apply"
    suspicion = member.suspicion
    if (
        suspicion is not None
        and item.signer not in suspicion.accusers
        and suspicion.confirmations < suspicion.expected
    ):
        return "confirm"
    return None
