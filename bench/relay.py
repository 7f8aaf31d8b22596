"""What a relay of ours (comms/relay.py) costs a request, against the same request sent
directly, alternated in one run (direct, relayed, direct, relayed, ...).

    python bench/relay.py --json
    python bench/relay.py --sizes 131072,1048576 --requests 40 --repeats 3 --json

Three hivemind peers on 127.0.0.1, each with its own libp2p daemon and Ed25519 key: a
caller, a relay and a target, all served by this one Python process and event loop
(the relay's copies, the caller's signing and the target's checks and signing all take
turns on it, as they would on three machines' worth of work squeezed onto one loop).
The target answers each request with as many bytes as it got (a micro-batch's
activation forward, its gradient back). Per payload size, each side sends `--requests`
requests one after another; a side's figures are the median over `--repeats`.

One JSON line (`--json`): per size, `direct` and `relayed` {`ms_per_request` (median of
the per-request times), `mb_per_s` (request and answer bytes over the side's wall
time)}, and `relayed_over_direct` (the ratio of ms per request); `failures` {direct,
relayed}: of `--stress` further requests of 1 MiB per side, how many failed (an answer
cut short, say); plus the conditions.
Loopback has no propagation delay, so this is the relay's own cost (two more libp2p
legs, one more copy through Python, a SHA-256 and an Ed25519 signature each way); on
real links each relayed byte also crosses the relay's uplink and downlink.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agora_node.comms import streams  # noqa: E402
from agora_node.comms.guard import Guard, Limits  # noqa: E402
from agora_node.comms.relay import Relaying  # noqa: E402
from agora_node.protocol.identity import Identity  # noqa: E402

RUN = "relaybench"
ECHO = f"/agora/{RUN}/echo/1"


async def _peer(folder: Path, name: str, initial: list | None = None):  # noqa: ANN202
    from hivemind.p2p import P2P

    from agora_node.comms.host import settle_cancelled_calls

    settle_cancelled_calls()  # as a daemon's: a late answer ends no reader
    path = folder / f"{name}.key"
    identity = Identity.load_or_create(path)
    p2p = await P2P.create(
        identity_path=str(path),
        check_if_identity_free=False,  # it parses RSA keys only; ours are Ed25519
        initial_peers=initial or [],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
    )
    relaying = Relaying(identity, RUN)
    await relaying.serve(p2p, refuse=None)
    streams.set_route(p2p, relaying)
    return p2p, relaying


async def _side(caller, target: str, size: int, requests: int) -> tuple[float, float]:  # noqa: ANN001
    """(median ms per request, MB/s both ways) of `requests` requests in a row."""
    payload = os.urandom(size)
    times = []
    started = time.perf_counter()
    for _ in range(requests):
        t0 = time.perf_counter()
        answer = await streams.request(caller, target, ECHO, payload, timeout=60)
        times.append(time.perf_counter() - t0)
        if len(answer) != size:
            raise RuntimeError("short answer")
    wall = time.perf_counter() - started
    return statistics.median(times) * 1000, 2 * size * requests / wall / 1e6


async def _failures(caller, target: str, size: int, requests: int) -> int:  # noqa: ANN001
    """How many of `requests` requests in a row failed (an answer cut short, say)."""
    payload, failed = os.urandom(size), 0
    for _ in range(requests):
        try:
            if await streams.request(caller, target, ECHO, payload, timeout=60) != payload:
                failed += 1
        except streams.StreamError:
            failed += 1
    return failed


async def run(args: argparse.Namespace) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="agora-relay-bench-"))
    peers = []
    try:
        relay_p2p, _ = await _peer(folder, "relay")
        peers.append(relay_p2p)
        maddrs = await relay_p2p.get_visible_maddrs()
        target_p2p, _ = await _peer(folder, "target", maddrs)
        peers.append(target_p2p)
        caller_p2p, caller = await _peer(folder, "caller", maddrs)
        peers.append(caller_p2p)

        async def echo(remote: str, request: bytes):  # noqa: ANN202
            yield request

        unlimited = Limits(max_streams=1024, max_streams_per_peer=1024, rate_per_s=1e6, burst=1e6)
        guard = Guard("echo", unlimited)  # the transport is measured, not admission
        await streams.serve(target_p2p, ECHO, echo, max_request=64 << 20, guard=guard)
        target, relay = target_p2p.peer_id.to_base58(), relay_p2p.peer_id.to_base58()
        await _side(caller_p2p, target, 1024, 5)  # warm both paths' connections
        caller.routes = {target: [relay]}
        await _side(caller_p2p, target, 1024, 5)
        results = {}
        for size in args.sizes:
            seen: dict[str, list[tuple[float, float]]] = {"direct": [], "relayed": []}
            for _ in range(args.repeats):
                for side in ("direct", "relayed"):
                    caller.routes = {target: [relay]} if side == "relayed" else {}
                    seen[side].append(await _side(caller_p2p, target, size, args.requests))
            row = {
                side: {
                    "ms_per_request": round(statistics.median(t for t, _ in runs), 2),
                    "mb_per_s": round(statistics.median(r for _, r in runs), 1),
                }
                for side, runs in seen.items()
            }
            row["relayed_over_direct"] = round(
                row["relayed"]["ms_per_request"] / row["direct"]["ms_per_request"], 2
            )
            results[str(size)] = row
        failures = {}
        for side in ("direct", "relayed"):
            caller.routes = {target: [relay]} if side == "relayed" else {}
            failures[side] = await _failures(caller_p2p, target, 1 << 20, args.stress)
        return {
            "sizes": results,
            "failures": failures,
            "conditions": {
                "requests": args.requests,
                "repeats": args.repeats,
                "cores": os.cpu_count(),
                "loop": "caller, relay and target in one process and event loop, 127.0.0.1",
            },
        }
    finally:
        for p in peers:
            with contextlib.suppress(Exception):  # a daemon already gone
                await asyncio.wait_for(p.shutdown(), 15)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[16 << 10, 128 << 10, 1 << 20, 4 << 20],
        help="request (and answer) bytes, comma-separated",
    )
    p.add_argument("--requests", type=int, default=30, help="requests per side and repeat")
    p.add_argument("--repeats", type=int, default=3, help="direct/relayed pairs per size")
    p.add_argument(
        "--stress", type=int, default=400, help="then this many 1 MiB requests per side, counted"
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = asyncio.run(run(args))
    if args.json:
        print(json.dumps(result))
    else:
        for size, row in result["sizes"].items():
            print(
                f"{int(size) >> 10:>6} KiB  direct {row['direct']['ms_per_request']:8.2f} ms "
                f"{row['direct']['mb_per_s']:7.1f} MB/s   relayed "
                f"{row['relayed']['ms_per_request']:8.2f} ms {row['relayed']['mb_per_s']:7.1f} MB/s"
                f"   x{row['relayed_over_direct']}"
            )
        print(f"failed requests of 1 MiB: {result['failures']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
