"""This node's side of dial-back checks (comms/reachability.py): answering peers that ask
to be dialed back, from a probe daemon started on the first request, and asking a few
peers to dial us, with one log line whenever their answer changes."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from agora_node.comms import reachability
from agora_node.comms.host import Host

log = logging.getLogger(__name__)


class DialBack:
    def __init__(self) -> None:
        self.reach = reachability.Reachability()
        """What the peers asked found (the status page's `reachability`)."""
        self.prober: reachability.Prober | None = None

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

    async def close(self) -> None:
        if self.prober is not None:
            await self.prober.close()
