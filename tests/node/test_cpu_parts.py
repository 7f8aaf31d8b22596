"""The swarm benchmark splits a daemon's CPU time into its stage worker's and the rest by
the worker thread's OS name (bench/swarm.py `cpu_seconds_by_part`): the worker must carry
that name, and the split must count a named thread's time as the worker's."""

import asyncio
import importlib.util
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
import sys, threading
from agora_node.node.thread_name import name_os_thread
def spin():
    name_os_thread("agora-stage2")
    while True:
        pass
threading.Thread(target=spin, daemon=True).start()
print("spinning", flush=True)
sys.stdin.read()
"""


def test_the_stage_workers_thread_carries_its_os_name():
    worker = StageWorker(load_manifest("tiny"), 1)
    try:
        tid = asyncio.run(worker.call(threading.get_native_id))
        assert Path(f"/proc/self/task/{tid}/comm").read_text().strip() == "agora-stage1"
    finally:
        worker.close()


def test_a_named_threads_cpu_counts_as_the_stage_workers():
    group_cpu_seconds = _swarm_bench().group_cpu_seconds
    proc = subprocess.Popen(
        [sys.executable, "-c", SPIN],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, led by it, as a daemon's is
    )
    try:
        assert proc.stdout.readline().strip() == "spinning"
        before = group_cpu_seconds(proc.pid)  # the start-up (imports) is the main thread's

        def grown(part: str) -> float:
            return group_cpu_seconds(proc.pid).get(part, 0.0) - before.get(part, 0.0)

        deadline = time.monotonic() + 30
        while grown("stage_worker") < 0.5 and time.monotonic() < deadline:
            time.sleep(0.1)  # polling the spinning thread's CPU time
        assert grown("stage_worker") >= 0.5
        assert grown("daemon_other") < 0.2  # the main thread only waits on stdin
        assert set(group_cpu_seconds(proc.pid)) == {"stage_worker", "daemon_other"}
    finally:
        proc.kill()
        proc.wait()
