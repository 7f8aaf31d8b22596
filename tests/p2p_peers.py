"""Bare hivemind P2P peers on 127.0.0.1 for tests of handlers and links, stopped by pid."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

from hivemind.p2p import P2P


async def stop_p2p(p2p: P2P | None) -> None:
    """Shut a peer down; kill its libp2p daemon by pid if it outlives the shutdown."""
    if p2p is None:
        return
    child = getattr(p2p, "_child", None)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(p2p.shutdown(), 15)
    if child is not None and child.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)


async def start_peers(n: int) -> list[P2P]:
    """n peers, the others dialled to the first; all stopped again if one fails to start."""
    first = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    peers = [first]
    try:
        maddrs = await first.get_visible_maddrs()
        for _ in range(n - 1):
            peers.append(
                await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            )
    except BaseException:
        for p in peers:
            await stop_p2p(p)
        raise
    return peers
