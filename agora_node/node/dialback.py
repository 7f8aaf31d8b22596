"""This node's side of dial-back checks (comms/reachability.py): answering peers that ask
to be dialed back, from a probe daemon started on the first request, and asking a few
peers to dial us, with one log line whenever their answer changes. And whether peers
reach it through a relay: libp2p's AutoRelay reserves a slot on a public peer for a node
that cannot be dialed (comms/host.py), and the relayed address joins those it announces;
our streams to such peers go through our own relay (comms/relay.py), which this node
offers others too unless its operator said no."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from agora_node.comms import reachability, streams
from agora_node.comms.host import Host, is_relayed
from agora_node.comms.relay import Relaying
from agora_node.protocol.identity import Identity

log = logging.getLogger(__name__)


@dataclass
class Relayed:
    """The relayed addresses this node announces and the peers connected to it only through
    a relay (pure bookkeeping; the daemon refreshes it from libp2p)."""

    addrs: list[str] = field(default_factory=list)
    peers: list[str] = field(default_factory=list)
    since: float | None = None

    def relays(self) -> list[str]:
        """The relays' peer ids, from `.../p2p/<relay>/p2p-circuit/p2p/<us>`."""
        return [a.split("/p2p-circuit")[0].rpartition("/p2p/")[2] for a in self.addrs]

    def update(self, announced: Sequence[str], peers: Sequence[str], now: float) -> str | None:
        """Take what libp2p announces now; one line for the log if the relayed addresses
        changed, else None."""
        self.peers = list(peers)
        relayed = sorted(a for a in announced if is_relayed(a))
        if relayed == self.addrs:
            return None
        self.addrs, self.since = relayed, (now if relayed else None)
        if not relayed:
            return "relay: no relayed address any more; only peers that can dial this node reach it"
        via = ", ".join(r[-8:] for r in self.relays())
        return (
            f"relay: peers that cannot dial this node reach it through relay(s) {via} at "
            f"{relayed[0]}"
        )

    def status(self, sent: dict[str, int], received: dict[str, int]) -> dict:
        """`sent`/`received`: pipeline bytes per peer (metrics.bytes_by_peer)."""
        return {
            "addrs": self.addrs,
            "relays": [r[-8:] for r in self.relays()],
            "since": self.since,
            "relayed_peers": [p[-8:] for p in self.peers],
            "bytes_sent": sum(sent.get(p, 0) for p in self.peers),
            "bytes_received": sum(received.get(p, 0) for p in self.peers),
        }


class DialBack:
    def __init__(self) -> None:
        self.reach = reachability.Reachability()
        """What the peers asked found (the status page's `reachability`)."""
        self.relayed = Relayed()
        """Relayed addresses and relayed peers (the status page's `relay`)."""
        self.prober: reachability.Prober | None = None
        self.relaying: Relaying | None = None
        """Streams through relays of our own, and the relay offered (the status's `relay`)."""

    async def serve(
        self,
        host: Host,
        run_id: str,
        host_maddrs: Sequence[str],
        refuse: Callable[[str], str | None] | None,
    ) -> None:
        """Answer peers' dial-back requests (bootstrap peers too: `refuse` None)."""
        self.prober = reachability.Prober(reachability.probe_listen(host_maddrs), host.watch)
        await reachability.serve_reachability(host.p2p, run_id, self.prober, refuse)

    async def serve_relaying(
        self,
        host: Host,
        identity: Identity,
        run_id: str,
        *,
        offer: bool,
        refuse: Callable[[str], str | None] | None,
        on_refuse: Callable[[str, str], None] | None = None,
    ) -> None:
        """Take requests that come through relays, relay for others if `offer`, and send
        our own requests to peers that cannot be dialed through their relays."""
        self.relaying = Relaying(identity, run_id, offer=offer)
        await self.relaying.serve(host.p2p, refuse, on_refuse)
        streams.set_route(host.p2p, self.relaying)

    async def check_if_due(
        self, host: Host, run_id: str, peers: Sequence[str], addrs: Sequence[str]
    ) -> None:
        """Ask a few of `peers` to dial us at `addrs` until one answers, then every
        RECHECK_S; log one line when the answer changes."""
        if not self.reach.due(time.time()):
            return
        if await reachability.check(host.p2p, run_id, peers, addrs, self.reach):
            unreachable = self.reach.state == reachability.Reach.UNREACHABLE
            log.log(logging.WARNING if unreachable else logging.INFO, self.reach.line())

    async def refresh_relay(
        self, host: Host, direct: Sequence[str], addrs_of: Mapping[str, Sequence[str]]
    ) -> list[str]:
        """Ask libp2p for the relayed addresses and relayed peers, and route our streams to
        peers that announce circuit addresses (`addrs_of`: what each known peer's record
        says) through their relays; the addresses to announce: `direct` (those of start),
        then the relayed ones."""
        relayed, connected = await host.relayed_peers()
        line = self.relayed.update(await host.visible_maddrs(latest=True), relayed, time.time())
        if line is not None:
            log.info(line)
        if self.relaying is not None:
            self.relaying.update_routes(addrs_of, connected)
        return [*direct, *self.relayed.addrs]

    def status(self, sent: dict[str, int], received: dict[str, int]) -> dict:
        """The status's `relay`: libp2p's relayed addresses and peers, and under `streams`
        our streams through relays and what this node relayed for others."""
        status = self.relayed.status(sent, received)
        status["streams"] = self.relaying.status() if self.relaying is not None else None
        return status

    async def close(self) -> None:
        if self.prober is not None:
            await self.prober.close()
