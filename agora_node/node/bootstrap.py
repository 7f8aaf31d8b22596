"""The bootstrap peer: an entry point that publishes a run's manifest, answers
dial-back checks (comms/reachability.py) and relays for nodes behind NAT
(comms/relay.py). It serves no stage.

It only makes the swarm findable: once peers know each other it may die, and
any live peer works as `--initial-peers` (every node republishes the manifest). It
remembers some of the run's active peers in its data dir (peerbook.py,
`bootstrap-peers.json`) and meets them when it starts again: a bootstrap that came back
alone had a DHT of its own, and a newcomer that joined through it found no replica and
started its stage from scratch beside the swarm's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shlex
import signal
import time

from agora_node.comms.directory import MANIFEST_TTL_S, Directory, publish_manifest
from agora_node.comms.host import Host, HostConfig
from agora_node.node.dialback import DialBack
from agora_node.node.peerbook import BOOTSTRAP_FILE_NAME, PeerBook
from agora_node.protocol.identity import Identity
from agora_node.protocol.manifest import Manifest

log = logging.getLogger(__name__)

REMEMBER_EVERY_S = 10.0
"""How often the bootstrap reads the run's directory for peers to remember (the peer book
writes at most every 30 s); it republishes the manifest every MANIFEST_TTL_S / 4."""


async def run_bootstrap(
    manifest: Manifest,
    identity_path: str,
    host_maddrs: list[str],
    announce_maddrs: list[str],
    initial_peers: list[str],
    *,
    data_dir: str | None = None,
    relay_for_others: bool = True,
    ready: asyncio.Event | None = None,
) -> int:
    identity = Identity.load_or_create(identity_path)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):  # as a node
        loop.add_signal_handler(sig, stop.set)
    host = await Host.start(
        HostConfig(
            identity_path=identity_path,
            host_maddrs=host_maddrs,
            announce_maddrs=announce_maddrs,
            initial_peers=initial_peers,
            public=True,  # its joiners dial it: their relay reservations must not be dropped
        )
    )
    peerbook = PeerBook(data_dir, file_name=BOOTSTRAP_FILE_NAME) if data_dir else None
    dialback = DialBack()
    try:
        directory = Directory(host, identity, manifest.run_id, manifest.num_stages)
        if peerbook is not None and peerbook.saved:
            # not initial peers: a bootstrap must start when none of them answers
            await _meet_remembered(host, peerbook, at_start=True)
        await dialback.serve(host, manifest.run_id, host_maddrs, None)
        # nodes behind NAT reserve their libp2p relay slot here first (their initial peer)
        await dialback.serve_relaying(
            host, identity, manifest.run_id, offer=relay_for_others, refuse=None
        )
        await publish_manifest(host, manifest, identity)
        maddrs = await host.visible_maddrs()
        print(
            f"agora-node: bootstrap for run {manifest.run_id} ({manifest.run.name}) as {host.peer_id}"
        )
        print("agora-node: join with:")
        print(
            "  agora-node join --initial-peers " + " ".join(shlex.quote(m) for m in maddrs),
            flush=True,
        )
        if named := manifest.data.local_files():
            print(
                f"agora-node: its stage 0 reads files the manifest names ({', '.join(named)}):"
                " a node serves stage 0 only when given the manifest itself, --manifest FILE,"
                " and has them",
                flush=True,
            )
        if ready is not None:
            ready.set()
        published = time.monotonic()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), REMEMBER_EVERY_S)
            if stop.is_set():
                break
            if time.monotonic() - published >= MANIFEST_TTL_S / 4:
                await publish_manifest(host, manifest, identity)
                published = time.monotonic()
            if peerbook is not None:
                await _meet_remembered(host, peerbook, at_start=False)
                await _remember(host, peerbook, directory)
        log.info("bootstrap stopping")
        return 0
    finally:
        await dialback.close()
        await host.shutdown()


async def _meet_remembered(host: Host, peerbook: PeerBook, *, at_start: bool) -> None:
    """Meet the remembered peers the DHT lacks (at start, and at every read after: a first
    try may find the network not up yet; nothing to do once they are in the routing
    table). Host.meet never raises; it warns of a timeout itself."""
    lacked, met = await host.meet(peerbook.to_meet([]), 0)
    if met:
        log.info("met %d of %d remembered peer(s) of the run", met, lacked)
    elif lacked and at_start:  # later tries stay quiet
        log.warning(
            "none of the %d remembered peer(s) of the run answered (%s): until one does, "
            "a newcomer joining through this bootstrap may find no replica",
            lacked,
            peerbook.data_dir,
        )


async def _remember(host: Host, peerbook: PeerBook, directory: Directory) -> None:
    """Remember the directory's active peers. Never fatal: the next read tries again."""
    try:
        view = await directory.fetch()
    except Exception as exc:  # noqa: BLE001 - the bootstrap goes on serving
        log.warning("could not read the run's peers: %r", exc)
        return
    peerbook.update((r for rs in view.values() for r in rs), host.peer_id)
