"""`agora-node demo`: a whole swarm on 127.0.0.1, as child processes of this command.

It starts one bootstrap peer and N daemons with `--stage auto`, prints one
progress line per interval (swarm tokens/s, training loss, validation loss,
nodes by stage) and the dashboard URLs, and stops every child by its pid (and
process group) on exit or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from agora_node.node.errors import EXIT_FAILURE, EXIT_OK, UsageError
from agora_node.stages.manifest_files import load_manifest


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path
    status_port: int | None = None


@dataclass
class Swarm:
    workdir: Path
    children: list[Child] = field(default_factory=list)
    initial_peers: list[str] = field(default_factory=list)

    def spawn(
        self,
        name: str,
        argv: list[str],
        status_port: int | None = None,
        *,
        module: str = "agora_node",
        env: dict[str, str] | None = None,
    ) -> Child:
        """Start `python -m module argv...` (tests pass a test-only module and env)."""
        log_path = self.workdir / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *argv],
            stdout=open(log_path, "w"),  # noqa: SIM115 - owned by the child
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own group: hivemind's children die with it
            env=env,
        )
        child = Child(name, proc, log_path, status_port)
        self.children.append(child)
        return child

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM every child's main process (a clean leave: it stops its own helpers),
        then SIGKILL whatever is left of each process group."""
        for child in self.children:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for child in self.children:
            _signal_group(child.proc, signal.SIGKILL)
            child.proc.wait()


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def wait_for_line(child: Child, marker: str, timeout: float) -> str:
    """The first line of the child's log that contains `marker` (polled under a deadline)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise RuntimeError(
                f"{child.name} exited with code {child.proc.returncode}: see {child.log_path}"
            )
        for line in child.log_path.read_text(errors="replace").splitlines():
            if marker in line:
                return line
        time.sleep(0.2)
    raise RuntimeError(
        f"{child.name} did not print {marker!r} within {timeout:.0f}s: see {child.log_path}"
    )


def fetch_status(port: int, timeout: float = 1.0) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/status", timeout=timeout) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def start_swarm(
    manifest: str, nodes: int, workdir: Path, base_port: int, extra: list[str] = ()
) -> Swarm:
    swarm = Swarm(workdir)
    boot = swarm.spawn(
        "bootstrap", ["bootstrap", "--manifest", manifest, "--data-dir", str(workdir / "bootstrap")]
    )
    line = wait_for_line(boot, "agora-node join --initial-peers", 60)
    swarm.initial_peers = line.split("--initial-peers", 1)[1].split()
    for i in range(nodes):
        data_dir = workdir / f"node-{i}"
        argv = ["join", "--initial-peers", *swarm.initial_peers, "--data-dir", str(data_dir)]
        argv += ["--status-port", str(base_port + i), "--threads", "1", *extra]
        swarm.spawn(f"node-{i}", argv, status_port=base_port + i)
    return swarm


class Progress:
    """Aggregates the nodes' status into one line per interval."""

    def __init__(self) -> None:
        self.last_tokens: int | None = None
        self.last_time = time.monotonic()

    def line(self, statuses: list[dict], started: float) -> str:
        nodes = statuses
        by_stage: dict[int, int] = {}
        for n in nodes:
            if n.get("state") == "active" and n.get("stage") is not None:
                by_stage[n["stage"]] = by_stage.get(n["stage"], 0) + 1
        num_stages = max((n.get("num_stages", 0) for n in nodes), default=0)
        # Every trained token passes through the last stage exactly once.
        tokens = sum(n.get("tokens_seen", 0) for n in nodes if n.get("stage") == num_stages - 1)
        now = time.monotonic()
        rate = (
            (tokens - self.last_tokens) / (now - self.last_time)
            if self.last_tokens is not None
            else 0.0
        )
        self.last_tokens, self.last_time = tokens, now
        heads = [n for n in nodes if n.get("stage") == 0]
        losses = [x for n in heads for x in n.get("last_losses", [])[-8:]]
        vals = [n["val_loss"] for n in heads if n.get("val_loss") is not None]
        stages = " ".join(f"{by_stage.get(s, 0)}" for s in range(num_stages))
        loss = f"{sum(losses) / len(losses):.3f}" if losses else "  -  "
        val = f"{min(vals):.3f}" if vals else "  -  "
        return (
            f"{now - started:6.0f}s | {rate:7.0f} tok/s | loss {loss} | val_loss {val} "
            f"| tokens {tokens} | nodes per stage [{stages}] | {len(nodes)} reporting"
        )


def cmd_demo(args: argparse.Namespace) -> int:
    manifest = load_manifest(args.manifest)
    nodes = args.nodes or manifest.num_stages
    if nodes < manifest.num_stages:
        raise UsageError(
            f"--nodes {nodes} cannot cover {manifest.num_stages} stages: use at least that many"
        )
    workdir = Path(args.data_dir or tempfile.mkdtemp(prefix="agora-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    extra = ["--eval-every", str(args.eval_every)]
    print(
        f"demo: run {manifest.run_id} ({manifest.run.name}), {nodes} nodes on 127.0.0.1, logs in {workdir}"
    )
    swarm = start_swarm(args.manifest, nodes, workdir, args.base_port, extra)
    started = time.monotonic()
    try:
        for child in swarm.children[1:]:
            wait_for_line(child, "status page http://", 120)
        print("demo: all nodes serving; dashboards:")
        for child in swarm.children[1:]:
            print(f"  {child.name}: http://127.0.0.1:{child.status_port}/")
        progress = Progress()
        end = started + args.minutes * 60 if args.minutes else float("inf")
        while time.monotonic() < end:
            time.sleep(min(args.interval, max(0.1, end - time.monotonic())))
            dead = [c.name for c in swarm.children if c.proc.poll() is not None]
            if dead:
                print(f"demo: {', '.join(dead)} exited unexpectedly; see logs in {workdir}")
                return EXIT_FAILURE
            statuses = [
                s for c in swarm.children[1:] if (s := fetch_status(c.status_port)) is not None
            ]
            print(progress.line(statuses, started), flush=True)
        return EXIT_OK
    except KeyboardInterrupt:
        print("\ndemo: stopping")
        return EXIT_OK
    except RuntimeError as exc:
        print(f"demo: {exc}")
        return EXIT_FAILURE
    finally:
        print("demo: stopping all nodes (they checkpoint and leave)...", flush=True)
        swarm.stop()
        print(f"demo: stopped; logs and checkpoints in {workdir}")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="a local swarm on 127.0.0.1 training the embedded default")
    p.add_argument(
        "--manifest", default="tiny", help="builtin manifest or TOML path (default tiny)"
    )
    p.add_argument("--nodes", type=int, default=0, help="daemons to start (default: one per stage)")
    p.add_argument(
        "--minutes", type=float, default=10.0, help="how long to train (0: until Ctrl-C)"
    )
    p.add_argument("--interval", type=float, default=10.0, help="seconds between progress lines")
    p.add_argument(
        "--eval-every", type=float, default=30.0, help="seconds between validation losses"
    )
    p.add_argument("--base-port", type=int, default=8421, help="status port of the first node")
    p.add_argument("--data-dir", help="where logs and checkpoints go (default: a new temp dir)")
    p.set_defaults(func=cmd_demo)
