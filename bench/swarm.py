"""Swarm throughput against one process, on the same machine, in one invocation.

    python bench/swarm.py --manifest tiny --seconds 120 --json
    python bench/swarm.py --manifest tiny --seconds 120 --bandwidth-mbit 100 --latency-ms 50 --json

1. The reference: LocalTrainer, all stages in one process (bench/reference.py),
   for `--seconds` of training-step time, 2 torch threads.
2. The swarm: a bootstrap and one daemon per stage on 127.0.0.1 (1 torch thread
   each, same 2 cores), measured over `--seconds` after every node is active and
   the first micro-batches completed. Tokens trained = micro-batches the head
   completed x tokens per micro-batch; wire bytes = what the daemons' pipeline
   streams actually wrote (frames incl. headers and token ids; libp2p's own
   framing/encryption and DHT traffic excluded), divided by tokens trained.
   dense_bf16_bytes_per_token is what the same boundaries would carry dense in
   bf16 (measured from a real encoding), both directions, + token ids.
   stage_utilization: each node's compute time / window.
With --bandwidth-mbit/--latency-ms every daemon's uplink is shaped in the
transport layer (agora_node/comms/linkemu.py: serialization at that rate plus
one-way latency per message).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reference import run as run_reference  # noqa: E402

from agora_node.compression import bytes_per_token  # noqa: E402
from agora_node.node.demo import Swarm, fetch_status, wait_for_line  # noqa: E402
from agora_node.stages.manifest_files import load_manifest  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--manifest", default="tiny")
    p.add_argument("--seconds", type=float, default=120.0, help="measurement window of each side")
    p.add_argument(
        "--bandwidth-mbit", type=float, default=0.0, help="emulated uplink per node (0: off)"
    )
    p.add_argument(
        "--latency-ms", type=float, default=0.0, help="emulated one-way latency per message"
    )
    p.add_argument(
        "--max-in-flight", type=int, default=0, help="head's micro-batches in flight (0: auto)"
    )
    p.add_argument(
        "--threads", type=int, default=2, help="reference trainer's torch threads (default 2)"
    )
    p.add_argument("--skip-reference", action="store_true", help="only the swarm side")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def _port(child) -> int:  # noqa: ANN001
    line = wait_for_line(child, "status page http://", 120)
    return int(line.rsplit(":", 1)[1].strip("/ \n"))


def _totals(statuses: list[dict]) -> dict:
    head = next(s for s in statuses if s["stage"] == 0)
    return {
        "ok": head["microbatches"].get("ok", 0),
        "sent": sum(sum(s["bytes_sent"].values()) for s in statuses),
        "compute": {s["stage"]: s["compute_s"] for s in statuses},
        "at": time.monotonic(),
    }


def run_swarm(args: argparse.Namespace, workdir: Path) -> dict:
    manifest = load_manifest(args.manifest)
    swarm = Swarm(workdir)
    boot = swarm.spawn(
        "bootstrap", ["bootstrap", "--manifest", args.manifest, "--data-dir", str(workdir / "b")]
    )
    peers = wait_for_line(boot, "--initial-peers", 60).split("--initial-peers", 1)[1].split()
    extra = [
        "--threads",
        "1",
        "--status-port",
        "0",
        "--eval-every",
        "100000",
        "--checkpoint-every",
        "100000",
    ]
    extra += ["--max-in-flight", str(args.max_in_flight)]
    if args.bandwidth_mbit:
        extra += ["--emulate-link", f"{args.bandwidth_mbit},{args.latency_ms}"]
    try:
        nodes = []
        for s in range(manifest.num_stages):
            argv = [
                "join",
                "--initial-peers",
                *peers,
                "--stage",
                str(s),
                "--data-dir",
                str(workdir / f"n{s}"),
                *extra,
            ]
            nodes.append(swarm.spawn(f"node-{s}", argv))
        ports = [_port(n) for n in nodes]

        def statuses() -> list[dict]:
            return [fetch_status(p, timeout=5) for p in ports]

        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # warm-up: all active and micro-batches flowing
            current = statuses()
            if all(s and s["state"] == "active" for s in current) and _totals(current)["ok"] >= 4:
                break
            time.sleep(1)
        else:
            raise RuntimeError(f"swarm did not start; logs in {workdir}")
        start = _totals(statuses())
        time.sleep(args.seconds)  # the measurement window itself
        end = _totals(statuses())
    finally:
        swarm.stop(grace_s=20)
    window = end["at"] - start["at"]
    tokens = (end["ok"] - start["ok"]) * manifest.inner.micro_batch * manifest.model.seq_len
    boundaries = manifest.num_stages - 1
    dense = 2 * boundaries * (bytes_per_token("bf16", manifest.model.d_model) + 2)
    return {
        "swarm_tokens_per_s": round(tokens / window, 1),
        "wire_bytes_per_token": round((end["sent"] - start["sent"]) / max(tokens, 1), 1),
        "dense_bf16_bytes_per_token": round(dense, 1),
        "stage_utilization": [
            round((end["compute"][s] - start["compute"][s]) / window, 3)
            for s in range(manifest.num_stages)
        ],
        "swarm_window_s": round(window, 1),
        "swarm_tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict = {"manifest": args.manifest, "seconds": args.seconds}
    if args.bandwidth_mbit:
        result["link"] = {"bandwidth_mbit": args.bandwidth_mbit, "latency_ms": args.latency_ms}
    if not args.skip_reference:
        ref = run_reference(args.manifest, args.seconds, args.threads)
        result["reference_tokens_per_s"] = ref["tokens_per_s"]
    with tempfile.TemporaryDirectory(prefix="agora-bench-") as tmp:
        result.update(run_swarm(args, Path(tmp)))
    if "reference_tokens_per_s" in result:
        result["efficiency"] = round(
            result["swarm_tokens_per_s"] / result["reference_tokens_per_s"], 3
        )
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>28}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
