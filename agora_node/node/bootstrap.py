"""The bootstrap peer: an entry point that publishes a run's manifest, answers
dial-back checks (comms/reachability.py) and relays for nodes behind NAT
(comms/relay.py). It serves no stage.

It only makes the swarm findable: once peers know each other it may die, and
any live peer works as `--initial-peers` (every node republishes the manifest).
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import signal

from agora_node.comms.directory import MANIFEST_TTL_S, publish_manifest
from agora_node.comms.host import Host, HostConfig
from agora_node.node.dialback import DialBack
from agora_node.protocol.identity import Identity
from agora_node.protocol.manifest import Manifest

log = logging.getLogger(__name__)


async def run_bootstrap(
    manifest: Manifest,
    identity_path: str,
    host_maddrs: list[str],
    announce_maddrs: list[str],
    initial_peers: list[str],
    *,
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
    dialback = DialBack()
    try:
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
        if ready is not None:
            ready.set()
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), MANIFEST_TTL_S / 4)
            except TimeoutError:
                await publish_manifest(host, manifest, identity)
        log.info("bootstrap stopping")
        return 0
    finally:
        await dialback.close()
        await host.shutdown()
