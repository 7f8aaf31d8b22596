"""One collective round over hivemind P2P on loopback: wall time and bytes on the wire.

    python bench/collective.py --peers 4 --params 25e6 [--json]

Starts --peers processes (this file with --peer), each a hivemind DHT peer serving
the collective, and runs one reduce-scatter/all-gather of a --params float32
pseudo-gradient per scenario: fp32 (no codec), int8 and int4 (rotation, error
feedback, zstd; int8 results), then int8 with one member frozen right after its
first part is delivered and SIGKILLed. Wall time is the slowest member's time from
its start (encoding included) to holding the whole mixed vector; bytes are frame
payloads sent, summed over members (libp2p/protobuf framing adds well under 1%).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # agora_node and tests/

from agora_node.comms.collective import (  # noqa: E402
    AggregationSpec,
    AllReduce,
    Deadlines,
    GroupPlan,
    PartEncoder,
    Responder,
    RoundBook,
    WireFormat,
)
from agora_node.comms.collective.payload import max_frame_bytes  # noqa: E402
from agora_node.compression import Codec  # noqa: E402
from agora_node.protocol.codecs import from_name  # noqa: E402
from agora_node.protocol.identity import Identity  # noqa: E402
from tests.outer.harness import (  # noqa: E402
    FreezeAfterFirstPush,
    PeerProcess,
    die_with_parent,
    emit,
    start_local_host,
)

SCENARIOS = (("fp32", "fp32", False), ("int8", "int8", False), ("int4", "int4", False))
KILLED = ("int8_one_killed", "int8", True)


# ---- a peer process --------------------------------------------------------------------
async def serve(args: argparse.Namespace) -> None:
    from agora_node.comms.collective.p2p import CollectiveServicer, P2PTransport

    die_with_parent()
    identity = Identity.generate()
    host = await start_local_host(identity, args.initial_peer)
    numel = int(args.params)
    limit = max_frame_bytes(numel)
    p2p = host.p2p
    book = RoundBook(identity.peer_id)
    await CollectiveServicer(Responder(book), limit).add_p2p_handlers(p2p, namespace="bench")
    transport = P2PTransport(p2p, namespace="bench", max_frame_bytes=limit)
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(args.seed)) * 1e-3
    emit("ready", peer=identity.peer_id, maddrs=await host.visible_maddrs())
    stdin = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin
    )
    while line := await stdin.readline():
        cmd = json.loads(line)
        codec = from_name(cmd["codec"])
        fmt = WireFormat(
            part=codec,
            result=Codec.INT8 if codec.is_quantized else codec,
            error_feedback=codec.is_quantized,
        )
        plan = GroupPlan(
            round=cmd["round"],
            phase="delta",
            members=tuple(cmd["members"]),
            numel=numel,
            block=fmt.block,
            namespace="bench",
        )
        run = AllReduce(
            book.register(plan),
            FreezeAfterFirstPush(transport) if cmd["freeze"] else transport,
            fmt=fmt,
            encoder=PartEncoder(fmt),
            aggregation=AggregationSpec(),
            deadlines=Deadlines(min_rate=args.min_rate),
        )
        out = await run.run(flat, 1.0)
        emit(
            "result",
            round=cmd["round"],
            seconds=out.seconds,
            consistent=out.consistent,
            bytes_sent=out.stats.bytes_sent,
            failed=len(out.stats.failed_peers),
            finite=bool(torch.isfinite(out.value).all()),
            digest=hashlib.sha256(out.value.numpy().tobytes()).hexdigest()[:16],
        )


# ---- the driver --------------------------------------------------------------------------
def start_peers(args: argparse.Namespace, peers: list[PeerProcess]) -> list[str]:
    """Start the peers (appended to `peers` as they start, for cleanup); their peer ids."""
    me = [__file__, "--peer", "--params", str(args.params), "--min-rate", str(args.min_rate)]
    peers.append(PeerProcess([*me, "--seed", "0"]))
    first = peers[0].expect("ready", 120)
    for i in range(1, args.peers):
        peers.append(PeerProcess([*me, "--seed", str(i), "--initial-peer", first["maddrs"][0]]))
    return [first["peer"]] + [p.expect("ready", 120)["peer"] for p in peers[1:]]


def run_scenario(
    peers: list[PeerProcess], members: list[str], round_no: int, codec: str, kill: bool
) -> dict:
    for i, p in enumerate(peers):
        freeze = kill and i == len(peers) - 1
        p.send(
            json.dumps({"round": round_no, "codec": codec, "members": members, "freeze": freeze})
        )
    alive = peers
    if kill:
        peers[-1].expect("pushed", 300)
        peers[-1].kill()
        alive = peers[:-1]
    results = [p.expect("result", 600, round=round_no) for p in alive]
    return {
        "seconds": round(max(r["seconds"] for r in results), 2),
        "bytes_total": sum(r["bytes_sent"] for r in results),
        "bytes_per_peer": sum(r["bytes_sent"] for r in results) // len(results),
        "members_finished": len(results),
        "equal_results": len({r["digest"] for r in results}) == 1,
        "consistent": all(r["consistent"] and r["finite"] for r in results),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--params", type=float, default=25e6)
    p.add_argument("--min-rate", type=float, default=10e6, help="bytes/s the deadlines assume")
    p.add_argument("--json", action="store_true")
    p.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--initial-peer", action="append", default=[], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peer:
        asyncio.run(serve(args))
        return 0
    peers: list[PeerProcess] = []
    results = {}
    try:
        members = start_peers(args, peers)
        for round_no, (name, codec, kill) in enumerate((*SCENARIOS, KILLED)):
            results[name] = run_scenario(peers, members, round_no, codec, kill)
            if not args.json:
                r = results[name]
                print(
                    f"{name:16s} {r['seconds']:7.2f}s  {r['bytes_per_peer'] / 1e6:8.1f} MB/peer  "
                    f"finished {r['members_finished']}/{args.peers}  equal {r['equal_results']}"
                )
    finally:
        for peer in peers:
            peer.kill()
    fp32_ring = 2 * (args.peers - 1) / args.peers * 4 * int(args.params)
    out = {
        "peers": args.peers,
        "params": int(args.params),
        "fp32_ring_bytes_per_peer": int(fp32_ring),
    }
    if args.json:
        print(json.dumps({**out, "rounds": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
