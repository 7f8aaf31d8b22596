"""A bare libp2p peer (hivemind's P2P, no daemon of ours) for the relay test of the network
lab: a relay, a peer behind NAT that reserves a slot on it, or a stranger that calls the
NATed peer. One JSON line per event on stdout.

    python -m tests.integration.relay_peer --role relay|natted|caller --listen MADDR
        [--relay MADDR] [--target PEER_ID] [--wait S]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from google.protobuf.wrappers_pb2 import BytesValue
from hivemind.p2p import P2P, PeerID

from agora_node.comms.host import create_p2p, shutdown_p2p, watch_p2p
from agora_node.comms.reaper import Reaper


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def echo(request: BytesValue, _context: object) -> BytesValue:
    return BytesValue(value=b"echo:" + request.value)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["relay", "natted", "caller"], required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--relay", default="")
    parser.add_argument("--target", default="")
    parser.add_argument("--wait", type=float, default=300.0)
    args = parser.parse_args()
    options: dict = {"host_maddrs": [args.listen], "nat_port_map": False, "use_relay": True}
    if args.relay:
        options["initial_peers"] = [args.relay]
    if args.role == "relay":
        # Public from the start: the bundled p2pd accepts reservations while AutoNAT has not
        # decided, and when a peer's dial-back then finds it public it starts its relay
        # service anew, forgetting them (the relay's debug log: "reserving relay slot",
        # then "NAT status is public", then NO_RESERVATION for the stranger's call).
        options.update(auto_nat=True, force_reachability="public")
    elif args.role == "natted":  # private forced; daemons let AutoNAT find it (test_netlab.py)
        options.update(
            use_auto_relay=True, force_reachability="private", trusted_relays=[args.relay]
        )
    p2p: P2P = await create_p2p(**options)
    # the test SIGKILLs this process's group: the reaper (a session of its own) then
    # stops p2pd and removes its sockets
    watch_p2p(Reaper.start(), p2p)
    try:
        await p2p.add_protobuf_handler("echo", echo, BytesValue)
        emit(event="ready", peer_id=p2p.peer_id.to_base58())
        started = time.monotonic()
        if args.role == "natted":
            while time.monotonic() - started < args.wait:
                addrs = [str(m) for m in await p2p.get_visible_maddrs(latest=True)]
                if any("/p2p-circuit" in a for a in addrs):
                    emit(event="relayed", after_s=round(time.monotonic() - started, 1), addrs=addrs)
                    break
                await asyncio.sleep(1.0)  # poll interval of a bounded wait
            else:
                emit(event="no_relay", addrs=addrs)
        elif args.role == "caller":
            peer = PeerID.from_base58(args.target)
            call = p2p.call_protobuf_handler(peer, "echo", BytesValue(value=b"hi"), BytesValue)
            reply = await asyncio.wait_for(call, 30)
            via = [
                str(a)
                for info in await p2p.list_peers()
                if info.peer_id == peer
                for a in info.addrs
            ]
            emit(event="reply", value=reply.value.decode(), via=via)
            return
        await asyncio.Event().wait()  # serve until killed
    finally:
        await shutdown_p2p(p2p, 10.0)


if __name__ == "__main__":
    asyncio.run(main())
