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
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from agora_node.comms.reaper import DIE_WITH_PARENT_ENV
from agora_node.node import datadir
from agora_node.node.errors import EXIT_FAILURE, EXIT_OK, UsageError
from agora_node.stages.manifest_files import load_manifest


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path
    argv: list[str]
    status_port: int | None = None
    prefix: tuple[str, ...] = ()
    """What the command runs under (tests: `ip netns exec NS` for a network lab host)."""


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
        append: bool = False,
        module: str = "agora_node",
        env: dict[str, str] | None = None,
        prefix: tuple[str, ...] = (),
    ) -> Child:
        """Start `python -m module argv...` (tests pass a test-only module and env, and a
        `prefix` it runs under); `append` continues the log of an earlier run of the same
        name."""
        log_path = self.workdir / f"{name}.log"
        # If the demo itself dies (even by SIGKILL), every node gets SIGTERM and leaves:
        # each node arms that itself (no preexec_fn: see reaper.die_with_parent).
        env = child_env(os.environ, {**(env or {}), DIE_WITH_PARENT_ENV: str(os.getpid())})
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", module, *argv],
            stdout=open(log_path, "a" if append else "w"),  # noqa: SIM115 - owned by the child
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own group; its reaper stops what it started
            env=env,
        )
        child = Child(name, proc, log_path, argv, status_port, prefix)
        self.children.append(child)
        return child

    def respawn(self, child: Child) -> Child:
        """Start `child`'s command again (same identity and data dir) in its place; its log
        goes on in the same file."""
        self.children.remove(child)
        return self.spawn(
            child.name, child.argv, child.status_port, append=True, prefix=child.prefix
        )

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


PASSED_ON = frozenset({"AGORA_MALLOC_TRIM"})
"""AGORA_* variables a node still inherits: process tuning (heap.py), not node options."""


def child_env(parent: Mapping[str, str], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A node's environment: this process's, less the AGORA_* node options (the demo's
    flags configure each node: the operator's AGORA_HOST_MADDRS, AGORA_IDENTITY_PATH,
    AGORA_STAGE... would give every node one port, one key, one stage), plus `extra`
    (what the caller sets explicitly, AGORA_* included)."""
    env = {k: v for k, v in parent.items() if not k.startswith("AGORA_") or k in PASSED_ON}
    return {**env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(extra or {})}


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
    swarm: Swarm, manifest: str, nodes: int, base_port: int, extra: list[str] = ()
) -> Swarm:
    workdir = swarm.workdir
    boot = swarm.spawn(
        "bootstrap", ["bootstrap", "--manifest", manifest, "--data-dir", str(workdir / "bootstrap")]
    )
    line = wait_for_line(boot, "agora-node join --initial-peers", 60)
    swarm.initial_peers = line.split("--initial-peers", 1)[1].split()
    for i in range(nodes):
        data_dir = workdir / f"node-{i}"
        argv = ["join", "--initial-peers", *swarm.initial_peers, "--data-dir", str(data_dir)]
        argv += ["--manifest", manifest]  # the operator's: a head may read a corpus file it names
        port = base_port + i if base_port else 0  # 0: any free port, read from the log
        argv += ["--status-port", str(port), "--threads", "1", *extra]
        swarm.spawn(f"node-{i}", argv, status_port=port)
    return swarm


class Progress:
    """Aggregates the nodes' status into one line per interval."""

    def __init__(self) -> None:
        self.tokens = 0
        """Tokens trained by the swarm: what the heads injected and got back with a gradient."""
        self._seen: dict[str, int] = {}  # per head: its completed_tokens at the last line
        self.last_tokens, self.last_time = 0, time.monotonic()

    def line(self, statuses: list[dict], started: float) -> str:
        nodes = statuses
        by_stage: dict[int, int] = {}
        for n in nodes:
            if n.get("state") == "active" and n.get("stage") is not None:
                by_stage[n["stage"]] = by_stage.get(n["stage"], 0) + 1
        num_stages = max((n.get("num_stages", 0) for n in nodes), default=0)
        for n in nodes:  # per head and only forward: a restarted head counts from 0 again
            if n.get("stage") == 0:
                done, before = n.get("completed_tokens", 0), self._seen.get(n["peer_id"], 0)
                self.tokens += done - before if done >= before else done
                self._seen[n["peer_id"]] = done
        now = time.monotonic()
        rate = (self.tokens - self.last_tokens) / max(now - self.last_time, 1e-9)
        self.last_tokens, self.last_time = self.tokens, now
        tokens = self.tokens
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


_STATUS_PORT = re.compile(r"status page http://[^:]+:(\d+)/")


class _Stopped(Exception):
    """SIGTERM, SIGINT, SIGHUP or SIGQUIT reached the demo: stop every node the same clean way."""


def _raise_stopped(signum: int, frame: object) -> None:
    raise _Stopped(signal.Signals(signum).name)


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def cmd_demo(args: argparse.Namespace) -> int:
    manifest = load_manifest(args.manifest)
    nodes = args.nodes if args.nodes is not None else 2 * manifest.num_stages
    for flag in ("fault_after", "minutes", "interval", "eval_every"):
        if not getattr(args, flag) >= 0:  # nan too
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    if not args.interval > 0 or not args.eval_every > 0:
        raise UsageError("--interval and --eval-every must be positive")
    if nodes < manifest.num_stages:
        raise UsageError(
            f"--nodes {nodes} cannot cover {manifest.num_stages} stages: use at least that many"
        )
    if args.base_port and not 1 <= args.base_port <= 65536 - nodes:
        raise UsageError(  # else a node past 65535 failed ~12 s in, its reason in its log
            f"--base-port {args.base_port}: the {nodes} nodes' status ports must lie in"
            f" 1..65535 (at most {65536 - nodes}; 0: any free ports)"
        )
    workdir = Path(args.data_dir or tempfile.mkdtemp(prefix="agora-demo-"))
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise datadir.unusable(workdir, exc) from None
    extra = ["--eval-every", str(args.eval_every)]
    print(
        f"demo: run {manifest.run_id} ({manifest.run.name}), {nodes} nodes on 127.0.0.1 "
        f"for {manifest.num_stages} stages, logs in {workdir}"
    )
    for sig in _STOP_SIGNALS:
        signal.signal(sig, _raise_stopped)
    swarm = Swarm(workdir)
    summary = Summary()
    try:
        start_swarm(swarm, args.manifest, nodes, args.base_port, extra)
        for child in swarm.children[1:]:
            line = wait_for_line(child, "status page http://", 120)
            child.status_port = int(_STATUS_PORT.search(line).group(1))
        print("demo: all nodes serving; dashboards:")
        for child in swarm.children[1:]:
            print(f"  {child.name}: http://127.0.0.1:{child.status_port}/")
        return _run(swarm, args, summary)
    except _Stopped as exc:
        print(f"\ndemo: {exc} received, stopping")
        return EXIT_OK
    except RuntimeError as exc:
        print(f"demo: {exc}")
        return EXIT_FAILURE
    finally:
        for sig in _STOP_SIGNALS:  # a second signal must not interrupt the clean stop
            signal.signal(sig, signal.SIG_IGN)
        print("demo: stopping all nodes (they checkpoint and leave)...", flush=True)
        swarm.stop()
        print(summary.text(), flush=True)
        print(f"demo: stopped; logs and checkpoints in {workdir}")


def _run(swarm: Swarm, args: argparse.Namespace, summary: Summary) -> int:
    started = time.monotonic()
    progress = Progress()
    faults = FaultPlan(swarm, after_s=args.fault_after) if args.faults else None
    end = started + args.minutes * 60 if args.minutes else float("inf")
    while time.monotonic() < end:
        time.sleep(min(args.interval, max(0.1, end - time.monotonic())))
        if faults is not None:
            faults.step(time.monotonic() - started)
        dead = [
            c.name
            for c in swarm.children
            if c.proc.poll() is not None and (faults is None or c is not faults.victim)
        ]
        if dead:
            print(f"demo: {', '.join(dead)} exited unexpectedly; see logs in {swarm.workdir}")
            return EXIT_FAILURE
        statuses = [s for c in swarm.children[1:] if (s := _node_status(c)) is not None]
        summary.update(statuses)
        print(progress.line(statuses, started), flush=True)
    return EXIT_OK


def _node_status(child: Child) -> dict | None:
    return fetch_status(child.status_port) if child.proc.poll() is None else None


def _status_ports(child: Child) -> list[int]:
    """The status ports a node's log announced, oldest first (one per start)."""
    return [int(p) for p in _STATUS_PORT.findall(child.log_path.read_text(errors="replace"))]


class FaultPlan:
    """`--faults`: SIGKILL one node of the last stage mid-run, restart it with the same
    identity and data dir a little later, and say what the swarm did about it."""

    def __init__(self, swarm: Swarm, after_s: float, down_s: float = 20.0) -> None:
        self.swarm, self.after_s, self.down_s = swarm, after_s, down_s
        self.victim: Child | None = None
        self.killed_at: float | None = None
        self.restarted = self.reported = False
        self._ports_seen: list[int] = []

    def step(self, elapsed: float) -> None:
        if self.victim is None and elapsed >= self.after_s:
            self._kill()
        elif self.killed_at is not None and not self.restarted and elapsed >= self.killed_at:
            self._ports_seen = _status_ports(self.victim)
            self.victim = self.swarm.respawn(self.victim)
            self.restarted = True
            print(f"demo: fault: restarted {self.victim.name} with the same identity", flush=True)
        elif self.restarted and not self.reported:
            ports = _status_ports(self.victim)  # its log goes on: the newest line is this run's
            if len(ports) > len(self._ports_seen):
                self.victim.status_port = ports[-1]
            status = _node_status(self.victim)
            origin = (status or {}).get("state_origin") or {}
            if status and status.get("state") == "active" and origin:
                print(
                    f"demo: fault: {self.victim.name} serves stage {status['stage']} again; "
                    f"state from {origin.get('kind')} {str(origin.get('source'))[-8:]}",
                    flush=True,
                )
                self.reported = True

    def _kill(self) -> None:
        statuses = {c.name: _node_status(c) for c in self.swarm.children[1:]}
        last = max((s["num_stages"] for s in statuses.values() if s), default=1) - 1
        victims = [
            c for c in self.swarm.children[1:] if (statuses[c.name] or {}).get("stage") == last
        ]
        self.victim = (victims or self.swarm.children[1:])[-1]
        _signal_group(self.victim.proc, signal.SIGKILL)
        self.victim.proc.wait()
        self.killed_at = self.after_s + self.down_s
        if len(victims) >= 2:
            then = "micro-batches in flight there fail over to its stage's other replica"
        elif victims:  # said so: with one replica the stage is empty until the restart
            then = f"it was stage {last}'s only replica: training waits for its restart"
        else:
            then = "no node's status was read, so which stage it served is not known"
        print(
            f"demo: fault: SIGKILLed {self.victim.name} (stage {last}); {then}; "
            f"restart in {self.down_s:.0f}s",
            flush=True,
        )


class Summary:
    """What happened during the demo, from the nodes' last statuses."""

    def __init__(self) -> None:
        self.first_val: float | None = None
        self.last_val: float | None = None
        self.last: dict[str, dict] = {}

    def update(self, statuses: list[dict]) -> None:
        for s in statuses:
            self.last[s["peer_id"]] = s
        vals = [s["val_loss"] for s in statuses if s.get("stage") == 0 and s.get("val_loss")]
        if vals and self.first_val is None:
            self.first_val = min(vals)
        if vals:
            self.last_val = min(vals)

    def text(self) -> str:
        nodes = list(self.last.values())
        if not nodes:
            return "demo: summary: no node reported"
        outer = [n.get("outer") or {} for n in nodes]
        rounds = max((o.get("outer_round", 0) for o in outer), default=0)
        grouped = sum(
            1 for o in outer if len((o.get("last_round") or {}).get("delta_group", [])) > 1
        )
        outer_mb = sum(o.get("bytes_sent", 0) for o in outer) / 1e6

        def total(group: list[dict], kind: str) -> int:
            return sum(n.get("microbatches", {}).get(kind, 0) for n in group)

        # a head counts its micro-batches' outcomes; a later stage the requests it answered
        heads = [n for n in nodes if n.get("stage") == 0]
        served_by = [n for n in nodes if n.get("stage") not in (0, None)]
        served = sum(len(n.get("states_served", [])) for n in nodes)
        val = f"{self.first_val:.3f} -> {self.last_val:.3f}" if self.first_val is not None else "-"
        return (
            f"demo: summary: {rounds} outer rounds ({grouped} of {len(nodes)} nodes mixed in a "
            f"group of 2+ last round, {outer_mb:.1f} MB sent); micro-batches ok "
            f"{total(heads, 'ok')}, dropped {total(heads, 'dropped')}, rejected "
            f"{total(heads, 'rejected')}; requests answered by later stages ok "
            f"{total(served_by, 'ok')}, refused {total(served_by, 'rejected')}; "
            f"{served} state copies served; val_loss {val}" + cells_text(nodes)
        )


def cells_text(nodes: list[dict]) -> str:
    """The context-parallel cells the nodes last reported, for the summary ("" if none)."""
    leaders = [c for n in nodes if (c := n.get("cell") or {}).get("role") == "leader"]
    if not leaders:
        return ""
    mbs = sum(c.get("microbatches", 0) for c in leaders)
    failed = sum(c.get("failed", 0) for c in leaders)
    per_token = [c["kv_bytes_per_token"] for c in leaders if c.get("kv_bytes_per_token")]
    kv = f", K/V {max(per_token):.1f} B/token sent by a leader" if per_token else ""
    return f"; {len(leaders)} cell(s): {mbs} micro-batches split, {failed} trained whole{kv}"


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="a local swarm on 127.0.0.1 training the embedded default")
    p.add_argument(
        "--manifest",
        default="demo",
        help="builtin manifest or TOML path (default demo: 2 stages sized for 2 CPU cores)",
    )
    p.add_argument(
        "--faults",
        action="store_true",
        help="SIGKILL a node mid-run and restart it: shows failover and a state copy",
    )
    p.add_argument(
        "--fault-after",
        type=float,
        default=90.0,
        help="seconds into the run for --faults (default: 90)",
    )
    p.add_argument(
        "--nodes",
        type=_at_least_one,
        default=None,
        help="daemons to start, at least the run's stages (default: two per stage)",
    )
    p.add_argument(
        "--minutes",
        type=float,
        default=10.0,
        help="how long to train (0: until Ctrl-C; default: 10)",
    )
    p.add_argument(
        "--interval", type=float, default=10.0, help="seconds between progress lines (default: 10)"
    )
    p.add_argument(
        "--eval-every",
        type=float,
        default=30.0,
        help="seconds between validation losses (default: 30)",
    )
    p.add_argument(
        "--base-port",
        type=int,
        default=8421,
        help="status port of the first node, the next ones follow (0: any free ports)",
    )
    p.add_argument("--data-dir", help="where logs and checkpoints go (default: a new temp dir)")
    p.set_defaults(func=cmd_demo)
