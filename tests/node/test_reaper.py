"""The reaper: when its node dies, even by SIGKILL, the node's helpers die and their
unix sockets are removed (a SIGKILLed libp2p daemon cannot remove its own)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agora_node.comms.reaper import Reaper

_NODE = textwrap.dedent(
    """
    import socket, subprocess, sys
    from agora_node.comms.reaper import Reaper

    reaper = Reaper.start()
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(sys.argv[1])
    reaper.watch(helper.pid)
    reaper.remove_on_death(sys.argv[1])
    reaper.remove_on_death(sys.argv[2])  # not a socket: must survive
    print(helper.pid, flush=True)
    sys.stdin.read()
    """
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("whole_group", [False, True])
def test_a_sigkilled_node_leaves_neither_its_helper_nor_its_socket(tmp_path, whole_group):
    """SIGKILL of the node alone, or of its whole process group (the reaper has a session
    of its own, so it survives the latter to clean up)."""
    sock, plain = tmp_path / "p2pd.sock", tmp_path / "notes.txt"
    plain.write_text("keep me")
    node = subprocess.Popen(
        [sys.executable, "-c", _NODE, str(sock), str(plain)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    helper = None
    try:
        helper = int(node.stdout.readline())
        assert sock.exists() and _alive(helper)
        if whole_group:
            os.killpg(node.pid, signal.SIGKILL)
        else:
            node.send_signal(signal.SIGKILL)
        node.wait(timeout=10)
        deadline = time.monotonic() + 20
        while (sock.exists() or _alive(helper)) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling under a deadline
        assert not sock.exists(), "the socket outlived its node"
        assert not _alive(helper), "the helper outlived its node"
        assert plain.read_text() == "keep me"  # only sockets are removed
    finally:
        node.kill()
        node.wait()
        if helper is not None and _alive(helper):
            os.kill(helper, signal.SIGKILL)


_NODE_WITHOUT_DEATH_SIGNAL = textwrap.dedent(
    """
    import os, subprocess, sys
    from agora_node.comms.reaper import Reaper

    # a reaper the kernel will not signal when we die (its PR_SET_PDEATHSIG disarmed),
    # whose stdin a child of ours holds open too (as the DHT process, a fork, does): only
    # its own check of its parent can tell it we died
    disarmed = (
        "import sys; from agora_node.comms import reaper; "
        "reaper.set_parent_death_signal = lambda: None; reaper._main(int(sys.argv[1]))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", disarmed, str(os.getpid())],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )
    reaper = Reaper(proc)
    helper = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], pass_fds=[proc.stdin.fileno()]
    )
    reaper.watch(helper.pid)
    print(helper.pid, proc.pid, flush=True)
    sys.stdin.read()
    """
)


def _handles_sigterm(pid: int) -> bool:
    """Has `pid` a SIGTERM handler, with SIGTERM not blocked (/proc/PID/status)?"""
    try:
        fields = dict(
            line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        )
    except OSError:
        return False
    bit = 1 << (signal.SIGTERM - 1)
    return bool(int(fields["SigCgt"], 16) & bit) and not int(fields["SigBlk"], 16) & bit


def test_a_reaper_that_missed_its_parent_s_death_signal_still_acts():
    node = subprocess.Popen(
        [sys.executable, "-c", _NODE_WITHOUT_DEATH_SIGNAL],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    helper = reaper = None
    try:
        helper, reaper = map(int, node.stdout.readline().split())
        # its SIGTERM handler installed and unblocked: past the check at its start, which
        # would find a parent dead already
        deadline = time.monotonic() + 20
        while not _handles_sigterm(reaper) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling under a deadline
        assert _alive(helper) and _handles_sigterm(reaper)
        node.send_signal(signal.SIGKILL)
        node.wait(timeout=10)
        deadline = time.monotonic() + 20
        while (_alive(helper) or _alive(reaper)) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling under a deadline
        assert not _alive(helper), "the helper outlived its node"
        assert not _alive(reaper), "the reaper outlived its node"
    finally:
        node.kill()
        node.wait()
        for pid in (helper, reaper):
            if pid is not None and _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_remove_on_death_refuses_a_path_that_could_smuggle_a_second_line():
    from agora_node.comms.reaper import Reaper

    reaper = Reaper(None)
    with pytest.raises(ValueError):
        reaper.remove_on_death("/tmp/a.sock\n123")
    with pytest.raises(ValueError):
        reaper.remove_on_death("relative.sock")


def _tagged_sockets(tag: str) -> list[str]:
    return [p for p in os.listdir("/tmp") if p.startswith(f"hivemind-{tag}-")]


@pytest.mark.timeout(120)
def test_libp2p_daemons_leave_no_socket_when_they_fail_to_start_or_die_first(monkeypatch):
    """Two ways hivemind left p2pd's socket in /tmp: the daemon exits while starting (no
    initial peer answered; hivemind names the socket inside `create`, out of our reach),
    or a signal to the process group ends it before `shutdown` (hivemind then removes
    the daemon's socket only if the daemon still runs)."""
    import asyncio

    from hivemind.p2p import P2PDaemonError

    from agora_node.comms import host

    tags = iter(["feedc0de", "c0ffee00"])
    monkeypatch.setattr(host.secrets, "token_hex", lambda n: next(tags))
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWJTjvve5CHTecvRiyBZSEgRN7cHWUDhThRpcBxcUEb3xX"

    async def scenario() -> None:
        with pytest.raises(P2PDaemonError):
            await host.create_p2p(initial_peers=[dead], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        assert _tagged_sockets("feedc0de") == []
        p2p = await host.create_p2p(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        assert _tagged_sockets("c0ffee00")  # the daemon's (our client's once it serves)
        p2p._child.terminate()  # as a SIGTERM to the group would
        await p2p._child.wait()
        await host.shutdown_p2p(p2p, 10.0)
        assert _tagged_sockets("c0ffee00") == []

    asyncio.run(scenario())


@pytest.mark.timeout(30)
def test_a_reaper_is_told_from_other_processes():
    """What chaos.py and the outer harness spare when they kill a node's processes."""
    from agora_node.comms.reaper import Reaper, is_reaper

    reaper = Reaper.start()
    try:
        # its command line is the reaper's once it has exec'd (not at once: the start
        # returns after the fork, 4 failures in 6 runs on a busy machine)
        deadline = time.monotonic() + 10
        while not is_reaper(reaper._proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert is_reaper(reaper._proc.pid)
        assert not is_reaper(os.getpid())
    finally:
        reaper.stop()


@pytest.mark.timeout(30)
def test_a_clean_stop_kills_what_the_node_did_not_stop_and_spares_a_reused_pid():
    """A shutdown that left a helper running (say one that ignored its stop) must not leave
    it behind; a pid whose process is no longer the one watched (its start time differs:
    the pid was reused) is spared."""
    from agora_node.comms.reaper import Reaper

    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    survivor, stranger = subprocess.Popen(sleeper), subprocess.Popen(sleeper)
    reaper = Reaper.start()
    try:
        reaper.watch(survivor.pid)
        reaper._proc.stdin.write(f"{stranger.pid} 1\n".encode())  # another process's pid now
        reaper._proc.stdin.flush()
        reaper.stop()
        assert survivor.wait(timeout=10) == -signal.SIGKILL
        with pytest.raises(subprocess.TimeoutExpired):  # a wrong kill would land meanwhile
            stranger.wait(timeout=0.5)
    finally:
        for proc in (survivor, stranger):
            proc.kill()
            proc.wait()


_GRPC_NODE = textwrap.dedent(
    """
    import asyncio, sys, time
    from pathlib import Path
    import grpc
    from agora_node.comms.reaper import Reaper

    def handles_sigterm(pid):  # its handler installed, SIGTERM not blocked: running
        try:
            lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        except OSError:
            return False
        fields = dict(line.split(":\\t", 1) for line in lines)
        return bool(int(fields["SigCgt"], 16) & 0x4000) and not int(fields["SigBlk"], 16) & 0x4000

    async def main():
        server = grpc.aio.server()
        server.add_insecure_port(f"unix:{sys.argv[1]}")
        await server.start()
        dead = []
        for _ in range(int(sys.argv[2])):
            reaper = Reaper.start()
            deadline = time.monotonic() + 20
            while reaper._proc.poll() is None and not handles_sigterm(reaper._proc.pid):
                assert time.monotonic() < deadline, "a reaper neither started nor died"
                await asyncio.sleep(0.01)  # polling under a deadline
            if reaper._proc.poll() is not None:
                dead.append(reaper._proc.returncode)
            reaper.stop()
        await server.stop(None)
        print(dead, flush=True)

    asyncio.run(main())
    """
)


@pytest.mark.timeout(120)
def test_reapers_started_by_a_process_serving_grpc_all_live(tmp_path):
    """A node serves its control API over gRPC (control.py). A reaper started with a
    preexec_fn ran Python and gRPC's fork handlers between fork and exec, and gRPC aborted
    it there: 5-8 reapers of 100 died at birth (SIGABRT; seen in a process of its own,
    not inside pytest's), and a node without a reaper left its DHT process and libp2p
    daemon running when it was killed."""
    done = subprocess.run(
        [sys.executable, "-c", _GRPC_NODE, str(tmp_path / "control.sock"), "100"],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


def test_a_reaper_that_exited_is_warned_about_once(caplog) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"], stdin=subprocess.PIPE)
    proc.wait(timeout=30)
    reaper = Reaper(proc)
    with caplog.at_level(logging.WARNING, logger="agora_node.comms.reaper"):
        for path in ("/tmp/a.sock", "/tmp/b.sock", "/tmp/c.sock"):
            reaper.remove_on_death(path)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        f"the reaper (pid {proc.pid}) exited with code 0"
    ]
    proc.stdin.close()


_ARMED = textwrap.dedent(
    """
    import ctypes, os
    from agora_node.comms import reaper
    reaper.die_with_parent()
    armed = ctypes.c_int()
    ctypes.CDLL("libc.so.6").prctl(2, ctypes.byref(armed))  # PR_GET_PDEATHSIG
    print(armed.value, os.environ.get(reaper.DIE_WITH_PARENT_ENV))
    """
)


@pytest.mark.parametrize("parent", ["ours", "gone", "garbage"])
def test_a_node_told_to_die_with_its_parent_checks_it_is_still_there(parent) -> None:
    """The demo's nodes arm their own death signal (no preexec_fn): with the parent named
    they go on (the variable removed, so their own children do not act on it); when the
    parent named is not theirs (it died before they armed) they end by SIGTERM at once."""
    value = {"ours": str(os.getpid()), "gone": "0", "garbage": "x"}[parent]
    env = {**os.environ, "AGORA_DIE_WITH_PARENT": value}
    done = subprocess.run(
        [sys.executable, "-c", _ARMED], env=env, capture_output=True, text=True, timeout=60
    )
    if parent == "ours":
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [str(int(signal.SIGTERM)), "None"]  # armed, not passed on
    else:
        assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr)
