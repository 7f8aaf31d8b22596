"""Simulate SWIM + Lifeguard membership at scale and report detection and cost.

    python bench/membership_sim.py --nodes 1000 --loss 0.05 --rtt-ms 100 --seconds 600 --json

Runs the real state machine (agora_node.comms.membership.swim) for every member
inside one discrete-event simulation (agora_node.comms.membership.simnet) with
null signatures (64 real bytes on the wire, no CPU spent on Ed25519). Members
crash at random times; for each crash we measure the time until every surviving
member has it marked dead (detect_*) and until the first one declares it
(first_detect_*). A false positive is a live member declared dead by anyone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agora_node.comms.membership.messages import Status  # noqa: E402
from agora_node.comms.membership.settings import MembershipSettings  # noqa: E402
from agora_node.comms.membership.simnet import LinkModel, SimNetwork  # noqa: E402

PRESETS = {"agora": MembershipSettings, "memberlist-lan": MembershipSettings.memberlist_lan}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=600.0, help="simulated seconds")
    p.add_argument("--loss", type=float, default=0.05, help="per-message loss probability")
    p.add_argument("--rtt-ms", type=float, default=100.0)
    p.add_argument("--jitter-ms", type=float, default=20.0, help="mean extra round-trip delay")
    p.add_argument("--latency-dist", choices=("exponential", "normal"), default="exponential")
    p.add_argument("--crashes", type=int, default=None, help="default: max(10, nodes // 20)")
    p.add_argument("--leaves", type=int, default=0, help="graceful leaves at random times")
    p.add_argument("--slow", type=int, default=0, help="members that handle everything late")
    p.add_argument("--slow-ms", type=float, default=1000.0, help="max extra delay of slow members")
    p.add_argument("--partition-frac", type=float, default=0.0, help="fraction cut off")
    p.add_argument("--partition-at", type=float, default=60.0)
    p.add_argument("--partition-for", type=float, default=30.0)
    p.add_argument("--preset", choices=sorted(PRESETS), default="agora")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, math.ceil(q / 100 * len(ordered)) - 1)
    return round(ordered[rank], 3)


class Recorder:
    """Turns membership events into detection times and false positives."""

    def __init__(self) -> None:
        self.crash_at: dict[str, float] = {}
        self.leave_at: dict[str, float] = {}
        self.dead_seen: dict[str, dict[str, float]] = {}
        self.left_seen: dict[str, dict[str, float]] = {}
        self.false_dead: set[tuple[str, int]] = set()
        self.false_suspect: set[tuple[str, int]] = set()
        self.partition_dead = 0
        self.leavers_declared_dead = 0
        self.cut: tuple[float, float, list[int], dict[str, int]] | None = None

    def __call__(self, observer: str, view, now: float) -> None:
        subject, status = view.peer_id, view.status
        crashed = subject in self.crash_at and self.crash_at[subject] <= now
        if status == Status.DEAD:
            if crashed:
                self.dead_seen.setdefault(subject, {}).setdefault(observer, now)
            elif subject in self.leave_at:
                self.leavers_declared_dead += 1
            elif self._across_cut(observer, subject, now):
                self.partition_dead += 1
            else:
                self.false_dead.add((subject, view.incarnation))
        elif status == Status.LEFT:
            self.left_seen.setdefault(subject, {}).setdefault(observer, now)
        elif status == Status.SUSPECT and not crashed and subject not in self.leave_at:
            self.false_suspect.add((subject, view.incarnation))

    def _across_cut(self, observer: str, subject: str, now: float) -> bool:
        if self.cut is None:
            return False
        start, end, _, group = self.cut
        return start <= now and group.get(observer, 0) != group.get(subject, 0)


def schedule_faults(net: SimNetwork, args: argparse.Namespace, rec: Recorder) -> None:
    rng = random.Random(args.seed + 1)
    crashes = args.crashes if args.crashes is not None else max(10, args.nodes // 20)
    victims = rng.sample(net.ids, crashes + args.leaves + args.slow)
    lo, hi = 0.1 * args.seconds, max(0.1 * args.seconds, args.seconds - 45.0)
    for peer in victims[:crashes]:
        when = rng.uniform(lo, hi)
        rec.crash_at[peer] = when
        net.at(when, lambda p=peer: net.crash(p))
    for peer in victims[crashes : crashes + args.leaves]:
        when = rng.uniform(lo, hi)
        rec.leave_at[peer] = when
        net.at(when, lambda p=peer: net.node(p).leave(net.now))
        net.at(when + 2.0, lambda p=peer: net.crash(p))  # gone after a short linger
    for peer in victims[crashes + args.leaves :]:
        net.set_slow(peer, args.slow_ms / 1000)
    if args.partition_frac > 0:
        cut = [p for p in net.ids if p not in victims][: int(args.nodes * args.partition_frac)]
        start, end = args.partition_at, args.partition_at + args.partition_for
        rec.cut = (start, end, [], {p: 1 for p in cut})
        net.at(start, lambda: net.partition([cut]))
        net.at(end, net.heal)


def converged(net: SimNetwork) -> bool:
    live = [j for j, node in enumerate(net.nodes) if not net.crashed[j] and not node.leaving]
    want = len(live)
    for j in live:
        node = net.nodes[j]
        if node.cluster_size() != want:
            return False
    return True


def measure_heal(net: SimNetwork, args: argparse.Namespace, t_end: float) -> float | None:
    heal_at = args.partition_at + args.partition_for
    net.run_until(heal_at)
    while net.now < t_end:
        net.run_until(net.now + 1.0)
        if converged(net):
            return round(net.now - heal_at, 1)
    return None


def summarize(net: SimNetwork, rec: Recorder, args: argparse.Namespace, wall: float) -> dict:
    end = args.seconds
    alive_end = {p for j, p in enumerate(net.ids) if not net.crashed[j]}
    healthy = {p for j, p in enumerate(net.ids) if p in alive_end and not net.slow[j]}
    all_know, healthy_know, first, undetected = [], [], [], 0
    for peer, at in rec.crash_at.items():
        seen = rec.dead_seen.get(peer, {})
        missing = [o for o in alive_end if o != peer and o not in seen]
        if seen:
            first.append(min(seen.values()) - at)
        if missing or not seen:
            undetected += 1
        else:
            all_know.append(max(t for o, t in seen.items() if o in alive_end) - at)
            healthy_know.append(max(t for o, t in seen.items() if o in healthy) - at)
    leave_times = [
        max(t for o, t in rec.left_seen[p].items() if o in alive_end) - at
        for p, at in rec.leave_at.items()
        if p in rec.left_seen and all(o in rec.left_seen[p] for o in alive_end if o != p)
    ]
    node_seconds = sum(rec.crash_at.get(p, rec.leave_at.get(p, end)) for p in net.ids)
    sent = sum(node.counters["sent"] for node in net.nodes)
    sent_bytes = sum(node.counters["sent_bytes"] for node in net.nodes)
    settings = dataclasses.asdict(net.settings)
    low, high = net.settings.suspicion_bounds(args.nodes)
    settings.update(
        preset=args.preset,
        suspicion_min_s=round(low, 3),
        suspicion_max_s=round(high, 3),
        retransmit_limit=net.settings.retransmit_limit(args.nodes),
        push_pull_period_s=net.settings.push_pull_period(args.nodes),
    )
    return {
        "nodes": args.nodes,
        "seconds": args.seconds,
        "loss": args.loss,
        "rtt_ms": args.rtt_ms,
        "jitter_ms": args.jitter_ms,
        "crashes": len(rec.crash_at),
        "detect_p50_s": percentile(all_know, 50),
        "detect_p99_s": percentile(all_know, 99),
        "detect_max_s": percentile(all_know, 100),
        # with slow members: the same, leaving out the slow (overloaded) observers
        "detect_healthy_p99_s": percentile(healthy_know, 99) if args.slow else None,
        "first_detect_p50_s": percentile(first, 50),
        "first_detect_p99_s": percentile(first, 99),
        "undetected": undetected,
        "false_positives": len(rec.false_dead),
        "false_suspicions": len(rec.false_suspect),
        "leaves": len(rec.leave_at),
        "leave_seen_p99_s": percentile(leave_times, 99),
        "leavers_declared_dead": rec.leavers_declared_dead,
        "msgs_per_node_per_s": round(sent / node_seconds, 2),
        "bytes_per_node_per_s": round(sent_bytes / node_seconds, 1),
        "wall_s": round(wall, 1),
        "settings": settings,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = PRESETS[args.preset]()
    link = LinkModel(
        rtt_s=args.rtt_ms / 1000,
        jitter_s=args.jitter_ms / 1000,
        loss=args.loss,
        distribution=args.latency_dist,
    )
    rec = Recorder()
    started = time.perf_counter()
    net = SimNetwork(settings=settings, link=link, seed=args.seed, on_event=rec, keep_events=False)
    net.add_converged(args.nodes)
    schedule_faults(net, args, rec)
    heal_s = None
    if args.partition_frac > 0:
        heal_s = measure_heal(net, args, args.seconds)
    net.run_until(args.seconds)
    result = summarize(net, rec, args, time.perf_counter() - started)
    if args.partition_frac > 0:
        result.update(
            partition_frac=args.partition_frac,
            partition_dead_declarations=rec.partition_dead,
            heal_converged_s=heal_s,
        )
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>28}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
