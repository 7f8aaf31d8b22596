"""Routing by round trip against routing by latency alone: a discrete-event simulation.

    python bench/routing.py --json

A head keeps `--in-flight` micro-batches out (closed loop: one completes, the next
goes) to the replicas of the next stage. Each replica serves one micro-batch at a time
in arrival order for its service time (its compute and everything downstream of it);
a micro-batch reaches it half a round trip after it is sent and its answer comes back
half a round trip after it is served. The head chooses with the daemons' own
`comms.routing.Router`: once with the round trips it would measure (SWIM's least probe
time, here the link's round trip plus `--probe-overhead-ms`), once blind (no round trip:
the rule before 2026-12-03, which charged each measured latency per micro-batch ahead).

Reported per scenario and in-flight count: micro-batches per second and the mean
latency each rule reached over `--seconds` of simulated time after a warm-up, and
an upper bound (the lesser of the replicas' summed service rates and
in-flight / the best round trip plus service). The simulation is deterministic (seeded
ties), so one run per cell is the answer; it measures the policy, not the daemons.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
from dataclasses import dataclass

from agora_node.comms.routing import Router, RouterConfig

TOKENS = 2048


@dataclass(frozen=True)
class Replica:
    name: str
    rtt_s: float
    service_s: float


SCENARIOS: dict[str, list[Replica]] = {
    "near slow, far fast": [Replica("near", 0.005, 0.100), Replica("far", 0.100, 0.050)],
    "equal compute, one far": [Replica("near", 0.005, 0.080), Replica("far", 0.100, 0.080)],
    "equal compute, equal links": [Replica("a", 0.050, 0.080), Replica("b", 0.050, 0.080)],
    "three: near slow, two far fast": [
        Replica("near", 0.005, 0.120),
        Replica("far1", 0.080, 0.060),
        Replica("far2", 0.150, 0.060),
    ],
}


def simulate(
    replicas: list[Replica], in_flight: int, *, by_rtt: bool, seconds: float, overhead_s: float
) -> dict:
    measured_rtt = {r.name: r.rtt_s + overhead_s for r in replicas}
    router = Router(
        RouterConfig(tokens_per_item=TOKENS),
        random.Random(0),
        rtt_of=measured_rtt.get if by_rtt else None,
    )
    spec = {r.name: r for r in replicas}
    free_at = dict.fromkeys(spec, 0.0)  # when each replica's server is next idle
    events: list[tuple[float, int, str, float]] = []  # (answer time, seq, peer, sent at)
    seq = 0
    warmup = seconds / 5
    done, latencies, by_peer = 0, [], dict.fromkeys(spec, 0)

    def send(now: float) -> None:
        nonlocal seq
        peer = router.choose(list(spec), now)
        router.on_sent(peer, now)
        r = spec[peer]
        start = max(now + r.rtt_s / 2, free_at[peer])
        free_at[peer] = start + r.service_s
        seq += 1
        heapq.heappush(events, (free_at[peer] + r.rtt_s / 2, seq, peer, now))

    for _ in range(in_flight):
        send(0.0)
    while events:
        now, _, peer, sent = heapq.heappop(events)
        if now > warmup + seconds:
            break
        router.on_success(peer, now - sent, now)
        if now > warmup:
            done += 1
            latencies.append(now - sent)
            by_peer[peer] += 1
        send(now)
    rate_bound = sum(1 / r.service_s for r in replicas)
    best = min(r.rtt_s + r.service_s for r in replicas)
    return {
        "per_s": round(done / seconds, 2),
        "mean_latency_ms": round(1000 * statistics.fmean(latencies), 1),
        "share": {p: round(n / max(done, 1), 3) for p, n in by_peer.items()},
        "bound_per_s": round(min(rate_bound, in_flight / best), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--in-flight", default="2,4,8")
    parser.add_argument("--seconds", type=float, default=600.0, help="simulated, per cell")
    parser.add_argument(
        "--probe-overhead-ms",
        type=float,
        default=2.0,
        help="what both ends' event loops add to a probe's round trip",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for name, replicas in SCENARIOS.items():
        for k in (int(x) for x in args.in_flight.split(",")):
            cell = {"scenario": name, "in_flight": k}
            for rule, by_rtt in (("rtt", True), ("blind", False)):
                cell[rule] = simulate(
                    replicas,
                    k,
                    by_rtt=by_rtt,
                    seconds=args.seconds,
                    overhead_s=args.probe_overhead_ms / 1000,
                )
            cell["rtt_over_blind"] = round(cell["rtt"]["per_s"] / cell["blind"]["per_s"], 3)
            rows.append(cell)
            if not args.json:
                print(
                    f"{name:34s} in flight {k}: rtt {cell['rtt']['per_s']:6.2f}/s "
                    f"({cell['rtt']['mean_latency_ms']:6.1f} ms)  blind {cell['blind']['per_s']:6.2f}/s "
                    f"({cell['blind']['mean_latency_ms']:6.1f} ms)  bound {cell['rtt']['bound_per_s']:6.2f}/s"
                )
    if args.json:
        conditions = {"seconds": args.seconds, "probe_overhead_ms": args.probe_overhead_ms}
        print(json.dumps({"cells": rows, "conditions": conditions}))


if __name__ == "__main__":
    main()
