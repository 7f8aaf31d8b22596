"""Membership over hivemind's libp2p daemon.

Each SWIM message travels as one small unary RPC, `MembershipServicer.rpc_gossip`,
whose request is a protobuf `BytesValue` holding the signed message and whose
response is empty: SWIM messages are one-way datagrams, and a failed or slow
call is simply a lost datagram. The libp2p connection authenticates the remote
peer id; the membership signature binds the message to it as well.

`MembershipService` owns the asyncio side: it feeds the pure state machine with
received messages and clock ticks, and runs each send as its own task with a
timeout, so a frozen peer never blocks the event loop or other sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable

from google.protobuf.wrappers_pb2 import BytesValue
from hivemind.p2p import P2P, P2PContext, PeerID

from agora_node.comms import linkemu
from agora_node.comms.guard import Guard, Limits
from agora_node.comms.guarded_rpc import GuardedServicer
from agora_node.comms.membership.messages import MemberMeta
from agora_node.comms.membership.settings import MembershipSettings
from agora_node.comms.membership.signing import Ed25519Verifier
from agora_node.comms.membership.swim import Membership, MemberView
from agora_node.protocol.identity import Identity
from agora_node.protocol.names import STANDALONE_SWIM_NAMESPACE

logger = logging.getLogger(__name__)


LIMITS = Limits(
    # one honest member sends another a few messages per probe interval (ping, ack,
    # ping-req, gossip); push-pulls are rarer; every message is handled at once
    max_streams=256,
    max_streams_per_peer=8,
    rate_per_s=50.0,
    burst=100.0,
    deadline_s=5.0,
)

MAX_IN_FLIGHT_TO_ONE = 16
"""Sends to one peer held at once (each up to the send timeout): a stranger whose handler
never answers, or a fresh key with no host, cannot fill the node's 256 send slots and
make it drop its acks to everyone else. Honest traffic to one peer is a few a second,
each done in a round trip."""


class MembershipServicer(GuardedServicer):
    """Hands every received message to `deliver(sender_peer_id, data)`, behind a Guard
    (admission by the authenticated remote peer id; comms/guarded_rpc.py)."""

    def __init__(self, deliver: Callable[[str, bytes], None], guard: Guard | None = None) -> None:
        self._deliver = deliver
        self.guard = guard or Guard("membership", LIMITS)

    async def rpc_gossip(self, request: BytesValue, context: P2PContext) -> BytesValue:
        self._deliver(context.remote_id.to_base58(), request.value)
        return BytesValue()


def peer_id_of(seed: str) -> str:
    """The peer id of a seed given as a peer id or a multiaddr ending in /p2p/<id>."""
    if "/p2p/" in seed:
        return seed.rsplit("/p2p/", 1)[1].split("/", 1)[0]
    return seed


class MembershipService:
    """SWIM/Lifeguard membership of one node, running on a hivemind `P2P` instance.

    The P2P instance must be able to reach the seeds (create it with them as
    `initial_peers`, or share a DHT's with `await dht.replicate_p2p()`).
    """

    def __init__(
        self,
        p2p: P2P,
        identity: Identity,
        *,
        seeds: Iterable[str] = (),
        settings: MembershipSettings | None = None,
        meta: MemberMeta | None = None,
        namespace: str = STANDALONE_SWIM_NAMESPACE,
        send_timeout_s: float | None = None,
        max_in_flight: int = 256,
        admit: Callable[[str], bool] | None = None,
        on_refuse: Callable[[str, str], None] | None = None,
    ) -> None:
        if p2p.peer_id.to_base58() != identity.peer_id:
            raise ValueError("the P2P host must run with the membership identity's key")
        self.settings = settings or MembershipSettings()
        self._p2p, self._identity, self._namespace = p2p, identity, namespace
        self._seeds = [peer_id_of(s) for s in seeds]
        self._meta = meta
        self._admit = admit
        self._send_timeout = send_timeout_s or max(1.0, 2 * self.settings.probe_interval_s)
        self._max_in_flight = max_in_flight
        self._listeners: list[Callable[[MemberView], None]] = []
        self._in_flight: set[asyncio.Task] = set()
        self._in_flight_to: Counter[str] = Counter()
        self._machine: Membership | None = None
        self._servicer = MembershipServicer(
            self._deliver, Guard("membership", LIMITS, on_refuse=on_refuse)
        )
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self.send_failures = 0
        self.send_overflows = 0

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._machine = Membership(
            self._identity,
            Ed25519Verifier(),
            send=self._send,
            rng=random.Random(),
            now=loop.time(),
            settings=self.settings,
            meta=self._meta,
            listener=self._notify,
            seq_start=time.time_ns() // 1000,  # grows across restarts: no false replays
            admit=self._admit,
            # grows across restarts too: accusations above it are forged (swim.py)
            incarnation_start=int(time.time()),
        )
        await self._servicer.add_p2p_handlers(self._p2p, namespace=self._namespace)
        logger.info("membership of %s starts with %s", self.peer_id, self.settings)
        self._machine.join(self._seeds, loop.time())
        self._loop_task = asyncio.create_task(self._run(), name="membership-ticks")

    async def stop(self) -> None:
        """Stop ticking and answering (a crash as far as others can tell)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        for task in list(self._in_flight):
            task.cancel()
        await asyncio.gather(*self._in_flight, return_exceptions=True)
        try:
            await self._servicer.remove_p2p_handlers(self._p2p, namespace=self._namespace)
        except Exception as e:  # the daemon may already be gone at shutdown
            logger.debug("removing membership handlers failed: %r", e)

    async def leave(self, linger_s: float | None = None) -> None:
        """Announce a graceful leave, keep answering for `linger_s` so the news
        spreads (default: three gossip intervals), then stop."""
        loop = asyncio.get_running_loop()
        self.machine.leave(loop.time())
        self._wake.set()
        await asyncio.sleep(
            linger_s if linger_s is not None else 3 * self.settings.gossip_interval_s
        )
        await self.stop()

    # ------------------------------------------------------------------- reads

    @property
    def machine(self) -> Membership:
        if self._machine is None:
            raise RuntimeError("MembershipService.start() has not been awaited")
        return self._machine

    @property
    def peer_id(self) -> str:
        return self._identity.peer_id

    @property
    def counters(self) -> dict[str, int]:
        counters = dict(self.machine.counters)
        counters.update(send_failures=self.send_failures, send_overflows=self.send_overflows)
        return counters

    def alive_members(self) -> list[MemberView]:
        """Other members alive or suspected, with their stage and state."""
        return self.machine.alive_members()

    def members(self) -> list[MemberView]:
        return self.machine.members()

    def subscribe(self, listener: Callable[[MemberView], None]) -> None:
        """Call `listener(view)` on every status or metadata change of a member."""
        self._listeners.append(listener)

    # ----------------------------------------------------------------- updates

    def update_meta(self, *, stage: int | None = None, state: str | None = None) -> None:
        old = self.machine.meta
        meta = MemberMeta(
            stage=old.stage if stage is None else stage, state=old.state if state is None else state
        )
        self.machine.update_meta(meta, asyncio.get_running_loop().time())
        self._wake.set()

    def rtt(self, peer_id: str) -> float | None:
        """Measured round trip to a member (seconds; swim.Membership.rtt), None if unknown."""
        return None if self._machine is None else self._machine.rtt(peer_id)

    def get(self, peer_id: str) -> MemberView | None:
        """A member's view (status, stage), None if not in the table."""
        return None if self._machine is None else self._machine.get(peer_id)

    def join(self, seeds: Iterable[str]) -> None:
        """Sync with more known peers (e.g. found in the DHT directory)."""
        self.machine.join([peer_id_of(s) for s in seeds], asyncio.get_running_loop().time())

    # --------------------------------------------------------------- internals

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        machine = self.machine
        while True:
            try:
                machine.tick(loop.time())
            except Exception:  # log a bug loudly, but keep the member alive
                logger.exception("membership tick failed")
            delay = min(1.0, max(0.0, machine.next_deadline() - loop.time()))
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=delay)

    def _deliver(self, sender: str, data: bytes) -> None:
        if self._machine is None or self._loop_task is None:
            return
        try:
            self._machine.on_message(sender, data, asyncio.get_running_loop().time())
        except Exception:  # a bug must not take the RPC handler down with it
            logger.exception("membership failed to handle a message from %s", sender)
        self._wake.set()  # the message may have set an earlier timer

    def _send(self, to: str, data: bytes) -> None:
        full = len(self._in_flight) >= self._max_in_flight
        if full or self._in_flight_to[to] >= MAX_IN_FLIGHT_TO_ONE:
            self.send_overflows += 1  # like a full socket buffer: the datagram is lost
            return
        task = asyncio.create_task(self._send_one(to, data))
        self._in_flight.add(task)
        self._in_flight_to[to] += 1
        task.add_done_callback(lambda t: self._sent(t, to))

    def _sent(self, task: asyncio.Task, to: str) -> None:
        self._in_flight.discard(task)
        self._in_flight_to[to] -= 1
        if self._in_flight_to[to] <= 0:
            del self._in_flight_to[to]

    async def _send_one(self, to: str, data: bytes) -> None:
        try:
            await linkemu.control_message()
            stub = MembershipServicer.get_stub(
                self._p2p, PeerID.from_base58(to), namespace=self._namespace
            )
            await stub.rpc_gossip(BytesValue(value=data), timeout=self._send_timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # unreachable, frozen or gone: to SWIM, a lost datagram
            self.send_failures += 1
            logger.debug("membership send to %s failed: %r", to[:16], e)

    def _notify(self, view: MemberView) -> None:
        for listener in self._listeners:
            try:
                listener(view)
            except Exception:
                logger.exception("membership listener failed")
