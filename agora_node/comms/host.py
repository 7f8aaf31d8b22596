"""The libp2p host and DHT of one node, with the failure modes of hivemind handled.

One libp2p daemon per node: the P2P instance is created in the node's own event
loop (so RPC handlers run there), and the hivemind DHT process replicates it.
hivemind forks the DHT into a child process and the libp2p daemon is a child
too; both outlive a SIGKILLed parent (HIVEMIND_NOTES.md), so a small reaper
process kills them when this process dies (see reaper.py).

DHT calls go through `store`/`get` here: always in the background
(`return_future=True`), awaited with a timeout, so a dead DHT process never hangs
the node.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import logging
import math
import os
import random
import secrets
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import hivemind
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from agora_node.comms.control_calls import settle_cancelled_calls
from agora_node.comms.dht_validator import SignedSubkeys
from agora_node.comms.host_checks import (
    HostError,
    check_maddr,
    check_port_free,
    clock_error,
    explain_start_failure,
    one_line,
)
from agora_node.comms.reaper import Reaper, proc_stat, remove_socket

log = logging.getLogger(__name__)

DHT_TIMEOUT_S = 10.0
MEET_DIAL_S = 5.0
"""How long `Host.meet` tries to dial an initial peer at its addresses before the ping."""
SHUTDOWN_STEP_S = 5.0
MAX_RELAYS = 8
"""Initial peers offered to AutoRelay as relays, at most."""


@dataclass(kw_only=True)
class HostConfig:
    identity_path: str
    initial_peers: Sequence[str] = ()
    host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",)
    announce_maddrs: Sequence[str] = ()
    nat: bool = False
    """Let libp2p ask the local router for a port mapping (UPnP/NAT-PMP); off, it talks to
    nothing but peers."""
    public: bool = False
    """Known to be dialable (a bootstrap: its joiners dial it), so libp2p takes it as public
    from the start instead of waiting for AutoNAT. The bundled p2pd takes relay
    reservations while AutoNAT is undecided, and when a peer's dial-back then finds it
    public it starts its relay service anew, forgetting them: callers of a NATed peer got
    NO_RESERVATION until that peer reserved again (the network lab, tests/netlab.py)."""


class Host:
    """A started libp2p daemon + hivemind DHT; use `await Host.start(config)`."""

    def __init__(self, p2p: P2P, dht: hivemind.DHT, reaper: Reaper) -> None:
        self.p2p, self.dht, self._reaper = p2p, dht, reaper
        self.peer_id: str = p2p.peer_id.to_base58()

    @classmethod
    async def start(cls, config: HostConfig) -> Host:
        for maddr in (
            list(config.initial_peers) + list(config.host_maddrs) + list(config.announce_maddrs)
        ):
            check_maddr(maddr)
        for maddr in config.host_maddrs:
            check_port_free(maddr)
        reaper = Reaper.start()
        try:
            p2p = await create_p2p(
                initial_peers=list(config.initial_peers) or None,
                host_maddrs=list(config.host_maddrs),
                announce_maddrs=list(config.announce_maddrs) or None,
                identity_path=config.identity_path,
                # hivemind's identity check parses RSA keys only; ours are Ed25519
                # (HIVEMIND_NOTES.md). `join` and `bootstrap` hold their key file
                # (datadir.lock_identity), so a second daemon of this machine with the same
                # key never gets here; `join` also asks the swarm (check_identity_unused).
                check_if_identity_free=False,
                nat_port_map=config.nat,
                # Peers tell each other whether they can be dialed (AutoNAT, over their own
                # connections). A public node then offers circuit relays; a node behind NAT
                # reserves a slot on one of its initial peers (AutoRelay, about 3 minutes
                # after start) and announces the relayed address. The bundled p2pd resets a
                # relayed connection after 128 KiB each way: small calls only, no training
                # (docs/operating.md).
                auto_nat=True,
                force_reachability="public" if config.public else None,
                use_relay=True,
                use_auto_relay=True,
                trusted_relays=relay_candidates(config.initial_peers) or None,
            )
        except Exception as exc:  # hivemind raises bare P2PDaemonError / RuntimeError
            reaper.stop()
            raise explain_start_failure(exc, config.initial_peers, config.host_maddrs) from None
        watch_p2p(reaper, p2p)
        try:
            dht = OwnSessionDHT(
                initial_peers=list(config.initial_peers) or None,
                p2p=p2p,
                start=True,
                num_workers=4,
                record_validators=[SignedSubkeys()],  # no squatting a peer's subkey
            )
        except Exception as exc:
            await shutdown_p2p(p2p, SHUTDOWN_STEP_S)
            reaper.stop()
            raise clock_error(exc) or HostError(f"DHT failed to start: {one_line(exc)}") from None
        reaper.watch(dht.pid)
        return cls(p2p, dht, reaper)

    def watch(self, p2p: P2P) -> None:
        """Have the reaper kill another libp2p daemon of ours (say a probe's) and remove its
        sockets if this process dies."""
        watch_p2p(self._reaper, p2p)

    async def visible_maddrs(self, latest: bool = False) -> list[str]:
        """The addresses libp2p announces; `latest`: ask p2pd again (a relayed address
        appears later), not the list cached at start."""
        return [str(m) for m in await self.p2p.get_visible_maddrs(latest=latest)]

    async def relayed_peers(self) -> tuple[list[str], set[str]]:
        """Peers this node is connected to only through a relay circuit, and the peers it
        holds a direct connection to."""
        return split_connections(await self.p2p.list_peers())

    async def store(
        self,
        key: str,
        value: Any,
        ttl: float,
        subkey: str | None = None,
        timeout: float = DHT_TIMEOUT_S,
    ) -> bool:
        future = self.dht.store(key, value, get_dht_time() + ttl, subkey=subkey, return_future=True)
        try:
            return bool(await asyncio.wait_for(_awaited(future), timeout))
        except TimeoutError:
            log.warning("DHT store of %s timed out after %.0fs", key, timeout)
            return False

    async def get(self, key: str, latest: bool = True) -> Any:
        """The value under `key` (for subkeyed keys: {subkey: value}), or None."""
        return (await self.get_many([key], latest=latest))[key]

    async def get_many(self, keys: Sequence[str], latest: bool = True) -> dict[str, Any]:
        """The values under `keys`, each as `get` gives it, from one DHT search: hivemind
        asks each peer it visits about every key still open in one request, so reading a
        run's stages together costs a fraction of the requests of reading them one by one.
        `latest`: search every replica for the newest value, not the first found."""
        keys = list(dict.fromkeys(keys))
        future = self.dht.run_coroutine(partial(_get_many, keys, latest), return_future=True)
        try:
            found = await asyncio.wait_for(_awaited(future), DHT_TIMEOUT_S)
        except TimeoutError:
            log.warning("DHT get of %s timed out after %.0fs", ", ".join(keys), DHT_TIMEOUT_S)
            return dict.fromkeys(keys)
        return {key: _plain(found.get(key)) for key in keys}

    async def meet(self, peers: Mapping[str, Sequence[str]], at_most: int) -> tuple[int, int]:
        """Ping, through the DHT, peers its routing table lacks: (how many of `peers` it
        lacked, how many of those answered).

        An answer adds the peer to our routing table and us to its (hivemind's ping carries
        the caller's node id). hivemind drops unresponsive peers from its routing table and
        never asks its initial peers again, so the two halves of a healed partition each keep
        a DHT of their own (and a directory without the other half's records) for ever,
        although their libp2p daemons and SWIM meet again in seconds.

        `peers`: peer id -> addresses to dial it at first (an initial peer's: libp2p forgets
        the addresses of peers it has long been cut off from) or none (a peer libp2p can
        reach, say one SWIM just did). Every lacking peer with addresses is pinged, and up
        to `at_most` of the others, at random. Peers in the table cost nothing; malformed
        ids and our own are skipped."""
        try:
            future = self.dht.run_coroutine(
                partial(_meet, {k: list(v) for k, v in peers.items()}, at_most),
                return_future=True,
            )
            return await asyncio.wait_for(_awaited(future), DHT_TIMEOUT_S)
        except TimeoutError:
            log.warning("the DHT did not finish pinging peers it lacks in %.0fs", DHT_TIMEOUT_S)
            return 0, 0
        except Exception as exc:  # noqa: BLE001 - a DHT in trouble shows elsewhere (is_alive)
            log.warning("the DHT could not ping peers it lacks: %s", one_line(exc))
            return 0, 0

    def is_alive(self) -> bool:
        return self.dht.is_alive() and self.p2p.is_alive

    async def shutdown(self) -> None:
        """Stop the DHT process and the libp2p daemon; the reaper kills what is left.

        hivemind's DHT.shutdown blocks on its child; when the child is already gone
        (a process-group signal reached it first) that wait may never end, so it runs
        in a daemon thread that neither the event loop's shutdown nor the interpreter's
        exit waits for."""
        started = time.monotonic()
        try:
            await asyncio.wait_for(_in_daemon_thread(self.dht.shutdown), SHUTDOWN_STEP_S)
        except TimeoutError:
            log.warning("the DHT process did not stop within %.0fs", SHUTDOWN_STEP_S)
        finally:
            await shutdown_p2p(self.p2p, SHUTDOWN_STEP_S)
            self._kill_leftovers()
            self._reaper.stop()
        log.debug("host shut down in %.1fs", time.monotonic() - started)

    def _kill_leftovers(self) -> None:
        """A DHT process that did not stop in time (say it got a signal meant for its group
        and hangs) is killed: our own child, so its pid cannot have been reused. (The
        libp2p daemon's is shutdown_p2p's.)"""
        pid = self.dht.pid
        if pid is not None and _running(pid):
            log.warning("the DHT process %d did not stop: killing it", pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def _get_many(keys: list[str], latest: bool, _dht: object, node: Any) -> dict:
    """Runs in the DHT process (DHT.run_coroutine): {key: ValueWithExpiration or None}."""
    kwargs = {"sufficient_expiration_time": math.inf} if latest else {}
    return await node.get_many(keys, **kwargs)


async def _meet(
    peers: dict[str, list[str]], at_most: int, _dht: object, node: Any
) -> tuple[int, int]:
    """Runs in the DHT process (DHT.run_coroutine): Host.meet."""
    dial, others = [], []
    for text, addrs in peers.items():
        try:
            peer = PeerID.from_base58(text)
            maddrs = [Multiaddr(a) for a in addrs]
        except Exception:  # noqa: BLE001, S112 - what we were told is not ours to trust
            continue
        if peer != node.peer_id and peer not in node.protocol.routing_table:
            (dial if maddrs else others).append((peer, maddrs))
    chosen = dial + random.sample(others, min(at_most, len(others)))
    answers = await asyncio.gather(*(_dial_and_ping(node, *each) for each in chosen))
    return len(dial) + len(others), sum(answers)


async def _dial_and_ping(node: Any, peer: PeerID, maddrs: list[Multiaddr]) -> bool:
    if maddrs:
        with contextlib.suppress(Exception):  # the ping says whether it can be reached
            client = node.protocol.p2p._client  # noqa: SLF001 - no public connect
            await asyncio.wait_for(client.connect(peer, maddrs), MEET_DIAL_S)
    return await node.protocol.call_ping(peer) is not None


def _plain(found: Any) -> Any:
    """A DHT result without its expirations: the value, {subkey: value}, or None."""
    if found is None:
        return None
    value = found.value
    if isinstance(value, dict):  # subkeys -> ValueWithExpiration
        return {k: getattr(v, "value", v) for k, v in value.items()}
    return value


def watch_p2p(reaper: Reaper, p2p: P2P) -> None:
    """The reaper kills `p2p`'s daemon and removes its two unix sockets (the daemon's and
    our client's, both in /tmp) if this process dies."""
    reaper.watch(p2p._child.pid)  # noqa: SLF001 - no public accessor for the daemon's pid
    for path in _socket_paths(p2p):
        reaper.remove_on_death(path)


async def create_p2p(**options: Any) -> P2P:
    """`P2P.create(**options)`, whose unix sockets are removed if it fails.

    A libp2p daemon that exits while starting (say no initial peer answered) leaves its
    socket in /tmp, and hivemind names it at random inside `create`: the sockets here
    carry a tag of this call's own, so that exactly they can be found and removed."""
    settle_cancelled_calls()
    prefix = f"/tmp/hivemind-{secrets.token_hex(4)}-"
    tagged = type("P2P", (P2P,), {"_UNIX_SOCKET_PREFIX": "/unix" + prefix})
    try:
        with _children_in_own_session():
            return await tagged.create(**options)
    except BaseException:
        for path in glob.glob(glob.escape(prefix) + "*.sock"):
            remove_socket(path)
        raise


_SPAWN = asyncio.subprocess.create_subprocess_exec
_sessions_wanted = 0


def _spawn_in_own_session(*args: Any, **kwargs: Any):  # noqa: ANN202 - _SPAWN's coroutine
    kwargs.setdefault("start_new_session", True)
    return _SPAWN(*args, **kwargs)


@contextlib.contextmanager
def _children_in_own_session():  # noqa: ANN202
    """hivemind starts p2pd with asyncio's create_subprocess_exec and no way to pass options:
    while any create_p2p runs (they may overlap), children start in sessions of their own
    (see OwnSessionDHT)."""
    global _sessions_wanted
    _sessions_wanted += 1
    asyncio.subprocess.create_subprocess_exec = _spawn_in_own_session
    try:
        yield
    finally:
        _sessions_wanted -= 1
        if _sessions_wanted == 0:
            asyncio.subprocess.create_subprocess_exec = _SPAWN


class OwnSessionDHT(hivemind.DHT):
    """hivemind's DHT, whose process (like the libp2p daemon) runs in a session of its own.

    A signal to the node's process group (Ctrl-C in a terminal, a closed terminal's SIGHUP,
    `kill -- -PGID`, systemd) then reaches the node alone, which leaves cleanly through
    them: withdraws its record, forwards in-flight work, says goodbye over SWIM. Sent to
    them too, p2pd exited at once and each of those steps ran into its deadline. If the
    node dies, the reaper kills both (reaper.py)."""

    def run(self) -> None:
        with contextlib.suppress(OSError):  # already a session leader
            os.setsid()
        super().run()


async def shutdown_p2p(p2p: P2P, timeout_s: float) -> None:
    """Stop `p2p` and its daemon, and remove the unix sockets they leave.

    hivemind removes the daemon's socket only if the daemon was still running at
    shutdown, and p2pd does not remove it when a signal ends it: a SIGTERM to the
    node's process group (systemd, `kill -- -PGID`) reaches p2pd first and left the
    socket in /tmp. A daemon that does not stop in time is killed (our own child, so
    its pid cannot have been reused)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(p2p.shutdown(), timeout_s)
    pid = getattr(p2p._child, "pid", None)  # noqa: SLF001 - no public accessor
    if pid is not None and _running(pid):
        log.warning("the libp2p process %d did not stop: killing it", pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for path in _socket_paths(p2p):
        remove_socket(path)


def _socket_paths(p2p: P2P) -> list[str]:
    maddrs = (p2p.daemon_listen_maddr, p2p._client_listen_maddr)  # noqa: SLF001
    return [str(m)[len("/unix") :] for m in maddrs if str(m).startswith("/unix/")]


def _running(pid: int) -> bool:
    """A child of ours that has not exited (a zombie counts as exited)."""
    fields = proc_stat(pid)
    return fields is not None and fields[0] != "Z"


def _in_daemon_thread(fn: Callable[[], Any]) -> asyncio.Future:
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(_settle, future, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, future, result, None)

    threading.Thread(target=run, name="host-shutdown", daemon=True).start()
    return future


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


async def _awaited(future: Any) -> Any:
    """hivemind's MPFuture is awaitable when created inside a running loop."""
    return await future


def split_connections(infos: Sequence[Any]) -> tuple[list[str], set[str]]:
    """Of libp2p's peer list: the peers connected only through a relay circuit, and those
    with a direct connection."""
    relayed, direct = [], set()
    for info in infos:
        peer = info.peer_id.to_base58()
        if any(not is_relayed(str(a)) for a in info.addrs):
            direct.add(peer)
        elif info.addrs:
            relayed.append(peer)
    return relayed, direct


def is_relayed(maddr: str) -> bool:
    """A circuit address: reached through a relay (`.../p2p/<relay>/p2p-circuit/...`)."""
    return "/p2p-circuit" in maddr


def relay_candidates(peers: Sequence[str]) -> list[str]:
    """The direct addresses of known peers (`.../p2p/<id>`) that may relay for this node."""
    return [p for p in peers if "/p2p/" in p and not is_relayed(p)][:MAX_RELAYS]


def is_valid_maddr(maddr: str) -> bool:
    try:
        Multiaddr(maddr)
    except Exception:  # the multiaddr parser raises several unrelated types
        return False
    return True
