"""Stopping by any signal leaves nothing behind: a node or bootstrap whose whole process
group gets SIGTERM (timeout, systemd, `kill -- -PGID`), and the demo stopped by SIGTERM
or killed by SIGKILL."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.harness import poll, wait_for_line

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _descendants(root: int) -> set[int]:
    """Every live process below `root` (sessions and process groups included), by ppid."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":  # zombies are dead; their parent reaps them
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def test_node_and_bootstrap_leave_when_their_process_group_gets_sigterm_or_sighup(swarm):
    boot = swarm.bootstrap("demo")
    node = swarm.join("node-0", "--stage", "0")
    swarm.serving(node)
    poll(lambda: (s := swarm.status(node)) and s["state"] == "active", 60, "active")
    # as `timeout`, systemd or `kill -- -PGID` deliver it; a closed terminal sends SIGHUP
    os.killpg(node.proc.pid, signal.SIGTERM)
    os.killpg(boot.proc.pid, signal.SIGHUP)
    assert node.proc.wait(timeout=60) == 0, swarm.log(node)[-2000:]
    assert boot.proc.wait(timeout=30) == 0, swarm.log(boot)[-2000:]
    assert "checkpoint saved" in swarm.log(node)
    # the helpers (DHT process, p2pd) are in sessions of their own: the group's signal did not
    # stop them under the node, so every step of the leave went through (withdraw, drain,
    # the SWIM goodbye); before, each ran into its deadline
    unfinished = [
        line for line in swarm.log(node).splitlines() if "leaving: " in line and " W " in line
    ]
    assert not unfinished, unfinished


def test_a_bootstrap_leaves_cleanly_on_sigquit(swarm):
    """SIGQUIT means "leave cleanly" to a node (operating.md); the bootstrap took its
    default action (a core dump, exit -3) and left its libp2p daemon to the reaper."""
    boot = swarm.bootstrap("demo")
    boot.proc.send_signal(signal.SIGQUIT)
    assert boot.proc.wait(timeout=30) == 0, swarm.log(boot)[-2000:]


def test_a_signal_while_joining_stops_the_join(swarm):
    """SIGTERM while a `--stage auto` joiner still settles on its stage (8 directory reads
    1.5 s apart): the join is cancelled and the node exits cleanly, without first taking
    a stage, publishing itself and then leaving."""
    swarm.bootstrap("demo")
    node = swarm.join("node-0", "--stage", "auto")
    wait_for_line(node, "joined run", 90)
    swarm.kill(node, signal.SIGTERM)
    assert node.proc.wait(timeout=60) == 0, swarm.log(node)[-2000:]
    log = swarm.log(node)
    assert "stopped while joining" in log and "serving stage" not in log, log[-2000:]


def test_a_node_stopped_while_joining_withdraws_its_joining_record(swarm):
    """Stopped after it chose its stage and announced itself, before it served: its record
    stood until it expired, and the next joiner placed itself around a node not there."""
    swarm.bootstrap("demo")
    node = swarm.join("node-0", "--stage", "auto", "--record-ttl", "120", "--refresh", "30")
    wait_for_line(node, "chose stage", 90)
    swarm.kill(node, signal.SIGTERM)
    assert node.proc.wait(timeout=60) == 0, swarm.log(node)[-2000:]
    later = swarm.join("node-1", "--stage", "auto")
    line = wait_for_line(later, "chose stage", 90)
    assert "0 (0 replicas), tied with stage(s)" in line, line  # both stages empty


def _start_demo(workdir: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "agora_node", "demo", "--nodes", "2", "--minutes", "0"]
    argv += ["--interval", "2", "--data-dir", str(workdir), "--base-port", "0"]
    return subprocess.Popen(
        argv,
        stdout=open(workdir / "demo.out", "w"),  # noqa: SIM115 - closed with the process
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


# SIGTERM's clean exit is the node's and the bootstrap's above; the demo's own (it forwards
# the signal to its children) runs with the slow tests, to keep the default suite's time
@pytest.mark.parametrize(
    "sig", [pytest.param(signal.SIGTERM, marks=pytest.mark.slow), signal.SIGKILL]
)
def test_demo_stopped_or_killed_leaves_no_process_behind(tmp_path, sig):
    workdir = tmp_path / "demo"
    workdir.mkdir()
    demo = _start_demo(workdir)
    out = workdir / "demo.out"
    tree: set[int] = set()
    try:
        poll(lambda: "all nodes serving" in out.read_text(), 180, "the demo's nodes serving")
        poll(lambda: " tok/s " in out.read_text(), 60, "a progress line")
        tree = _descendants(demo.pid)  # bootstrap, nodes, their DHT children, p2pd, reapers
        assert len(tree) >= 3, tree
        demo.send_signal(sig)
        code = demo.wait(timeout=90)
        if sig == signal.SIGTERM:
            assert code == 0, out.read_text()[-2000:]
            assert "stopped; logs and checkpoints" in out.read_text()
        started = time.monotonic()
        poll(lambda: not _alive(tree), 60, f"no process of the demo left after {sig.name}")
        print(f"{sig.name}: every process gone {time.monotonic() - started:.1f}s after exit")
        node_logs = [p.read_text() for p in workdir.glob("node-*.log")]
        assert node_logs and all("checkpoint saved" in log for log in node_logs)
    finally:
        for pid in _alive(tree | {demo.pid}):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        demo.wait(timeout=10)


@pytest.mark.skipif(shutil.which("faketime") is None, reason="needs faketime (Debian package)")
def test_a_node_whose_clock_is_off_gets_one_line_with_the_offset_and_the_fix(swarm, tmp_path):
    swarm.bootstrap("demo")
    argv = ["faketime", "-f", "+30s", sys.executable, "-m", "agora_node", "join"]
    argv += ["--initial-peers", *swarm.initial_peers, "--data-dir", str(tmp_path / "late")]
    argv += ["--status-port", "0"]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )
    assert done.returncode == 1, done.stdout + done.stderr
    errors = [line for line in (done.stdout + done.stderr).splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert "clock is +30" in errors[0] and "time synchronization" in errors[0], errors
