"""A swarm under a scripted fault schedule against the same swarm without faults (A B A B).

    python bench/chaos.py --repeats 2 --json
    python bench/chaos.py --schedule "kill-bootstrap@0.1,kill:1@0.25+15,stop:0@0.45+20" --json
    python bench/chaos.py --vs-overlap --emulate-link 100,25 --json
    sudo python bench/chaos.py --lab --schedule "partition:1@0.2+30,degrade:0@0.5+30" --json

Each side starts a bootstrap and `--replicas` daemons per stage of a `--layers`-layer,
`--stages`-stage cut of `tiny` on 127.0.0.1 (one torch thread each, fixed stages), and
every stage-0 daemon (a head) trains `--tokens-per-head` tokens, then reports its
validation loss (`final_val_loss`, the daemon's own evaluation). A: no faults. B: the
schedule, whose times are fractions of A's training time (the preceding A's):

    kill-bootstrap@F     SIGKILL the bootstrap and every process it started but its
                         reaper (which removes the dead one's sockets); it never comes back
    kill:S@F+D           SIGKILL a stage-S daemon and every process it started but its
                         reaper (a crash: its libp2p and DHT processes at once); D seconds
                         later restart it with the same command, identity and data dir
    stop:S@F+D           SIGSTOP a stage-S daemon and every process it started (a frozen
                         machine); D seconds later SIGCONT them
    term:S@F+D           SIGTERM (a clean leave); D seconds later restart it
    partition:S@F+D      (--lab) cut a stage-S daemon's host off from every other host
                         (both ways, established connections too); D seconds later heal
    degrade:S@F+D        (--lab) its uplink and downlink down to `--degrade` Mbit/s (tc
                         tbf); D seconds later back to the lab's links

`--lab` (root, `ip netns`: the network lab of tests/netlab.py) runs every process in a
network namespace of its own on the lab's switch, both sides; `--lab-link UP,DOWN,RTT`
shapes every host's links there (the RTT added in the transport: this kernel has no
netem). A partitioned or degraded victim keeps running: `recover_s` counts from the heal.

A victim is never a stage's last live replica (the schedule is refused if it would be).
A daemon restarted after the bootstrap died is given only the bootstrap's address, as
its operator would: it must rejoin through the peers it remembers.

One JSON line (`--json`): `val_loss` {fault_free, chaos} (medians over repeats of the mean
of the heads' final validation losses), `gap` (chaos over fault-free - 1),
`lost_microbatches` (micro-batches heads injected and never got a gradient for, chaos
median), `recover_s` (the longest time from a victim's restart or SIGCONT until it served
a micro-batch again, chaos median), `left_behind` (processes any side's daemons or bootstrap
started, noted while they lived, libp2p sockets and control sockets still there after
the swarm stopped, namespaces created; must be 0), `tokens_per_s` and `outer_blocked_share` (the mean over daemons of
the time outer rounds held inner steps, over the training time) per side, and `runs`
with every side's figures and events.

Rounds hold inner steps unless `--overlap` (the built-in manifests overlap them since
2026-12-05; the figures in docs/benchmarks.md were measured with blocking rounds).
`--vs-overlap` compares outer rounds that hold inner steps (A) with overlapped ones (B,
manifest `outer.overlap`), both without faults; the keys name the sides (`blocking`,
`overlap`). `--emulate-link MBIT,MS` shapes every daemon's uplink in the transport.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import procs  # noqa: E402
from common import DaemonLab, control_status, exit_on_sigterm, parse_rates  # noqa: E402

from agora_node.comms.reaper import is_reaper  # noqa: E402
from agora_node.node.demo import (  # noqa: E402
    Child,
    Swarm,
    _signal_group,
    fetch_status,
    wait_for_line,
)
from agora_node.protocol.manifest import parse_manifest  # noqa: E402
from agora_node.stages.manifest_files import load_manifest  # noqa: E402

ACTIONS = ("kill-bootstrap", "kill", "stop", "term", "partition", "degrade")
LAB_ACTIONS = ("partition", "degrade")
_PAGE = "status page http://"


@dataclass
class Fault:
    action: str
    stage: int | None
    at: float  # fraction of the fault-free training time
    down_s: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Fault:
        """`ACTION[:STAGE]@FRACTION[+DOWN_S]`."""
        try:
            head, when = text.strip().split("@")
            action, _, stage = head.partition(":")
            at, _, down = when.partition("+")
            fault = cls(action, int(stage) if stage else None, float(at), float(down or 0))
        except ValueError:
            raise ValueError(f"bad fault {text!r}: want ACTION[:STAGE]@FRACTION[+DOWN_S]") from None
        if action not in ACTIONS:
            raise ValueError(f"bad fault {text!r}: action must be one of {', '.join(ACTIONS)}")
        if (action == "kill-bootstrap") != (fault.stage is None) or not 0 <= fault.at < 1:
            raise ValueError(f"bad fault {text!r}: a stage for node faults, 0 <= FRACTION < 1")
        return fault


def parse_schedule(text: str, stages: int, replicas: int) -> list[Fault]:
    faults = sorted((Fault.parse(t) for t in text.split(",") if t.strip()), key=lambda f: f.at)
    for s in range(stages):
        hit = sum(1 for f in faults if f.stage == s)
        if hit >= replicas:  # victims are distinct daemons, and one must stay
            raise ValueError(f"the schedule hits {hit} of stage {s}'s {replicas} replicas")
    if any(f.stage is not None and not 0 <= f.stage < stages for f in faults):
        raise ValueError(f"a fault names a stage outside 0..{stages - 1}")
    return faults


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--replicas", type=int, default=3, help="daemons per stage")
    p.add_argument("--layers", type=int, default=4, help="layers of the cut of tiny")
    p.add_argument("--inner-steps", type=int, default=20, help="outer round every H inner steps")
    p.add_argument("--tokens-per-head", type=int, default=60 * 16 * 128)
    p.add_argument(
        "--schedule",
        default="kill-bootstrap@0.1,kill:1@0.25+15,stop:0@0.45+20",
        help="comma-separated faults (see above); the default fails 2 of 6 daemons",
    )
    p.add_argument("--repeats", type=int, default=1, help="A B pairs")
    p.add_argument(
        "--overlap",
        action="store_true",
        help="both sides with overlapped outer rounds (manifest outer.overlap)",
    )
    p.add_argument(
        "--vs-overlap",
        action="store_true",
        help="no faults: A = outer rounds that block inner steps, B = overlapped ones",
    )
    p.add_argument(
        "--emulate-link",
        default="",
        help="MBIT,MS: every daemon's uplink shaped in the transport (comms/linkemu.py)",
    )
    p.add_argument(
        "--lab", action="store_true", help="every process in a network namespace of its own"
    )
    p.add_argument(
        "--lab-link", default="", metavar="UP,DOWN,RTT", help="(--lab) every host's links"
    )
    p.add_argument("--degrade", default="1,1", metavar="UP,DOWN", help="a degraded victim's Mbit/s")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per side")
    p.add_argument(
        "--logs", default="", metavar="DIR", help="copy every side's daemon logs into DIR"
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if min(args.stages, args.replicas, args.layers, args.inner_steps, args.repeats) < 1:
        p.error("--stages, --replicas, --layers, --inner-steps and --repeats must be positive")
    if args.layers < args.stages:
        p.error("--layers must be at least --stages")
    try:
        args.faults = parse_schedule(args.schedule, args.stages, args.replicas)
        args.lab_shape = parse_rates(args.lab_link, 3) if args.lab_link else None
        args.degrade_to = parse_rates(args.degrade, 2)
    except ValueError as exc:
        p.error(str(exc))
    if not args.lab and (args.lab_link or any(f.action in LAB_ACTIONS for f in args.faults)):
        p.error(f"--lab-link and the faults {', '.join(LAB_ACTIONS)} need --lab")
    if args.lab and args.emulate_link:
        p.error("--lab shapes links itself (--lab-link): no --emulate-link with it")
    return args


def write_manifest(path: Path, args: argparse.Namespace, overlap: bool) -> Path:
    text = load_manifest("tiny").to_toml()
    text, swapped = re.subn(
        r"\noverlap = (true|false)\n", f"\noverlap = {str(overlap).lower()}\n", text
    )
    if swapped != 1:
        raise RuntimeError("tiny's manifest text has no one outer.overlap line to set")
    text = text.replace("n_layers = 8", f"n_layers = {args.layers}")
    text = text.replace("count = 4", f"count = {args.stages}")
    text = text.replace("inner_steps = 50", f"inner_steps = {args.inner_steps}")
    parse_manifest(text)  # refuse a bad cut before a daemon sees it
    path.write_text(text)
    return path


LINGER_S = 30.0
"""How long a stopped swarm's processes may take to end on their own (torch's shared-memory
manager outlives its clients by a moment; a reaper finishes its removals)."""


def _still_running(seen: dict[int, procs.Proc], linger_s: float) -> list[str]:
    """Those of `seen` still running `linger_s` after the swarm was stopped (polled)."""
    deadline = time.monotonic() + linger_s
    while (left := procs.alive(seen)) and time.monotonic() < deadline:
        time.sleep(0.2)  # polling processes that end on their own, under a deadline
    return left


def _namespaces() -> set[str]:
    try:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


class Side:
    """One run of the swarm: start, drive the faults, wait for every head's final loss."""

    def __init__(self, args: argparse.Namespace, workdir: Path, faults: list[Fault]) -> None:
        self.args, self.workdir, self.faults = args, workdir, faults
        self.swarm = Swarm(workdir)
        self.seen: dict[int, procs.Proc] = {}
        """Their processes and those they started, noted while they lived (procs.py)."""
        self.sockets: set[str] = set()
        self.events: list[dict] = []
        self.stopped: set[str] = set()  # names of SIGSTOPped daemons (no status fetch)
        self.stage_of: dict[str, int] = {}
        self.starts: dict[str, int] = {}  # status-page lines in a restarted daemon's log before
        self.hosts = {}
        self.lab = DaemonLab(args.lab_shape) if args.lab else None

    def spawn(self, name: str, argv: list[str]) -> Child:
        prefix: tuple[str, ...] = ()
        if self.lab is not None:  # a host of its own on the lab's switch
            host = self.hosts[name] = self.lab.host(name)
            prefix, listen = self.lab.command(host)
            argv = [*argv, *listen]
        child = self.swarm.spawn(name, argv, prefix=prefix)
        return child

    def _note_processes(self) -> None:
        """Note the live daemons' processes and their libp2p daemons' sockets, to check at
        the end that none is left (their children outlive a killed parent, re-parented)."""
        self._note(procs.tree(c.proc.pid for c in self.swarm.children if c.proc.poll() is None))

    def _note(self, tree: dict[int, procs.Proc]) -> None:
        self.seen.update(tree)
        self.sockets |= procs.p2pd_sockets(tree.values())

    def _machine_signal(self, child: Child, sig: signal.Signals) -> None:
        """`sig` to what a machine runs for this node: the daemon and every process it
        started (its libp2p daemon, DHT process and reaper run in sessions of their own),
        so a SIGKILL is a crash of them all at once and a SIGSTOP a frozen machine. The
        daemon is stopped first, so it starts nothing between the look and the signal. A
        SIGKILL spares the reaper, whose work is to remove the dead one's sockets (as on a
        machine that reboots, nothing of it is left). A SIGTERM, an operator's, goes to
        the daemon alone (`_strike`), as Ctrl-C would."""
        if sig != signal.SIGCONT:
            _signal_group(child.proc, signal.SIGSTOP)
        tree = procs.tree([child.proc.pid])
        self._note(tree)
        for pid in tree:
            if sig == signal.SIGKILL and is_reaper(pid):
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        _signal_group(child.proc, sig)

    def status(self, child: Child) -> dict | None:
        if child.name in self.stopped or child.proc.poll() is not None or not child.status_port:
            return None
        if self.lab is not None:  # its page listens on its namespace's own 127.0.0.1
            return control_status(child)
        return fetch_status(child.status_port, timeout=2)

    def nodes(self) -> list[Child]:
        return [c for c in self.swarm.children if c.name != "bootstrap"]

    def run(self, manifest: Path, duration_hint: float) -> dict:
        before_ns = _namespaces()
        try:
            result = self._train(manifest, duration_hint)
        finally:
            self._note_processes()
            for child in self.nodes():  # a frozen one's helpers would stay frozen for good
                if child.name in self.stopped:
                    self._machine_signal(child, signal.SIGCONT)
            self.swarm.stop(grace_s=30)
            if self.lab is not None:
                self.lab.close()
        left = {
            "processes": _still_running(self.seen, LINGER_S),
            "sockets": sorted(p for p in self.sockets if os.path.exists(p)),
            "control_sockets": sorted(str(p) for p in self.workdir.glob("*/control.sock")),
            "namespaces": sorted(_namespaces() - before_ns),
        }
        result["left_behind"] = sum(len(v) for v in left.values())
        result["left_behind_detail"] = left
        result["faults"] = ",".join(f"{f.action}:{f.stage}@{f.at}+{f.down_s}" for f in self.faults)
        return result

    def _train(self, manifest: Path, duration_hint: float) -> dict:
        args = self.args
        boot = self.spawn(
            "bootstrap",
            ["bootstrap", "--manifest", str(manifest), "--data-dir", str(self.workdir / "b")],
        )
        peers = wait_for_line(boot, "--initial-peers", 60).split("--initial-peers", 1)[1].split()
        common = ["--initial-peers", *peers, "--status-port", "0", "--threads", "1"]
        common += ["--eval-every", "1000000", "--max-tokens", str(args.tokens_per_head)]
        if args.emulate_link:
            common += ["--emulate-link", args.emulate_link]
        if self.lab is not None:
            common += self.lab.daemon_args()
        for s in range(args.stages):
            for r in range(args.replicas):
                name = f"s{s}r{r}"
                self.stage_of[name] = s
                argv = ["join", *common, "--stage", str(s), "--data-dir", str(self.workdir / name)]
                self.spawn(name, argv)
        for child in self.nodes():
            line = wait_for_line(child, "status page http://", 180)
            child.status_port = int(line.rsplit(":", 1)[1].strip("/ \n"))
        deadline = time.monotonic() + 180
        while not all((s := self.status(c)) and s["state"] == "active" for c in self.nodes()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the swarm did not become active; logs in {self.workdir}")
            time.sleep(0.5)  # polling under a deadline
        started = time.monotonic()
        self._note_processes()  # every incarnation's, before any dies
        pending = [(f, f.at * duration_hint) for f in self.faults]
        returns: list[tuple[float, Child, str, dict]] = []  # (when, victim, action, event)
        watching: list[tuple[Child, dict, int]] = []  # victims back, until they serve again
        finals: dict[str, dict] = {}
        while True:
            now = time.monotonic() - started
            if now > args.timeout_s:
                raise RuntimeError(f"no final loss from every head in {args.timeout_s:.0f}s")
            while pending and pending[0][1] <= now:
                fault, _ = pending.pop(0)
                self._strike(fault, now, returns)
            for item in [r for r in returns if r[0] <= now]:
                returns.remove(item)
                watching.append(self._bring_back(item, now))
            for child, event, before in list(watching):
                self._port_of(child)
                s = self.status(child)
                if s and s["state"] == "active" and _progress(s) > before:
                    event["serving_again_s"] = round(now - event["back_at_s"], 1)
                    event["same_peer_id"] = s["peer_id"] == event["peer_id"]
                    watching.remove((child, event, before))
            heads = [c for c in self.nodes() if self.stage_of[c.name] == 0]
            for head in heads:
                s = self.status(head)
                if s and s.get("final_val_loss") is not None:
                    finals[head.name] = s
            if len(finals) == len(heads) and not returns:  # training is over
                for fault, _ in pending:  # due after the end: never struck
                    self.events.append({"action": fault.action, "skipped": "training ended"})
                for _, event, _ in watching:  # back, but no traffic left to serve
                    event["serving_again_s"] = None
                break
            time.sleep(0.5)  # polling under a deadline (timeout_s, above)
        trained = time.monotonic() - started
        outer = [(s or {}).get("outer") or {} for s in map(self.status, self.nodes())]
        blocked = [o["seconds_blocked"] for o in outer if "seconds_blocked" in o]
        m = load_manifest("tiny")
        per_mb = m.inner.micro_batch * m.model.seq_len
        losses = [s["final_val_loss"] for s in finals.values()]
        lost = sum(
            (s["injected_tokens"] - s["completed_tokens"]) // per_mb for s in finals.values()
        )
        return {
            "val_loss": round(statistics.fmean(losses), 4),
            "val_loss_by_head": {k: round(v["final_val_loss"], 4) for k, v in finals.items()},
            "tokens": sum(s["completed_tokens"] for s in finals.values()),
            "lost_microbatches": lost,
            "train_s": round(trained, 1),
            "tokens_per_s": round(sum(s["completed_tokens"] for s in finals.values()) / trained, 1),
            "outer_rounds": max((o.get("rounds", 0) for o in outer), default=0),
            "outer_blocked_share": round(statistics.fmean(blocked) / trained, 4) if blocked else 0,
            "recover_s": max((e.get("serving_again_s") or 0.0 for e in self.events), default=0.0),
            "events": self.events,
        }

    def _strike(self, fault: Fault, now: float, returns: list) -> None:
        self._note_processes()  # the victim's, while it lives
        if fault.action == "kill-bootstrap":
            boot = self.swarm.children[0]
            self._machine_signal(boot, signal.SIGKILL)
            boot.proc.wait()
            self.events.append({"action": fault.action, "at_s": round(now, 1)})
            return
        hit = {e["node"] for e in self.events if "node" in e}
        live = [
            c
            for c in self.nodes()
            if self.stage_of[c.name] == fault.stage and c.name not in self.stopped
        ]
        victim = next(c for c in live if c.name not in hit)
        status = self.status(victim) or {}
        sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}
        if fault.action == "partition":
            others = [self.hosts[c.name] for c in self.swarm.children if c.name != victim.name]
            self.lab.lab.partition([self.hosts[victim.name]], others)
        elif fault.action == "degrade":
            self.lab.lab.shape(self.hosts[victim.name], *self.args.degrade_to)
        elif fault.action == "term":
            victim.proc.send_signal(signal.SIGTERM)  # the daemon's own clean leave
            victim.proc.wait(timeout=60)
        else:
            self._machine_signal(victim, sig[fault.action])
        if fault.action == "kill":
            victim.proc.wait()
        if fault.action == "stop":
            self.stopped.add(victim.name)
        event = {
            "action": fault.action,
            "node": victim.name,
            "stage": fault.stage,
            "peer_id": status.get("peer_id"),
            "at_s": round(now, 1),
            "down_s": fault.down_s,
        }
        self.events.append(event)
        returns.append((now + fault.down_s, victim, fault.action, event))
        returns.sort(key=lambda r: r[0])

    def _bring_back(self, item: tuple, now: float) -> tuple[Child, dict, int]:
        """SIGCONT or restart the victim; what to watch until it serves again (a restarted
        daemon's status port is read from its log by `_port_of` once it prints it)."""
        _, victim, action, event = item
        event["back_at_s"] = round(now, 1)
        if action in LAB_ACTIONS:
            host = self.hosts[victim.name]
            if action == "partition":
                self.lab.lab.heal([host])
            else:
                self.lab.restore(host)
            return victim, event, _progress(self.status(victim) or {})
        if action == "stop":
            self._machine_signal(victim, signal.SIGCONT)
            self.stopped.discard(victim.name)
            return victim, event, _progress(self.status(victim) or {})
        starts = victim.log_path.read_text(errors="replace").count(_PAGE)
        child = self.swarm.respawn(victim)
        child.status_port = None  # until this start prints its own
        self.starts[child.name] = starts
        return child, event, 0

    def _port_of(self, child: Child) -> None:
        """A restarted daemon's status port, once its log (appended to) shows this start's."""
        text = child.log_path.read_text(errors="replace")
        if child.status_port is None and text.count(_PAGE) > self.starts.get(child.name, 0):
            child.status_port = int(text.rsplit(_PAGE, 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
        if child.proc.poll() is not None:
            raise RuntimeError(f"{child.name} exited after its restart; see {child.log_path}")


def _progress(status: dict) -> int:
    """What grows while a daemon serves: micro-batch hops it completed."""
    return int(status.get("microbatches", {}).get("ok", 0))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs: list[dict] = []
    duration = 0.0
    cond = {
        "cores_usable": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "loadavg_1m_before": [],
    }
    with tempfile.TemporaryDirectory(prefix="agora-chaos-") as tmp:
        plain = write_manifest(Path(tmp) / "chaos.toml", args, args.overlap)
        overlapped = write_manifest(Path(tmp) / "overlap.toml", args, True)
        if args.vs_overlap:  # A: rounds that block, B: overlapped; no faults
            sides = [("blocking", [], plain), ("overlap", [], overlapped)]
        else:
            sides = [("fault_free", [], plain), ("chaos", args.faults, plain)]
        for i in range(args.repeats):
            for label, faults, manifest in sides:
                cond["loadavg_1m_before"].append(round(os.getloadavg()[0], 2))
                workdir = Path(tmp) / f"{label}-{i}"
                workdir.mkdir()
                try:
                    side = Side(args, workdir, faults).run(manifest, duration)
                finally:
                    if args.logs:
                        keep = Path(args.logs) / workdir.name
                        keep.mkdir(parents=True, exist_ok=True)
                        for log in workdir.glob("*.log"):
                            shutil.copy(log, keep / log.name)
                side["side"] = label
                if not faults:
                    duration = side["train_s"]
                runs.append(side)
                print(json.dumps(side), file=sys.stderr, flush=True)
    a, b = sides[0][0], sides[1][0]

    def med(label: str, key: str) -> float:
        return round(statistics.median(r[key] for r in runs if r["side"] == label), 4)

    result = {
        "val_loss": {a: med(a, "val_loss"), b: med(b, "val_loss")},
        "gap": round(med(b, "val_loss") / med(a, "val_loss") - 1, 4),
        "tokens": {a: med(a, "tokens"), b: med(b, "tokens")},
        "tokens_per_s": {a: med(a, "tokens_per_s"), b: med(b, "tokens_per_s")},
        "outer_blocked_share": {a: med(a, "outer_blocked_share"), b: med(b, "outer_blocked_share")},
        "lost_microbatches": med(b, "lost_microbatches"),
        "recover_s": med(b, "recover_s"),
        "left_behind": sum(r["left_behind"] for r in runs),
        "schedule": "" if args.vs_overlap else args.schedule,
        "setup": {
            "stages": args.stages,
            "replicas": args.replicas,
            "layers": args.layers,
            "inner_steps": args.inner_steps,
            "tokens_per_head": args.tokens_per_head,
            "repeats": args.repeats,
            "overlap": "B" if args.vs_overlap else args.overlap,
            "emulate_link": args.emulate_link,
            "lab": args.lab,
            "lab_link": args.lab_link,
            "degrade": args.degrade,
        },
        "conditions": cond,
        "runs": runs,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
    return 0 if result["left_behind"] == 0 else 1


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main())
