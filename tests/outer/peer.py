"""One stage replica as a real hivemind peer, driven by the integration tests.

    python tests/outer/peer.py --rounds 2 [--initial-peer MADDR] [--scale 1000]
                               [--stall-round 1] [--equivocate] [--out DIR] ...

Prints `ready` (with its multiaddrs), waits for `go` on stdin, then plays rounds:
begin_round, a deterministic stand-in for H inner steps, end_round; prints one
`round` event per round and saves its pre-mix delta and mixed delta to --out.
With --stall-round r it freezes inside round r's blocking mix right after its
first part is delivered and prints `pushed`: the test SIGKILLs it there. With
--hold-round r it waits for `release` on stdin before round r's blocking mix. After the
last round it keeps serving until stdin closes, so slower peers can still fetch.
Before `go`, `route PEER RELAY` lines send every request to PEER through RELAY, a relay
of ours (comms/relay.py), which every peer offers; `round` events carry `relay`, the
peer's relaying status.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from agora_node.comms import streams  # noqa: E402
from agora_node.comms.collective import (  # noqa: E402
    Aggregation,
    AggregationSpec,
    Deadlines,
    MatchmakingConfig,
)
from agora_node.comms.relay import Relaying  # noqa: E402
from agora_node.node.outer import OuterLoop  # noqa: E402
from agora_node.node.outer_state import OuterConfig  # noqa: E402
from agora_node.protocol.identity import Identity  # noqa: E402
from agora_node.stages.manifest_files import load_manifest  # noqa: E402
from agora_node.stages.model import Stage  # noqa: E402
from tests.outer.harness import (  # noqa: E402
    Equivocating,
    FreezeAfterFirstPush,
    die_with_parent,
    emit,
    start_local_host,
)


def inner_steps(
    loop: OuterLoop, seed: int, round_no: int, scale: float, steady: bool = False
) -> None:
    """Like training: a step shared by every replica (seeded by the round, or the same
    every round if `steady`) plus its own noise; `scale` -1 is a sign-flipped replica,
    1000 a scaled one."""
    shared = torch.Generator().manual_seed(10**6 + (0 if steady else round_no))
    own = torch.Generator().manual_seed(1000 * seed + round_no)
    with torch.no_grad():
        for p in loop.state.params:
            step = torch.randn(p.shape, generator=shared) + torch.randn(p.shape, generator=own)
            p.add_(scale * 1e-3 * step)


async def main(args: argparse.Namespace) -> None:
    die_with_parent()
    identity = Identity.generate()
    host = await start_local_host(identity, args.initial_peer)
    manifest = load_manifest("tiny")
    stage = Stage(manifest, 1)
    config = OuterConfig.from_manifest(
        manifest,
        group_size=args.group_size,
        codec=args.codec,
        aggregation=AggregationSpec(method=Aggregation(args.aggregation)),
        deadlines=Deadlines(base=args.base_timeout),
        # all replicas are told to start together; `expect` closes the round early
        matchmaking=MatchmakingConfig(window=10.0, settle=0.5, poll_interval=0.1),
    )
    loop = await OuterLoop.create(host.dht, stage, identity, manifest, p2p=host.p2p, config=config)
    relaying = Relaying(identity, manifest.run_id)
    await relaying.serve(host.p2p, refuse=None)
    streams.set_route(host.p2p, relaying)
    emit("ready", peer=identity.peer_id, maddrs=await host.visible_maddrs())
    stdin = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin
    )
    while (line := (await stdin.readline()).decode().split()) and line[0] == "route":
        relaying.routes[line[1]] = [line[2]]  # until "go"
    replayed = torch.zeros(0)
    for r in range(args.rounds):
        await loop.begin_round(expect=args.expect)
        inner_steps(loop, seed=args.seed, round_no=r, scale=args.scale, steady=args.steady)
        if r == args.stall_round:
            loop.transport = FreezeAfterFirstPush(loop.transport)
        if args.equivocate and r == 0:
            loop.transport = Equivocating(loop.transport, identity)
        if r == args.hold_round:
            await stdin.readline()  # "release": lets a stalling peer enter the mix first
        if args.replay:  # every round sends round 0's delta again
            replayed = loop.state.pseudo_gradient() if r == 0 else replayed
            loop.state.load_weights(loop.state.anchor - replayed)
        delta = loop.state.pseudo_gradient()
        momentum = loop.state.momentum.clone()
        report = await loop.end_round(tokens=1000)
        mixed = loop.state.momentum - config.momentum * momentum  # m' = mu m + mixed delta
        if args.out:
            torch.save(
                {"delta": delta, "mixed": mixed}, Path(args.out) / f"{identity.peer_id}-{r}.pt"
            )
        weights = loop.state.weights()
        emit(
            "round",
            round=r,
            peer=identity.peer_id,
            digest=loop.state.digest(),
            finite=bool(torch.isfinite(weights).all()),
            consistent=report.consistent,
            blocked=report.seconds_blocked,
            deadline=report.deadline,
            group=len(report.delta_group),
            failed=len(report.failed_peers),
            clip_radius=report.clip_radius,
            rejected=report.rejected,
            repaired=report.repaired_spans,
            checked=report.checked_spans,
            unchecked=report.unchecked_spans,
            late=report.late_spans,
            mismatched=report.mismatched,
            mismatch_witnesses=report.mismatch_witnesses,
            equivocated=report.equivocated,
            outliers=report.outliers,
            direction_outliers=report.direction_outliers,
            replayed=report.replayed,
            excluded=report.excluded,
            ignored=report.ignored,
            banned=sorted(loop.suspects.banned()),
            relay=relaying.status(),
        )
    emit("done")
    await stdin.read()  # serve until the test closes stdin or kills us


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--initial-peer", action="append", default=[])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--expect", type=int, default=3)
    p.add_argument("--group-size", type=int, default=0)
    p.add_argument("--codec", default="int8")
    p.add_argument("--aggregation", default="mean")
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--replay", action="store_true", help="send round 0's delta every round")
    p.add_argument(
        "--equivocate", action="store_true", help="send owners other parts than witnesses"
    )
    p.add_argument("--steady", action="store_true", help="one shared direction every round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stall-round", type=int, default=-1)
    p.add_argument("--hold-round", type=int, default=-1)
    p.add_argument("--base-timeout", type=float, default=2.0)
    p.add_argument("--out", default="")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse(sys.argv[1:])))
