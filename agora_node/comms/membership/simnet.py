"""A discrete-event network for membership state machines.

Thousands of `Membership` machines share one process and one event heap; the
network adds latency (a configurable distribution), loss, partitions, slow
(overloaded) members and crashes. Time is simulated, so a 10-minute run takes
as long as its events take to process. Used by tests and bench/membership_sim.py.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from agora_node.comms.membership.messages import MemberMeta, decode_item
from agora_node.comms.membership.settings import MembershipSettings
from agora_node.comms.membership.signing import Ed25519Verifier, NullSigner, null_verify
from agora_node.comms.membership.swim import Membership, MemberView
from agora_node.protocol.identity import Identity

_DELIVER, _TICK, _CALL = range(3)
_INF = float("inf")


@dataclass(frozen=True, kw_only=True)
class LinkModel:
    """One-way delay = rtt/2 + a random extra with mean jitter/2; independent loss."""

    rtt_s: float = 0.1
    jitter_s: float = 0.02
    loss: float = 0.0
    distribution: str = "exponential"
    """'exponential' (a long tail, like queueing) or 'normal' (clipped at zero)."""

    def __post_init__(self) -> None:
        if self.distribution not in ("exponential", "normal"):
            raise ValueError("distribution is 'exponential' or 'normal'")
        if not 0 <= self.loss < 1 or self.rtt_s < 0 or self.jitter_s < 0:
            raise ValueError("need 0 <= loss < 1 and non-negative rtt and jitter")

    def sampler(self, rng: random.Random) -> Callable[[], float]:
        base, extra = self.rtt_s / 2, self.jitter_s / 2
        if extra == 0:
            return lambda: base
        if self.distribution == "exponential":
            rate = 1 / extra
            return lambda: base + rng.expovariate(rate)
        return lambda: max(0.0, base + rng.gauss(0.0, extra))


def sim_peer_id(index: int) -> str:
    """A fake peer id as long as a real Ed25519 one (52 chars), for honest sizes."""
    return f"12D3KooWsim{index:041d}"


class SimNetwork:
    """Members, links and an event heap. Drive it with `run_until(t)`."""

    def __init__(
        self,
        *,
        settings: MembershipSettings | None = None,
        link: LinkModel | None = None,
        seed: int = 0,
        real_signatures: bool = False,
        on_event: Callable[[str, MemberView, float], None] | None = None,
        keep_events: bool = True,
    ) -> None:
        self.settings = settings or MembershipSettings()
        self.link = link or LinkModel()
        self.rng = random.Random(seed)
        self.now = 0.0
        self.real_signatures = real_signatures
        self.on_event = on_event
        self.keep_events = keep_events
        self.events: list[tuple[float, str, MemberView]] = []
        self.nodes: list[Membership] = []
        self.ids: list[str] = []
        self.index: dict[str, int] = {}
        self.crashed: list[bool] = []
        self.slow: list[float] = []
        self.group: list[int] = []
        self.partitioned = False
        self.dropped = 0
        self._scheduled: list[float] = []
        self._heap: list[tuple] = []
        self._count = itertools.count()
        self._delay = self.link.sampler(self.rng)
        self._verify = Ed25519Verifier() if real_signatures else null_verify

    # ------------------------------------------------------------------ setup

    def add_node(
        self, *, meta: MemberMeta | None = None, settings: MembershipSettings | None = None
    ) -> Membership:
        j = len(self.nodes)
        signer = Identity.generate() if self.real_signatures else NullSigner(sim_peer_id(j))
        peer_id = signer.peer_id
        node = Membership(
            signer,
            self._verify,
            send=self._sender(j),
            rng=random.Random(self.rng.getrandbits(64)),
            now=self.now,
            settings=settings or self.settings,
            meta=meta,
            listener=self._listener(peer_id),
        )
        self.nodes.append(node)
        self.ids.append(peer_id)
        self.index[peer_id] = j
        self.crashed.append(False)
        self.slow.append(0.0)
        self.group.append(0)
        self._scheduled.append(_INF)
        self._reschedule(j)
        return node

    def add_converged(self, count: int, **kwargs) -> list[Membership]:
        """`count` members that already know each other (no join storm)."""
        new = [self.add_node(**kwargs) for _ in range(count)]
        records = [decode_item(node.record) for node in self.nodes]  # decoded once, shared
        for node in new:
            node.learn(records, self.now)
            self._reschedule(self.index[node.peer_id])
        return new

    def node(self, peer_id: str) -> Membership:
        return self.nodes[self.index[peer_id]]

    # ------------------------------------------------------------- faults

    def crash(self, peer_id: str) -> None:
        self.crashed[self.index[peer_id]] = True

    def set_slow(self, peer_id: str, max_delay_s: float) -> None:
        """Its messages are handled and its timers fire up to `max_delay_s` late."""
        self.slow[self.index[peer_id]] = max_delay_s

    def partition(self, groups: Iterable[Iterable[str]]) -> None:
        """Cut links between groups; members not listed form group 0."""
        self.group = [0] * len(self.nodes)
        for g, members in enumerate(groups, start=1):
            for peer_id in members:
                self.group[self.index[peer_id]] = g
        self.partitioned = True

    def heal(self) -> None:
        self.partitioned = False

    # ------------------------------------------------------------ driving

    def at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (when, next(self._count), _CALL, -1, fn, None))

    def inject(self, to: str, sender: str, data: bytes) -> None:
        """Deliver raw bytes claiming to come from `sender` (for attack tests)."""
        j = self.index[to]
        heapq.heappush(self._heap, (self.now, next(self._count), _DELIVER, j, sender, data))

    def run_until(self, t_end: float) -> None:
        heap, pop, nodes, crashed = self._heap, heapq.heappop, self.nodes, self.crashed
        scheduled = self._scheduled
        while heap and heap[0][0] <= t_end:
            t, _, kind, j, a, b = pop(heap)
            self.now = t
            if kind == _CALL:
                a()
                continue
            if crashed[j]:
                continue
            if kind == _DELIVER:
                nodes[j].on_message(a, b, t)
            else:
                if scheduled[j] != a:
                    continue  # superseded by an earlier wake-up
                scheduled[j] = _INF
                nodes[j].tick(t)
            self._reschedule(j)
        self.now = max(self.now, t_end)

    def run_while(self, condition: Callable[[], bool], t_max: float, step: float = 0.1) -> bool:
        """Run until `condition()` is false or t_max; True if it became false."""
        while self.now < t_max:
            if not condition():
                return True
            self.run_until(min(t_max, self.now + step))
        return not condition()

    # ------------------------------------------------------------ internals

    def _reschedule(self, j: int) -> None:
        deadline = self.nodes[j].next_deadline()
        if deadline < self._scheduled[j]:
            self._scheduled[j] = deadline
            late = self.rng.uniform(0, self.slow[j]) if self.slow[j] else 0.0
            heapq.heappush(
                self._heap,
                (max(deadline, self.now) + late, next(self._count), _TICK, j, deadline, None),
            )

    def _sender(self, i: int) -> Callable[[str, bytes], None]:
        rng, index, link = self.rng, self.index, self.link

        def send(to: str, data: bytes) -> None:
            j = index.get(to)
            if j is None or rng.random() < link.loss:
                self.dropped += 1
                return
            if self.partitioned and self.group[i] != self.group[j]:
                self.dropped += 1
                return
            t = self.now + self._delay()
            if self.slow[j]:
                t += rng.uniform(0, self.slow[j])
            heapq.heappush(self._heap, (t, next(self._count), _DELIVER, j, self.ids[i], data))

        return send

    def _listener(self, observer: str) -> Callable[[MemberView], None]:
        def listener(view: MemberView) -> None:
            if self.keep_events:
                self.events.append((self.now, observer, view))
            if self.on_event is not None:
                self.on_event(observer, view, self.now)

        return listener
