"""Swarm throughput against one process, alternated in one invocation (A B A B ...).

    python bench/swarm.py --manifest tiny --seconds 60 --repeats 2 --json
    python bench/swarm.py --manifest tiny --seconds 60 --bandwidth-mbit 100 --latency-ms 50 --json
    sudo python bench/swarm.py --manifest tiny --seconds 60 --lab 100,100,50 --json

Each repeat runs, on the same cores one after the other:

A. the reference: LocalTrainer, every stage chained in one process (bench/reference.py,
   in a child process), `--threads` torch threads, for `--seconds` of training-step time;
   with `--reference-copies N`, N such processes at once (tokens and CPU summed): one per
   stage gives both sides as many compute threads on the same cores;
B. the swarm: a bootstrap and one daemon per stage on 127.0.0.1, `--threads` torch
   threads in all (split over the daemons, at least 1 each), measured over `--seconds`
   once every node is active and the first micro-batches completed; started afresh.

Reported per side as the median over repeats (every repeat's figures are in `runs`):

- tokens per wall-second: the reference's over its steps; the swarm's = micro-batches the
  head completed in the window x tokens per micro-batch, over the window;
- tokens per compute-second: tokens over the CPU seconds the side consumed (every thread
  of the reference process during its steps; every process of every daemon during the
  window, its libp2p daemon included; the bootstrap's CPU is reported apart and not
  counted, as it is no volunteer's stage work). `efficiency_per_compute_s` is the
  swarm's over the reference's, `efficiency` the same for wall-seconds. The swarm's CPU
  is also given by part (`cpu_seconds_by_part`): the stage workers' compute threads, the
  rest of the daemon processes, their other processes (`helpers`: the DHT process and the
  reaper), their libp2p daemons; every process a daemon started counts (bench/procs.py);
- wire bytes: what the daemons' pipeline streams wrote (frames incl. headers and token
  ids; libp2p framing/encryption and DHT traffic excluded), per token trained;
  dense_bf16_bytes_per_token is what the same boundaries would carry dense in bf16,
  both directions, + token ids;
- stage_utilization: each stage's compute time (wall time in its stage work) / window.

`conditions` says what the machine was doing: cores usable, load average before each
side, thread budget, versions. With --bandwidth-mbit/--latency-ms every daemon's uplink
is shaped in the transport layer (agora_node/comms/linkemu.py: serialization at that
rate plus one-way latency per message).

`--lab UP,DOWN,RTT` (root, `ip netns`: the network lab of tests/netlab.py) compares the
swarm with itself instead of with the reference: every process (the bootstrap and each
daemon) in a network namespace of its own on the lab's switch, A unshaped, B with each
host's uplink and downlink limited to UP and DOWN Mbit/s by the kernel's token bucket
(tc tbf) and RTT ms between any two hosts (this kernel has no netem: half of it is
added to every message a daemon sends, in the transport). `shaped_over_unshaped` is
B's tokens per second over A's; `left_behind` counts namespaces the lab did not delete.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import procs  # noqa: E402
import torch  # noqa: E402
from common import DaemonLab, control_status, exit_on_sigterm, parse_rates  # noqa: E402

from agora_node.compression import bytes_per_token  # noqa: E402
from agora_node.node.config import PipelineConfig  # noqa: E402
from agora_node.node.demo import Swarm, fetch_status, wait_for_line  # noqa: E402
from agora_node.stages.manifest_files import load_manifest  # noqa: E402

HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--manifest", default="tiny")
    p.add_argument("--seconds", type=float, default=60.0, help="measurement window of each side")
    p.add_argument("--repeats", type=int, default=2, help="A B pairs (default 2: A B A B)")
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
        "--threads",
        type=int,
        default=2,
        help="torch threads of each side: the reference's, and the daemons' in all (default 2)",
    )
    p.add_argument(
        "--activation-codec",
        default="",
        help="the daemons' --activation-codec (default: the daemon's own default)",
    )
    p.add_argument(
        "--reference-copies",
        type=int,
        default=1,
        help="reference processes run at once, `--threads` each (default 1); with one copy "
        "per daemon (stage), both sides put as many compute threads on the same cores, so "
        "per compute-second they pay the same for sharing them",
    )
    p.add_argument("--skip-reference", action="store_true", help="only the swarm side")
    p.add_argument(
        "--lab",
        default="",
        metavar="UP,DOWN,RTT",
        help="the swarm in network namespaces, unshaped against shaped (Mbit/s, Mbit/s, ms)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.repeats < 1 or args.threads < 1 or args.reference_copies < 1:
        p.error("--seconds, --repeats, --threads and --reference-copies must be positive")
    if args.lab:
        try:
            args.lab_link = parse_rates(args.lab, 3)
        except ValueError as exc:
            p.error(f"--lab {exc}")
        if args.bandwidth_mbit or args.latency_ms:
            p.error("--lab shapes the links itself: no --bandwidth-mbit/--latency-ms with it")
    return args


def tree_cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds (user + system) of the live process `root` (a daemon) and every process
    it started (procs.py: they run in sessions of their own), by part: `p2pd` (its libp2p
    daemon), `stage_worker` (the daemon's compute thread, named agora-stage* by
    node/worker.py), `daemon_other` (the rest of the daemon process: event loop, RPC,
    membership, finished threads), `helpers` (its other processes: the hivemind DHT
    process, the reaper). `by_program` folds them back to p2pd and python."""
    ticks: dict[str, int] = {}

    def count(part: str, n: int) -> None:
        ticks[part] = ticks.get(part, 0) + n

    for pid, proc in procs.tree([root]).items():
        if proc.comm == "p2pd":
            count("p2pd", proc.ticks)
        elif pid != root:
            count("helpers", proc.ticks)
        else:
            threads = procs.thread_ticks(pid)
            worker = sum(t.ticks for t in threads if t.comm.startswith("agora-stage"))
            count("stage_worker", worker)
            count("daemon_other", proc.ticks - worker)
    return {part: t / procs.TICKS for part, t in ticks.items()}


def by_program(parts: dict[str, float]) -> dict[str, float]:
    python = sum(v for k, v in parts.items() if k != "p2pd")
    return {"p2pd": parts.get("p2pd", 0.0), "python": python}


def _add(a: dict[str, float], b: dict[str, float], sign: float = 1.0) -> dict[str, float]:
    return {k: a.get(k, 0.0) + sign * b.get(k, 0.0) for k in a.keys() | b.keys()}


def conditions(args: argparse.Namespace) -> dict:
    return {
        "cores_usable": len(os.sched_getaffinity(0)),
        "cpu": platform.processor() or platform.machine(),
        "threads_per_side": args.threads,
        "reference_copies": args.reference_copies,
        "activation_codec": args.activation_codec or PipelineConfig().activation_codec,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "loadavg_1m_before": [],
    }


def run_reference(args: argparse.Namespace) -> dict:
    """The reference side: `--reference-copies` processes at once, their tokens and CPU
    seconds summed (each trains for `--seconds` of step time)."""
    argv = [sys.executable, str(HERE / "reference.py"), "--manifest", args.manifest]
    argv += ["--seconds", str(args.seconds), "--threads", str(args.threads), "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    copies = args.reference_copies
    refs = []
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(copies)]
        children: list[subprocess.Popen] = []
        stack.callback(_kill_all, children)  # first on the way out: before the logs close
        for log in logs:
            children.append(
                subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
            )
        for proc, log in zip(children, logs, strict=True):
            out, _ = proc.communicate()
            if proc.returncode != 0:
                log.seek(0)
                tail = log.read()[-2000:]
                raise RuntimeError(f"reference.py exited with {proc.returncode}:\n{tail}")
            refs.append(json.loads(out))
    tokens, cpu = sum(r["tokens"] for r in refs), sum(r["cpu_seconds"] for r in refs)
    return {
        "tokens_per_s": round(sum(r["tokens_per_s"] for r in refs), 1),
        "tokens_per_cpu_s": round(tokens / cpu, 1),
        "cpu_seconds": round(cpu, 2),
        "train_seconds": max(r["train_seconds"] for r in refs),
    }


def _kill_all(children: list[subprocess.Popen]) -> None:
    for proc in children:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _port(child) -> int:  # noqa: ANN001
    line = wait_for_line(child, "status page http://", 120)
    return int(line.rsplit(":", 1)[1].strip("/ \n"))


def _totals(statuses: list[dict], nodes: list) -> dict:
    head = next(s for s in statuses if s["stage"] == 0)
    return {
        "ok": head["microbatches"].get("ok", 0),
        "sent": sum(sum(s["bytes_sent"].values()) for s in statuses),
        "compute": {s["stage"]: s["compute_s"] for s in statuses},
        "cpu": functools.reduce(_add, (tree_cpu_seconds(n.proc.pid) for n in nodes), {}),
        "at": time.monotonic(),
    }


def status_of(child, port: int) -> dict | None:  # noqa: ANN001 - demo.Child
    """A daemon's status: from its status page, or in a network lab (where the page
    listens on the namespace's own 127.0.0.1) over its control socket, a Unix socket
    that any namespace reaches."""
    if not child.prefix:
        return fetch_status(port, timeout=5)
    return control_status(child)


def run_swarm(args: argparse.Namespace, workdir: Path, lab: DaemonLab | None = None) -> dict:
    manifest = load_manifest(args.manifest)
    stages = manifest.num_stages
    swarm = Swarm(workdir)

    def place(name: str) -> tuple[tuple[str, ...], list[str]]:
        return lab.command(lab.host(name)) if lab is not None else ((), [])

    prefix, listen = place("boot")
    boot = swarm.spawn(
        "bootstrap",
        ["bootstrap", "--manifest", args.manifest, "--data-dir", str(workdir / "b"), *listen],
        prefix=prefix,
    )
    peers = wait_for_line(boot, "--initial-peers", 60).split("--initial-peers", 1)[1].split()
    extra = ["--status-port", "0", "--eval-every", "100000", "--checkpoint-every", "100000"]
    extra += ["--max-in-flight", str(args.max_in_flight)]
    if args.activation_codec:
        extra += ["--activation-codec", args.activation_codec]
    if args.bandwidth_mbit:
        extra += ["--emulate-link", f"{args.bandwidth_mbit},{args.latency_ms}"]
    if lab is not None:
        extra += lab.daemon_args()
    try:
        nodes = []
        for s in range(stages):
            threads = max(1, args.threads // stages + (s < args.threads % stages))
            prefix, listen = place(f"n{s}")
            argv = ["join", "--initial-peers", *peers, "--stage", str(s), *listen]
            argv += ["--manifest", args.manifest]  # a head reads a corpus file only so
            argv += ["--data-dir", str(workdir / f"n{s}"), "--threads", str(threads), *extra]
            nodes.append(swarm.spawn(f"node-{s}", argv, prefix=prefix))
        ports = [_port(n) for n in nodes]

        def statuses() -> list[dict]:
            return [status_of(n, p) for n, p in zip(nodes, ports, strict=True)]

        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # warm-up: all active and micro-batches flowing
            current = statuses()
            active = all(s and s["state"] == "active" for s in current)
            if active and _totals(current, nodes)["ok"] >= 4:
                break
            time.sleep(1)
        else:
            raise RuntimeError(f"swarm did not start; logs in {workdir}")
        boot_cpu = tree_cpu_seconds(boot.proc.pid)
        start = _totals(statuses(), nodes)
        time.sleep(args.seconds)  # the measurement window itself
        end = _totals(statuses(), nodes)
        boot_cpu = _add(tree_cpu_seconds(boot.proc.pid), boot_cpu, -1.0)
    finally:
        swarm.stop(grace_s=20)
    window = end["at"] - start["at"]
    tokens = (end["ok"] - start["ok"]) * manifest.inner.micro_batch * manifest.model.seq_len
    by_part = _add(end["cpu"], start["cpu"], -1.0)
    cpu = sum(by_part.values())
    return {
        "tokens_per_s": round(tokens / window, 1),
        "tokens_per_cpu_s": round(tokens / cpu, 1) if cpu > 0 else 0.0,
        "cpu_seconds": round(cpu, 1),
        "cpu_seconds_by_program": {k: round(v, 1) for k, v in by_program(by_part).items()},
        "cpu_seconds_by_part": {k: round(v, 1) for k, v in sorted(by_part.items())},
        "bootstrap_cpu_seconds": round(sum(boot_cpu.values()), 1),
        "wire_bytes_per_token": round((end["sent"] - start["sent"]) / max(tokens, 1), 1),
        "stage_utilization": [
            round((end["compute"][s] - start["compute"][s]) / window, 3) for s in range(stages)
        ],
        "window_s": round(window, 1),
        "tokens": tokens,
    }


def median(runs: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in runs), 1)


def lab_side(args: argparse.Namespace, shape: tuple[float, float, float] | None) -> dict:
    """One side of `--lab`: the swarm in a fresh lab, shaped or not; the lab deleted after."""
    lab = DaemonLab(shape)
    try:
        with tempfile.TemporaryDirectory(prefix="agora-bench-") as tmp:
            out = run_swarm(args, Path(tmp), lab)
    finally:
        out_left = lab.close()
    return {**out, "left_behind": out_left}


def main_lab(args: argparse.Namespace) -> dict:
    up, down, rtt = args.lab_link
    cond = conditions(args)
    sides: dict[str, list[dict]] = {"unshaped": [], "shaped": []}
    for i in range(args.repeats):  # A B A B on the same cores
        for name, shape in (("unshaped", None), ("shaped", args.lab_link)):
            cond["loadavg_1m_before"].append(round(os.getloadavg()[0], 2))
            sides[name].append(lab_side(args, shape))
            print(f"repeat {i + 1} {name}: {sides[name][-1]}", file=sys.stderr, flush=True)
    result: dict = {
        "manifest": args.manifest,
        "seconds": args.seconds,
        "repeats": args.repeats,
        "lab": {"up_mbit": up, "down_mbit": down, "rtt_ms": rtt},
    }
    for name, runs in sides.items():
        result[f"{name}_tokens_per_s"] = median(runs, "tokens_per_s")
        result[f"{name}_tokens_per_cpu_s"] = median(runs, "tokens_per_cpu_s")
        result[f"{name}_wire_bytes_per_token"] = median(runs, "wire_bytes_per_token")
    result["shaped_over_unshaped"] = round(
        result["shaped_tokens_per_s"] / result["unshaped_tokens_per_s"], 3
    )
    result["left_behind"] = sum(r["left_behind"] for runs in sides.values() for r in runs)
    result["runs"] = sides
    result["conditions"] = cond
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.lab:
        result = main_lab(args)
        print(json.dumps(result) if args.json else json.dumps(result, indent=2))
        return 0
    manifest = load_manifest(args.manifest)
    result: dict = {"manifest": args.manifest, "seconds": args.seconds, "repeats": args.repeats}
    if args.bandwidth_mbit:
        result["link"] = {"bandwidth_mbit": args.bandwidth_mbit, "latency_ms": args.latency_ms}
    cond = conditions(args)
    refs: list[dict] = []
    swarms: list[dict] = []
    for i in range(args.repeats):
        if not args.skip_reference:
            cond["loadavg_1m_before"].append(round(os.getloadavg()[0], 2))
            refs.append(run_reference(args))
            print(f"repeat {i + 1} reference: {refs[-1]}", file=sys.stderr, flush=True)
        cond["loadavg_1m_before"].append(round(os.getloadavg()[0], 2))
        with tempfile.TemporaryDirectory(prefix="agora-bench-") as tmp:
            swarms.append(run_swarm(args, Path(tmp)))
        print(f"repeat {i + 1} swarm: {swarms[-1]}", file=sys.stderr, flush=True)
    boundaries = manifest.num_stages - 1
    dense = 2 * boundaries * (bytes_per_token("bf16", manifest.model.d_model) + 2)
    result.update(
        {
            "swarm_tokens_per_s": median(swarms, "tokens_per_s"),
            "swarm_tokens_per_cpu_s": median(swarms, "tokens_per_cpu_s"),
            "wire_bytes_per_token": median(swarms, "wire_bytes_per_token"),
            "dense_bf16_bytes_per_token": round(dense, 1),
            "stage_utilization": [
                round(statistics.median(u), 3)
                for u in zip(*(r["stage_utilization"] for r in swarms), strict=True)
            ],
            "swarm_window_s": median(swarms, "window_s"),
            "swarm_tokens": int(statistics.median(r["tokens"] for r in swarms)),
        }
    )
    if refs:
        result["reference_tokens_per_s"] = median(refs, "tokens_per_s")
        result["reference_tokens_per_cpu_s"] = median(refs, "tokens_per_cpu_s")
        result["efficiency"] = round(
            result["swarm_tokens_per_s"] / result["reference_tokens_per_s"], 3
        )
        result["efficiency_per_compute_s"] = round(
            result["swarm_tokens_per_cpu_s"] / result["reference_tokens_per_cpu_s"], 3
        )
    result["runs"] = {"reference": refs, "swarm": swarms}
    result["conditions"] = cond
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>28}: {value}")
    return 0


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main())
