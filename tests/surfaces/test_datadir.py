"""One daemon per data dir: a second one fails at once naming the first; death frees the dir.

The holder is a real process that takes the lock as `agora-node join` does (the
same function, before anything else); the second daemon is the real CLI.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agora_node.node.commands import prepare_identity
from agora_node.node.datadir import DataDirInUse, lock_data_dir, lock_identity

pytestmark = pytest.mark.timeout(60)

PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWJTjvve5CHTecvRiyBZSEgRN7cHWUDhThRpcBxcUEb3xX"
HOLDER = r"""
import multiprocessing, sys, time
from agora_node.node.datadir import lock_data_dir

def helper(running):
    running.set()  # after-fork hooks have run by now
    time.sleep(120)

lock = lock_data_dir(sys.argv[1])
child = None
if sys.argv[2] == "fork":  # a forked helper without exec, as hivemind's DHT process is
    ctx = multiprocessing.get_context("fork")
    running = ctx.Event()
    child = ctx.Process(target=helper, args=(running,))
    child.start()
    assert running.wait(30)
print(child.pid if child else 0, flush=True)
sys.stdin.read()  # holds until the test closes stdin or kills it
"""


@contextlib.contextmanager
def holder(data_dir: Path, fork: bool = False) -> Iterator[tuple[subprocess.Popen, int]]:
    """A process holding `data_dir` (and the pid of its forked child, or 0)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(data_dir), "fork" if fork else "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    child = 0
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            assert sel.select(timeout=30), "the holder did not take the lock within 30 s"
        child = int(proc.stdout.readline())
        yield proc, child
    finally:
        for pid in (proc.pid, child):
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=10)


def child_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def test_second_join_on_a_data_dir_fails_in_under_a_second_naming_the_first(tmp_path):
    data_dir = tmp_path / "node"
    with holder(data_dir) as (first, _):
        started, cpu_before = time.monotonic(), child_cpu_s()
        second = subprocess.run(
            [sys.executable, "-m", "agora_node", "join", "--initial-peers", PEER]
            + ["--data-dir", str(data_dir), "--status-port", "0"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        elapsed, cpu = time.monotonic() - started, child_cpu_s() - cpu_before
    assert second.returncode == 1, second.stdout + second.stderr
    assert second.stdout == ""
    assert second.stderr.count("\n") == 1, second.stderr
    assert second.stderr.startswith("agora-node: error: data dir ")
    assert f"pid {first.pid}" in second.stderr and "--data-dir" in second.stderr
    # CPU time, not wall time: on an idle machine the wall time is about the same
    # (~0.4 s), but this shared 2-core machine can be loaded 10x. What matters is
    # that the second daemon stops before any real work (torch, hivemind, network).
    assert cpu < 1.0, f"took {cpu:.2f}s of CPU ({elapsed:.2f}s wall)"


def test_a_sigkilled_holder_does_not_block_the_restart(tmp_path):
    with holder(tmp_path) as (first, _):
        with pytest.raises(DataDirInUse, match=f"pid {first.pid}"):
            lock_data_dir(tmp_path)
        first.kill()
        first.wait(timeout=10)
        with lock_data_dir(tmp_path) as lock:
            assert lock.path.read_text() == f"{os.getpid()}\n"


def test_a_forked_child_does_not_keep_the_lock_after_its_parent_died(tmp_path):
    with holder(tmp_path, fork=True) as (first, child):
        first.kill()
        first.wait(timeout=10)
        os.kill(child, 0)  # the child lives on (until the finally)...
        with lock_data_dir(tmp_path):  # ...and does not hold the data dir
            pass


def test_one_process_cannot_take_its_own_data_dir_twice(tmp_path):
    with lock_data_dir(tmp_path):
        with pytest.raises(DataDirInUse, match=f"pid {os.getpid()}"):
            lock_data_dir(tmp_path)
        # A bootstrap and the default node may share ~/.agora-node: another lock name.
        with lock_data_dir(tmp_path, "bootstrap.lock"):
            pass
    with lock_data_dir(tmp_path):
        pass


def test_a_second_join_with_the_same_identity_key_fails_naming_the_fix(tmp_path):
    """Two daemons of one machine with one key would be one peer id in the swarm (found by a
    review: the second ran, and the first lost its peers when it left)."""
    key = tmp_path / "first" / "identity.key"
    prepare_identity(str(key))
    with lock_identity(key):  # the first daemon, in this process
        second = subprocess.run(
            [sys.executable, "-m", "agora_node", "join", "--initial-peers", PEER]
            + ["--data-dir", str(tmp_path / "second"), "--identity-path", str(key)]
            + ["--status-port", "0"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert second.returncode == 1, second.stdout + second.stderr
    assert second.stderr.count("\n") == 1, second.stderr
    assert "identity key" in second.stderr and "--identity-path" in second.stderr
    with lock_identity(key):  # released with the first daemon
        pass


def test_a_bootstrap_holds_its_identity_key_too(tmp_path):
    key = tmp_path / "boot.key"
    prepare_identity(str(key))
    with lock_identity(key):
        second = subprocess.run(
            [sys.executable, "-m", "agora_node", "bootstrap", "--identity-path", str(key)]
            + ["--data-dir", str(tmp_path / "b")],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert second.returncode == 1, second.stdout + second.stderr
    assert "identity key" in second.stderr and "in use" in second.stderr


def test_a_data_dir_other_users_can_write_is_refused(tmp_path, caplog):
    """Whoever can write the data dir can plant its identity key (the node then runs with a
    key they know) or a symlink where the node writes: /tmp itself was accepted."""
    from agora_node.node.datadir import DataDirError

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # as /tmp
    with pytest.raises(DataDirError, match="not private .every user can write it.*chmod o-w"):
        lock_data_dir(shared)
    assert not (shared / "lock").exists()
    team = tmp_path / "team"
    team.mkdir()
    team.chmod(0o770)
    with caplog.at_level("WARNING"), lock_data_dir(team):
        assert "writable by its group" in caplog.text
    with lock_data_dir(tmp_path / "fresh"):  # made by the node: 0700
        assert (tmp_path / "fresh").stat().st_mode & 0o777 == 0o700


def test_files_are_written_under_fresh_names_not_through_planted_symlinks(tmp_path):
    """The identity key went through `identity.key.tmp` and the remembered peers through
    `peers.tmp`, opened following symlinks: a link planted there received the private key
    (a copy readable by its planter) or clobbered the file it named."""
    from agora_node.node import peerbook
    from agora_node.protocol.identity import Identity

    victim = tmp_path / "victim"
    victim.write_text("keep me")
    for planted in ("identity.key.tmp", "peers.tmp"):
        (tmp_path / planted).symlink_to(victim)
    identity = Identity.load_or_create(tmp_path / "identity.key")
    peerbook.save(tmp_path, ["/ip4/127.0.0.1/tcp/1"])
    assert victim.read_text() == "keep me"
    key = tmp_path / "identity.key"
    assert not key.is_symlink() and key.stat().st_mode & 0o777 == 0o600
    assert Identity.load_or_create(key).peer_id == identity.peer_id
    assert json.loads((tmp_path / "peers.json").read_text()) == ["/ip4/127.0.0.1/tcp/1"]


def test_a_link_planted_as_the_lock_is_not_written_through(tmp_path):
    """Whoever could write the data dir planted `lock` as a link: the daemon truncated the
    file it named and wrote its pid there (as root, any file)."""
    from agora_node.node.datadir import DataDirError

    victim = tmp_path / "victim"
    victim.write_text("precious")
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    (data / "lock").symlink_to(victim)
    with pytest.raises(DataDirError):
        lock_data_dir(data)
    assert victim.read_text() == "precious"
    (data / "lock").unlink()
    os.link(victim, data / "lock")  # a hard link: the same file under two names
    with pytest.raises(DataDirError, match="not a plain file of its own"):
        lock_data_dir(data)
    assert victim.read_text() == "precious"
