"""Daemon timings on loopback: join -> active, and how fast a SIGKILLed node vanishes.

    python bench/daemon_timings.py --manifest tiny --nodes 4 --json

Starts a bootstrap and N daemons with --stage auto at once (1 torch thread each),
then measures per node the wall time from process start until its status says
"active"; then SIGKILLs one node and measures, over all survivors, the time
until SWIM declares it dead and until its record leaves their directory view
(--record-ttl 6, --refresh 1, as in the integration tests; production default
TTL is 15 s). Polls status endpoints every 0.1 s.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agora_node.node.demo import Swarm, fetch_status, wait_for_line  # noqa: E402


def peers(port: int) -> set[str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/peers", timeout=2) as r:
            return {p["peer_id"] for s in json.loads(r.read())["stages"] for p in s["peers"]}
    except OSError:
        return set()


def dead_in_membership(status: dict | None, victim: str) -> bool:
    view = (status or {}).get("members", {}).get("view", [])
    return any(m["peer_id"] == victim and m["status"] == "dead" for m in view)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--manifest", default="tiny")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    fast = ["--record-ttl", "6", "--refresh", "1", "--threads", "1", "--status-port", "0"]
    with tempfile.TemporaryDirectory(prefix="agora-timings-") as tmp:
        swarm = Swarm(Path(tmp))
        try:
            boot = swarm.spawn(
                "bootstrap", ["bootstrap", "--manifest", args.manifest, "--data-dir", f"{tmp}/b"]
            )
            initial = (
                wait_for_line(boot, "--initial-peers", 60).split("--initial-peers", 1)[1].split()
            )
            started = time.monotonic()
            nodes = [
                swarm.spawn(
                    f"n{i}",
                    ["join", "--initial-peers", *initial, "--data-dir", f"{tmp}/n{i}", *fast]
                    + ["--manifest", args.manifest],  # a head reads a corpus file only so
                )
                for i in range(args.nodes)
            ]
            ports = [
                int(wait_for_line(n, "status page", 120).rsplit(":", 1)[1].strip("/ \n"))
                for n in nodes
            ]
            active_after: dict[int, float] = {}
            while len(active_after) < len(nodes) and time.monotonic() - started < 180:
                for i, port in enumerate(ports):
                    s = fetch_status(port)
                    if i not in active_after and s and s["state"] == "active":
                        active_after[i] = time.monotonic() - started
                time.sleep(0.1)
            victim_id = fetch_status(ports[1])["peer_id"]
            time.sleep(8)  # let membership settle after the joins before the crash
            nodes[1].proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            survivors = [port for i, port in enumerate(ports) if i != 1]
            dead_at: dict[int, float] = {}
            gone_at: dict[int, float] = {}
            while (
                len(dead_at) < len(survivors) or len(gone_at) < len(survivors)
            ) and time.monotonic() - killed < 60:
                for port in survivors:
                    if port not in dead_at and dead_in_membership(fetch_status(port), victim_id):
                        dead_at[port] = time.monotonic() - killed
                    if port not in gone_at and victim_id not in peers(port):
                        gone_at[port] = time.monotonic() - killed
                time.sleep(0.1)
        finally:
            swarm.stop(grace_s=15)
    result = {
        "nodes": args.nodes,
        "join_to_active_s": {
            "median": round(statistics.median(active_after.values()), 1),
            "max": round(max(active_after.values()), 1),
        },
        "sigkill_declared_dead_s": {
            "median": round(statistics.median(dead_at.values()), 2),
            "max": round(max(dead_at.values()), 2),
        }
        if dead_at
        else None,
        "sigkill_record_gone_s": {
            "median": round(statistics.median(gone_at.values()), 2),
            "max": round(max(gone_at.values()), 2),
        }
        if gone_at
        else None,
        "record_ttl_s": 6,
    }
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
