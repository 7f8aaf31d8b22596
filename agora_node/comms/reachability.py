"""Reachability: can other peers dial this node, or does it only dial out?

A node behind a NAT or firewall can open connections but not accept them; upstream
stages dial the nodes they send micro-batches to, so such a node cannot serve a
stage. At start, and again now and then, a node asks a few peers of the run to dial
it back (`ask`, over `reachability_protocol`), as Petals does. The asked peer dials
from a libp2p daemon of its own (`Prober`), started on the first request and kept:
the node's own daemon already holds a connection to the asker, and reusing it
would prove nothing.

The asker sends the addresses it announces; the prober dials only those, after
checking them (at most MAX_ADDRS, IP + TCP/UDP, no DNS names, no relay circuits,
no other peer's id), and of those only the ones at an IP address the asker holds a
direct connection to this node from (`connected_ips`: libp2p's handshake vouches
for it), never link-local, multicast or unspecified. So a stranger cannot aim the
prober at anyone else, nor at this host's own machine or networks, and read back
whether a port there is open (the dial's error says so): it can only learn about
ports of its own IP. A prober runs one dial at a time and answers each peer at most
once per COOLDOWN_S; the rest are told "busy".

`Reachability` keeps the answers: REACHABLE as soon as any peer dialed us back,
UNREACHABLE when peers answered and none could, UNKNOWN without answers (a lone
node, or peers too old to have the protocol). Bootstrap peers answer too, so the
first node of a run gets its answer at once. A stranger who lies can only make
this node's report wrong, never change what it does: the report is advice for
the operator (the log line and the status page), not an input to any decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import ipaddress
import json
import logging
import random
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from agora_node.comms import streams
from agora_node.comms.host import create_p2p, shutdown_p2p
from agora_node.protocol.names import reachability_protocol

log = logging.getLogger(__name__)

MAX_ADDRS = 8
MAX_REQUEST = 2048
DIAL_TIMEOUT_S = 5.0
ASK_TIMEOUT_S = DIAL_TIMEOUT_S + 5.0
COOLDOWN_S = 30.0
"""A peer is dialed back at most once in this many seconds."""
RECHECK_S = 600.0
"""How often a node checks again once it has an answer."""
_REMEMBERED = 1024  # askers whose last dial time is kept
_TRANSPORTS = {"tcp", "udp", "quic", "quic-v1"}
_IPS = {"ip4", "ip6"}

OK = b"ok"
BUSY = b"busy"
FAILED = b"failed: "
UNJUDGED = b"cannot tell: "
"""No address to dial where the asker is seen, and nothing to conclude from that."""


class Reach(enum.Enum):
    REACHABLE = "reachable"
    UNREACHABLE = "unreachable"
    UNKNOWN = "unknown"


def ip_of(text: str) -> str | None:
    """The IP address of an /ip4 or /ip6 multiaddr, written one way (None otherwise)."""
    parts = text.split("/")
    if len(parts) < 3 or parts[1] not in _IPS:
        return None
    try:
        return str(ipaddress.ip_address(parts[2]))
    except ValueError:
        return None


def address_scope(text: str) -> str:
    """Where an /ip4 or /ip6 multiaddr points: "global", "private", "loopback",
    "link-local", "multicast" or "unspecified" (and "other" for anything else)."""
    written = ip_of(text)
    if written is None:
        return "other"
    ip = _embedded_ipv4(ipaddress.ip_address(written))  # ::ffff:127.0.0.1 is loopback
    for scope in ("unspecified", "loopback", "link_local", "multicast", "private"):
        if getattr(ip, f"is_{scope}"):
            return scope.replace("_", "-")
    # neither private nor global: shared address space (CGNAT, 100.64.0.0/10, where
    # tailnets live), benchmarking nets, reserved ranges (Python calls IPv6 site-local and
    # reserved ones, local-use NAT64 64:ff9b:1::/48 among them, global). Not dialed for
    # strangers.
    v6_local = isinstance(ip, ipaddress.IPv6Address) and (ip.is_site_local or ip.is_reserved)
    return "global" if ip.is_global and not v6_local else "private"


_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _embedded_ipv4(
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The IPv4 address an IPv6 one carries (mapped, NAT64, 6to4, Teredo's client), which
    is where a dial to it ends up: 64:ff9b::7f00:1 reaches 127.0.0.1 through a NAT64."""
    if not isinstance(ip, ipaddress.IPv6Address) or ip.is_loopback or ip.is_unspecified:
        return ip  # (::1 and :: are not IPv4-compatible addresses)
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64 or int(ip) >> 32 in (0, 0xFFFF0000):  # NAT64; IPv4-compatible, SIIT
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    return ip


def check_addrs(addrs: object, asker: str) -> list[str]:
    """The addresses a prober may dial for `asker`, without /p2p/ suffixes, before their
    scopes are looked at (`in_reach`); ValueError (one line) for anything else."""
    if not isinstance(addrs, list) or not 0 < len(addrs) <= MAX_ADDRS:
        raise ValueError(f"expected 1 to {MAX_ADDRS} addresses")
    checked = []
    for text in addrs:
        if not isinstance(text, str) or len(text) > 200:
            raise ValueError("an address is not a short string")
        try:
            parts = [p.name for p in Multiaddr(text).protocols()]
        except Exception:  # the multiaddr library raises several types
            raise ValueError(f"not a multiaddr: {text[:60]!r}") from None
        if "p2p" in parts:
            head, _, peer = text.rpartition("/p2p/")
            if peer != asker or "p2p" in [p.name for p in Multiaddr(head).protocols()]:
                raise ValueError("an address names another peer")
            text, parts = head, parts[: parts.index("p2p")]
        if len(parts) < 2 or parts[0] not in _IPS or parts[1] not in _TRANSPORTS:
            raise ValueError(f"only IP addresses with a TCP or UDP port: {text[:60]!r}")
        if "p2p-circuit" in parts:
            raise ValueError("relay circuits are not dialed back")
        checked.append(text)
    return checked


_NEVER_DIALED = {"link-local", "multicast", "unspecified", "other"}


def _where(ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | ipaddress.IPv6Network:
    """A global IPv6 address's /64, the asker's own network (a host connects out from a
    temporary address, privacy extensions, and announces its stable one); any other
    address itself (IPv4, loopback, and IPv6 forms that carry an IPv4 address)."""
    parsed = ipaddress.ip_address(ip)
    v6 = isinstance(parsed, ipaddress.IPv6Address)
    if v6 and parsed.is_global and _embedded_ipv4(parsed) is parsed:
        return ipaddress.IPv6Network(f"{parsed}/64", strict=False)
    return parsed


def in_reach(addrs: list[str], connected: frozenset[str] = frozenset()) -> list[str]:
    """Of checked addresses, those a prober dials: at an IP the asker is connected from
    (`connected`, as `ip_of` writes them; for IPv6 in its /64), never link-local,
    multicast or unspecified. A node announces its loopback and LAN addresses too: they
    are left out, not refused. Before, any public address (and those of the asker's
    scope) was dialed, and the dial's error told a stranger whether a port of a third
    party, or of this host's network, was open, closed or filtered."""
    near = {_where(ip) for ip in connected}
    return [
        a
        for a in addrs
        if (ip := ip_of(a)) is not None
        and _where(ip) in near
        and address_scope(a) not in _NEVER_DIALED
    ]


def seen_in_public(addrs: list[str], connected: frozenset[str]) -> bool:
    """Whether the asker connects from a public IP of a family (IPv4, IPv6) it announces an
    address in: then none of its addresses being there says it cannot be dialed at them (a
    NAT without a forwarded port). Connected only through a relay, over the other family,
    or over a private network, its addresses may well be dialable elsewhere."""
    families = {ipaddress.ip_address(ip).version for a in addrs if (ip := ip_of(a))}
    seen = [ipaddress.ip_address(ip) for ip in connected]
    return any(ip.is_global and ip.version in families for ip in seen)


class Prober:
    """Dials back the peers that ask, from its own libp2p daemon, one at a time."""

    def __init__(
        self,
        listen: str = "/ip4/127.0.0.1/tcp/0",
        on_started: Callable[[P2P], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`listen`: where the probe daemon listens (an address of this host's family, port
        0); `on_started(p2p)`: told the probe's P2P (the node's reaper watches its daemon)."""
        self.listen, self.on_started, self.clock = listen, on_started, clock
        self._p2p: P2P | None = None
        self._lock = asyncio.Lock()
        self._last: OrderedDict[str, float] = OrderedDict()
        self.dials = {"ok": 0, "failed": 0, "busy": 0, "refused": 0, "unjudged": 0}

    def admit(self, asker: str) -> bool:
        """Whether `asker` may be dialed now (not busy, not within its cooldown)."""
        if self._lock.locked():
            return False
        now = self.clock()
        last = self._last.get(asker)
        if last is not None and now - last < COOLDOWN_S:
            return False
        self._last[asker] = now
        self._last.move_to_end(asker)
        while len(self._last) > _REMEMBERED:
            self._last.popitem(last=False)
        return True

    async def answer(
        self,
        asker: str,
        request: bytes,
        connected: Callable[[], Awaitable[frozenset[str]]] | None = None,
    ) -> bytes:
        """`connected()`: the IP addresses the asker is connected to this node from
        (`connected_ips`); without it nothing is dialed."""
        try:
            addrs = check_addrs(json.loads(request.decode()).get("addrs"), asker)
        except (ValueError, UnicodeDecodeError, AttributeError, RecursionError) as exc:
            self.dials["refused"] += 1
            return FAILED + f"bad request: {exc}".encode()[:200]
        if not self.admit(asker):  # (before asking p2pd who is connected from where)
            self.dials["busy"] += 1
            return BUSY
        ips = await connected() if connected is not None else frozenset()
        reach = in_reach(addrs, ips)
        if not reach:
            seen = ", ".join(sorted(ips)[:4]) or "no direct connection"
            if seen_in_public(addrs, ips):  # behind a NAT without a forwarded port, say
                self.dials["failed"] += 1
                why = f"none of its addresses is at the IP it connects from ({seen}); not dialed"
                return FAILED + why.encode()[:200]
            # through a relay, over another IP family, over a private network: no verdict
            self.dials["unjudged"] += 1
            return UNJUDGED + f"it connects from {seen}, none of its addresses".encode()[:200]
        reason = await self.dial(asker, reach)
        self.dials["ok" if reason is None else "failed"] += 1
        return OK if reason is None else FAILED + reason.encode()[:200]

    async def dial(self, peer: str, addrs: Sequence[str]) -> str | None:
        """Connect to `peer` at `addrs` and hang up: None if it answered, else why not."""
        async with self._lock:
            p2p = await self._started()
            peer_id = PeerID.from_base58(peer)
            client = p2p._client  # noqa: SLF001 - hivemind exposes no connect/disconnect
            try:
                await asyncio.wait_for(
                    client.connect(peer_id, [Multiaddr(a) for a in addrs]), DIAL_TIMEOUT_S
                )
                # libp2p may have found the peer at another address (its own DHT routing):
                # only a connection to an address the peer announces counts
                used = [
                    str(a) for info in await client.list_peers() if info.peer_id == peer_id
                    for a in info.addrs
                ]  # fmt: skip
            except TimeoutError:
                return f"no answer within {DIAL_TIMEOUT_S:.0f}s"
            except Exception as exc:  # p2pd reports every dial failure as a generic error
                return " ".join(str(exc).split())[:200] or type(exc).__name__
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(client.disconnect(peer_id), 2.0)
            if not set(used) & set(addrs):
                return f"answered only at {', '.join(used) or 'an unknown address'}, not announced"
            return None

    async def _started(self) -> P2P:
        if self._p2p is None:
            self._p2p = await create_p2p(
                host_maddrs=[self.listen],
                dht_mode="client",
                use_relay=False,
                use_auto_relay=False,
                nat_port_map=False,
                auto_nat=False,
            )
            if self.on_started is not None:
                self.on_started(self._p2p)
        return self._p2p

    async def close(self) -> None:
        if self._p2p is not None:
            await shutdown_p2p(self._p2p, 5.0)
            self._p2p = None


async def connected_ips(p2p: P2P, peer: str) -> frozenset[str]:
    """The IP addresses `peer` holds direct connections to us at (a circuit through a
    relay is the relay's, not counted); libp2p's handshake vouches that it is there."""
    try:
        infos = await asyncio.wait_for(p2p.list_peers(), 5.0)
    except Exception:  # noqa: BLE001 - p2pd's errors are generic: then nothing is dialed
        return frozenset()
    addrs = [str(a) for i in infos if i.peer_id.to_base58() == peer for a in i.addrs]
    ips = {ip_of(a) for a in addrs if "p2p-circuit" not in a}
    return frozenset(ip for ip in ips if ip is not None)


async def serve_reachability(
    p2p: P2P, run_id: str, prober: Prober, refuse: Callable[[str], str | None] | None
) -> None:
    async def handler(remote: str, request: bytes) -> AsyncIterator[bytes]:
        yield await prober.answer(remote, request, lambda: connected_ips(p2p, remote))

    await streams.serve(
        p2p, reachability_protocol(run_id), handler, max_request=MAX_REQUEST, refuse=refuse
    )


async def ask(p2p: P2P, run_id: str, peer: str, addrs: Sequence[str]) -> tuple[bool | None, str]:
    """Ask `peer` to dial us at `addrs`: (True, "") if it did, (False, why) if it could not,
    (None, why) without an answer (gone, busy, refused, or too old for the protocol)."""
    payload = json.dumps({"addrs": list(addrs)[:MAX_ADDRS]}).encode()
    try:
        answer = await streams.request(
            p2p,
            peer,
            reachability_protocol(run_id),
            payload,
            timeout=ASK_TIMEOUT_S,
            max_response=512,
        )
    except streams.StreamError as exc:
        return None, str(exc)
    if answer == OK:
        return True, ""
    # a stranger's words go to the log: cut short, quoted unless printable (peer_text)
    if answer.startswith(FAILED) and not answer.startswith(FAILED + b"bad request"):
        return False, streams.peer_text(answer[len(FAILED) :])
    return None, streams.peer_text(answer)


@dataclass
class Reachability:
    """What the peers asked to dial us back answered (pure bookkeeping)."""

    state: Reach = Reach.UNKNOWN
    addrs: list[str] = field(default_factory=list)
    """The addresses we asked them to dial (what this node announces)."""
    dialed_by: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    """Peer -> why it could not dial us, at the last check."""
    checked_at: float | None = None

    def note(self, answers: dict[str, tuple[bool | None, str]], now: float) -> None:
        """One check's answers (peer -> ask()'s result)."""
        dialed = [p for p, (ok, _) in answers.items() if ok]
        failed = {p: why for p, (ok, why) in answers.items() if ok is False}
        if dialed:
            self.state = Reach.REACHABLE
        elif failed:
            self.state = Reach.UNREACHABLE
        else:
            return  # nobody answered: keep what we knew
        self.dialed_by, self.failed, self.checked_at = dialed, failed, now

    def due(self, now: float) -> bool:
        """Time to check (again): never answered yet, or RECHECK_S since (wall clock)."""
        return self.checked_at is None or now - self.checked_at >= RECHECK_S

    def line(self) -> str:
        """One line for the log."""
        addrs = ", ".join(self.addrs) or "no announced address"
        if self.state == Reach.REACHABLE:
            return f"reachable: {len(self.dialed_by)} peer(s) dialed this node back at {addrs}"
        if self.state == Reach.UNREACHABLE:
            why = next(iter(self.failed.values()), "")
            return (
                f"NOT reachable: {len(self.failed)} peer(s) could not dial this node at {addrs} "
                f"({why[:120]}); peers reach it over connections it opened itself, and "
                "others through a relay once it has a relayed address (about 3 minutes), "
                "which costs the relay's bandwidth and a hop. Forward the TCP port to this "
                "machine, or set --announce-maddrs to an address peers can dial"
            )
        return "reachability unknown: no peer answered yet"

    def status(self) -> dict:
        return {
            "state": self.state.value,
            "addrs": self.addrs,
            "dialed_by": [p[-8:] for p in self.dialed_by],
            "failed": {p[-8:]: why for p, why in self.failed.items()},
            "checked_at": self.checked_at,
        }


async def check(
    p2p: P2P,
    run_id: str,
    peers: Sequence[str],
    addrs: Sequence[str],
    reach: Reachability,
    *,
    ask_at_most: int = 3,
) -> bool:
    """Ask up to `ask_at_most` of `peers` (a random few) to dial us at `addrs` and note
    the answers in `reach`; whether its state changed."""
    if not peers or not addrs:
        return False
    chosen = random.sample(list(peers), min(ask_at_most, len(peers)))
    answers = await asyncio.gather(*(ask(p2p, run_id, peer, addrs) for peer in chosen))
    before = reach.state
    reach.addrs = list(addrs)
    reach.note(dict(zip(chosen, answers, strict=True)), time.time())
    return reach.state != before


def probe_listen(host_maddrs: Sequence[str]) -> str:
    """Where a probe daemon listens: the node's first listen address's IP with port 0
    (loopback stays loopback)."""
    parts = host_maddrs[0].split("/") if host_maddrs else []
    if len(parts) >= 5 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp":
        return f"/{parts[1]}/{parts[2]}/tcp/0"
    return "/ip4/127.0.0.1/tcp/0"


def peer_ids(maddrs: Sequence[str]) -> set[str]:
    """The peer ids that multiaddrs such as --initial-peers end with (bootstrap peers
    serve dial-back checks too, so a node alone in its run still gets an answer)."""
    return set(addrs_by_peer(maddrs))


def addrs_by_peer(maddrs: Sequence[str]) -> dict[str, list[str]]:
    """Multiaddrs such as --initial-peers by the peer id they end with, each without
    that /p2p/ID (what libp2p dials: p2pd refuses a connect to an address that has it)."""
    grouped: dict[str, list[str]] = {}
    for m in maddrs:
        if "/p2p/" in m:
            addr, _, peer = m.rpartition("/p2p/")
            grouped.setdefault(peer, []).extend([addr] if addr else [])
    return grouped
