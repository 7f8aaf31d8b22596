"""node/run.py: what stop signals do to a node in each phase (a stand-in Node: the real
one's signals are tests/integration/test_signals.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from agora_node.node import run

pytestmark = pytest.mark.timeout(30)


class _CountingEvent(asyncio.Event):
    """An Event that counts its `set` calls (the signal handler's one visible effect)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.called = asyncio.Condition()

    def set(self) -> None:
        self.calls += 1
        super().set()
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self.called:
            self.called.notify_all()

    async def wait_calls(self, n: int) -> None:
        async with self.called:
            await self.called.wait_for(lambda: self.calls >= n)


class _Node:
    """Joins at once; its leave waits until `release` is set."""

    def __init__(self, config, compute) -> None:  # noqa: ANN001
        self.stop_event = _CountingEvent()
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.refused = None
        self.failure = None
        self.checkpoint_error = None
        self.peer_id = "me"
        self.service = type("S", (), {"index": 0})()
        self._status = type("P", (), {"port": 1})()
        self.admittance = type("A", (), {"reload": staticmethod(lambda: None)})()
        self.left = self.closed = False
        self.leaving = asyncio.Event()
        _Node.last = self

    async def start(self) -> None:
        self.started.set()

    async def leave(self) -> None:
        self.leaving.set()
        await self.release.wait()
        self.left = True

    async def close(self) -> None:
        self.closed = True


class _Config:
    status_host = "127.0.0.1"

    def __init__(self) -> None:
        import tempfile

        self.data_dir = tempfile.mkdtemp(prefix="agora-run-signals-")  # where left.json goes


async def _started(monkeypatch) -> tuple[asyncio.Task, _Node]:  # noqa: ANN001
    created = asyncio.Event()
    monkeypatch.setattr(run, "Node", lambda *a: _created(created, *a))
    task = asyncio.create_task(run.run_node(_Config(), None))
    await asyncio.wait_for(created.wait(), 5)
    node = _Node.last
    await asyncio.wait_for(node.started.wait(), 5)
    return task, node


def _created(created: asyncio.Event, *args) -> _Node:  # noqa: ANN002
    node = _Node(*args)
    created.set()
    return node


@pytest.fixture(autouse=True)
def _no_last():
    _Node.last = None


async def test_a_second_signal_during_the_leave_cuts_it_short(monkeypatch) -> None:
    task, node = await _started(monkeypatch)
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(node.leaving.wait(), 5)
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(task, 5) == run.EXIT_FORCED
    assert not node.left and node.closed


async def test_a_signal_after_a_leave_request_lets_the_leave_finish(monkeypatch) -> None:
    """`agora-node leave` sets the stop event without a signal; the SIGTERM that
    `systemctl stop` sends after it is the first signal, so the leave goes on."""
    task, node = await _started(monkeypatch)
    node.stop_event.set()  # what the control API's Leave does
    await asyncio.wait_for(node.leaving.wait(), 5)
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(node.stop_event.wait_calls(2), 5)  # the handler ran
    node.release.set()
    assert await asyncio.wait_for(task, 5) == 0
    assert node.left and node.closed


async def test_a_node_that_left_because_a_loop_failed_exits_1(monkeypatch) -> None:
    """It exited 0 like a node told to leave, so `Restart=on-failure` never restarted it."""
    task, node = await _started(monkeypatch)
    node.failure = OSError(28, "No space left on device")  # what Node._loop_failed records
    node.stop_event.set()
    await asyncio.wait_for(node.leaving.wait(), 5)
    node.release.set()
    assert await asyncio.wait_for(task, 5) == run.EXIT_FAILED == 1
    assert node.left and node.closed


_SLOW_IMPORT = """
import sys, time
class Slow:  # the command's imports, held long enough to signal the process during them
    def find_spec(self, name, path=None, target=None):
        if name == "agora_node.node.cli":
            print("importing", flush=True)
            time.sleep(30)
        return None
sys.meta_path.insert(0, Slow())
from agora_node.__main__ import run
run()
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_during_the_commands_imports_is_a_clean_exit(sig):
    """The first seconds (torch's import) met Python's default: killed, exit -15, silent."""
    _stop_while_importing(sig, _SLOW_IMPORT)


def _stop_while_importing(sig: signal.Signals, script: str, *args: str) -> None:
    """Run `script` until it says it is importing, send `sig`: a clean exit, saying so."""
    with _python(script, *args) as proc:
        assert proc.stdout.readline() == b"importing\n"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert f"stopped while starting ({sig.name})".encode() in err


@contextlib.contextmanager
def _python(script: str, *args: str, **popen) -> Iterator[subprocess.Popen]:
    """`python -c script args`, its output piped, killed by its pid if still running."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **popen,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_signal_ignored_by_the_caller_stays_ignored_while_starting():
    """nohup's SIGHUP is ignored: it was made to stop the command, and then reset to the
    default (a hangup killed a nohup'ed train-local)."""
    ignore_hup = lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)  # noqa: E731
    with _python(_SLOW_IMPORT, preexec_fn=ignore_hup) as proc:
        assert proc.stdout.readline() == b"importing\n"
        proc.send_signal(signal.SIGHUP)  # ignored
        proc.send_signal(signal.SIGTERM)  # stops it: a signal after the first is handled
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0 and b"(SIGTERM)" in err and b"SIGHUP" not in err


_SLOW_DAEMON_IMPORT = """
import sys, time
class Slow:  # `join`'s own imports after its checks (the daemon's code), held
    def find_spec(self, name, path=None, target=None):
        if name == "agora_node.node.run":
            print("importing", flush=True)
            time.sleep(30)
        return None
sys.meta_path.insert(0, Slow())
sys.argv = ["agora-node", "join", "--initial-peers", sys.argv[1], "--data-dir", sys.argv[2],
            "--stage", "0", "--manifest", "demo", "--threads", "1"]
from agora_node.__main__ import run
run()
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGQUIT])
def test_a_stop_before_the_daemons_loop_handles_signals_is_a_clean_exit(tmp_path, sig):
    """The command's imports were covered, but `join` spends seconds more importing
    hivemind and torch for its checks and the daemon's code: a signal then killed it,
    exit -15 (SIGQUIT -3), silent."""
    peer = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWJTjvve5CHTecvRiyBZSEgRN7cHWUDhThRpcBxcUEb3xX"
    data_dir = tmp_path / "node"
    _stop_while_importing(sig, _SLOW_DAEMON_IMPORT, peer, str(data_dir))
    from agora_node.node import datadir

    with datadir.lock_data_dir(str(data_dir)):  # released: the next daemon may start
        pass


_SLOW_EXIT = """
import atexit, sys, time
def slow_exit():  # the interpreter's shutdown, which took 1.5-8 s after a daemon left
    print("exiting", flush=True)
    time.sleep(3)
atexit.register(slow_exit)
sys.argv = ["agora-node", "--version"]
from agora_node.__main__ import run
run()
"""


def test_a_stop_signal_while_the_process_exits_is_ignored():
    """After a daemon left, Python's own shutdown took seconds: a second Ctrl-C or SIGTERM
    then killed the process (exit -2 or -15), though the node had left cleanly."""
    with _python(_SLOW_EXIT) as proc:
        assert proc.stdout.readline().startswith(b"agora-node ")  # --version: the command ran
        assert proc.stdout.readline() == b"exiting\n"
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
