"""Run one membership peer on its own libp2p daemon (for the integration tests).

    python tests/membership/run_peer.py --identity key --seed /ip4/.../p2p/12D3KooW...

Prints JSON lines on stdout: first {"event": "ready", "peer_id", "maddrs"}, then
{"event": "member", "peer_id", "status"} on every change of a member's status, and
{"event": "view", "members": {peer_id: status}, "counters": {...}} after changes
and every --report-s seconds. Reads JSON commands on stdin:
{"cmd": "leave"}; {"cmd": "forge", "to": peer_id} sends `to` a message signed
with a key that is not ours (it must be dropped and counted).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import threading

from google.protobuf.wrappers_pb2 import BytesValue
from hivemind.p2p import P2P, PeerID

from agora_node.comms.control_calls import settle_cancelled_calls
from agora_node.comms.host import watch_p2p
from agora_node.comms.membership import messages as wire
from agora_node.comms.membership.messages import MemberMeta, MsgKind
from agora_node.comms.membership.p2p import (
    MembershipService,
    MembershipServicer,
)
from agora_node.comms.membership.settings import MembershipSettings
from agora_node.comms.membership.swim import MemberView
from agora_node.comms.reaper import Reaper
from agora_node.protocol.identity import Identity
from agora_node.protocol.names import STANDALONE_SWIM_NAMESPACE


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--identity", required=True, help="Ed25519 libp2p key file (created if absent)")
    p.add_argument("--host-maddr", default="/ip4/127.0.0.1/tcp/0")
    p.add_argument("--seed", action="append", default=[], help="multiaddr of a known peer")
    p.add_argument("--settings-json", default="{}", help="MembershipSettings overrides")
    p.add_argument("--stage", type=int, default=-1)
    p.add_argument("--report-s", type=float, default=0.5)
    return p.parse_args(argv)


def emit(record: dict) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def view_of(service: MembershipService) -> dict:
    return {
        "event": "view",
        "peer_id": service.peer_id,
        "members": {m.peer_id: m.status.name for m in service.members()},
        "counters": service.counters,
    }


def read_commands(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
    """A thread: stdin lines become commands on the event loop (EOF = leave)."""
    for line in sys.stdin:
        with contextlib.suppress(json.JSONDecodeError):
            loop.call_soon_threadsafe(queue.put_nowait, json.loads(line))
    loop.call_soon_threadsafe(queue.put_nowait, {"cmd": "leave"})


async def send_forged(p2p: P2P, service: MembershipService, to: str) -> None:
    """A PING that claims to come from us but is signed by a stranger's key."""
    stranger = Identity.generate()
    unsigned = wire.encode_envelope(MsgKind.PING, 2**62, wire.probe_body(1), [])
    data = unsigned + stranger.sign(wire.envelope_signing_input(service.peer_id, to, unsigned))
    stub = MembershipServicer.get_stub(
        p2p, PeerID.from_base58(to), namespace=STANDALONE_SWIM_NAMESPACE
    )
    await stub.rpc_gossip(BytesValue(value=data), timeout=5)


async def serve(args: argparse.Namespace) -> int:
    identity = Identity.load_or_create(args.identity)
    settings = MembershipSettings(**json.loads(args.settings_json))
    settle_cancelled_calls()  # as a daemon's (comms/control_calls.py): a late answer ends no reader
    # Ed25519 identity files trip hivemind's RSA-only "identity taken" check
    p2p = await P2P.create(
        initial_peers=args.seed or None,
        host_maddrs=[args.host_maddr],
        identity_path=args.identity,
        check_if_identity_free=False,
    )
    # the tests SIGKILL this process's group: the reaper (a session of its own) then
    # kills nothing left but removes p2pd's unix sockets, as it does for a daemon
    watch_p2p(Reaper.start(), p2p)
    service = MembershipService(
        p2p, identity, seeds=args.seed, settings=settings, meta=MemberMeta(stage=args.stage)
    )
    changed = asyncio.Event()

    def on_change(view: MemberView) -> None:
        emit({"event": "member", "peer_id": view.peer_id, "status": view.status.name})
        changed.set()

    service.subscribe(on_change)
    await service.start()
    emit(
        {
            "event": "ready",
            "peer_id": identity.peer_id,
            "maddrs": [str(a) for a in await p2p.get_visible_maddrs()],
        }
    )
    commands: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    threading.Thread(target=read_commands, args=(loop, commands), daemon=True).start()
    try:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), timeout=args.report_s)
            changed.clear()
            emit(view_of(service))
            while not commands.empty():
                cmd = commands.get_nowait()
                if cmd.get("cmd") == "leave":
                    await service.leave()
                    emit({"event": "left", "peer_id": identity.peer_id})
                    return 0
                if cmd.get("cmd") == "forge":
                    await send_forged(p2p, service, cmd["to"])
    finally:
        await service.stop()
        await p2p.shutdown()


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(serve(parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
