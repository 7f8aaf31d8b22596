"""The swarm benchmark splits a daemon's CPU time into its stage worker's and the rest by
the worker thread's OS name (bench/swarm.py `cpu_seconds_by_part`): the worker must carry
that name, and the split must count a named thread's time as the worker's. The processes
a daemon starts in sessions of their own (its libp2p daemon, DHT process) count too."""

import asyncio
import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agora_node.node.worker import StageWorker
from agora_node.stages.manifest_files import load_manifest


def _swarm_bench():
    bench = Path(__file__).resolve().parents[2] / "bench"
    if str(bench) not in sys.path:
        sys.path.append(str(bench))  # its `common` module
    spec = importlib.util.spec_from_file_location("agora_bench_swarm", bench / "swarm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pytestmark = pytest.mark.timeout(60)

SPIN = """
import subprocess, sys, threading
from agora_node.node.thread_name import name_os_thread
def spin():
    name_os_thread("agora-stage2")
    while True:
        pass
threading.Thread(target=spin, daemon=True).start()
# a helper in a session of its own, as the daemon's DHT process and libp2p daemon run
helper = subprocess.Popen(
    [sys.executable, "-c", "while True: pass"], start_new_session=True
)
print("spinning", helper.pid, flush=True)
sys.stdin.read()
"""


def test_the_stage_workers_thread_carries_its_os_name():
    worker = StageWorker(load_manifest("tiny"), 1)
    try:
        tid = asyncio.run(worker.call(threading.get_native_id))
        assert Path(f"/proc/self/task/{tid}/comm").read_text().strip() == "agora-stage1"
    finally:
        worker.close()


@contextlib.contextmanager
def spinner():
    """A process like a daemon (its own process group; a named thread spinning) with a
    spinning helper in a session of its own: (process, helper's pid); both killed after."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SPIN],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, led by it, as a daemon's is
    )
    helper = None
    try:
        word, pid = proc.stdout.readline().split()
        assert word == "spinning"
        helper = int(pid)
        yield proc, helper
    finally:
        if helper is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(helper, signal.SIGKILL)
        proc.kill()
        proc.wait()


def test_a_named_threads_cpu_counts_as_the_stage_workers_and_a_helper_process_as_helpers():
    tree_cpu_seconds = _swarm_bench().tree_cpu_seconds
    with spinner() as (proc, _):
        before = tree_cpu_seconds(proc.pid)  # the start-up (imports) is the main thread's

        def grown(part: str) -> float:
            return tree_cpu_seconds(proc.pid).get(part, 0.0) - before.get(part, 0.0)

        deadline = time.monotonic() + 30
        while min(grown("stage_worker"), grown("helpers")) < 0.5:
            assert time.monotonic() < deadline, tree_cpu_seconds(proc.pid)
            time.sleep(0.1)  # polling the spinning thread's and process's CPU time
        assert grown("daemon_other") < 0.2  # the main thread only waits on stdin
        assert set(tree_cpu_seconds(proc.pid)) == {"stage_worker", "daemon_other", "helpers"}


def test_a_killed_parents_own_session_child_is_found_left_behind():
    """bench/chaos.py's `left_behind`: a process a daemon started in a session of its own
    outlives a SIGKILL of the daemon's process group, re-parented; noted while the daemon
    lived, it is still found, and once it ends it is not."""
    _swarm_bench()  # puts bench/ on the path
    import procs

    with spinner() as (proc, helper):
        seen = procs.tree([proc.pid])
        assert set(seen) == {proc.pid, helper}
        os.killpg(proc.pid, signal.SIGKILL)  # the group alone: the helper is not in it
        proc.wait()
        assert procs.alive(seen) == [f"{helper}:{seen[helper].comm}"]
        os.kill(helper, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while procs.alive(seen):  # until init reaps it
            assert time.monotonic() < deadline
            time.sleep(0.05)
