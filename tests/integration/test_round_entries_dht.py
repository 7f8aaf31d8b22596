"""Round entries over real hivemind DHT nodes on 127.0.0.1: an entry re-stored marked done
(Matchmaker.finish) replaces the first one in the other peer's reads, so a replica that
reaches the round later, its only partner finished without it, is alone at once
(groups.py, finished_apart) instead of forming a group of two the other never formed."""

from __future__ import annotations

import pytest

from agora_node.comms.collective import Matchmaker, MatchmakingConfig
from agora_node.comms.collective.groups import DHTBoard
from agora_node.protocol.identity import Identity
from tests.outer.harness import start_local_host

pytestmark = [pytest.mark.timeout(120), pytest.mark.integration]
QUICK = MatchmakingConfig(window=0.5, settle=0.2, poll_interval=0.05)


async def test_an_entry_marked_done_replaces_the_first_in_the_other_peers_reads() -> None:
    first, joiner = Identity.generate(), Identity.generate()
    a = await start_local_host(first)
    b = None
    try:
        b = await start_local_host(joiner, [str(m) for m in await a.visible_maddrs()])
        ma = Matchmaker(DHTBoard(a.dht), first, run_id="r", stage=0, config=QUICK)
        mb = Matchmaker(DHTBoard(b.dht), joiner, run_id="r", stage=0, config=QUICK)
        both = {first.peer_id, joiner.peer_id}
        assert (await ma.gather(5, expect={first.peer_id})).peers == [first.peer_id]
        assert await mb.opened_by_others(5, expect=both)  # read from the other node
        assert await ma.finish(5)
        # the mark replaced the first entry in the other node's reads (else: a group of two)
        assert (await mb.gather(5, expect=both)).peers == [joiner.peer_id]
    finally:
        if b is not None:
            await b.shutdown()
        await a.shutdown()
