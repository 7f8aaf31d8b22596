"""Start-up failures a volunteer can cause end in one line naming the cause and the fix.

Each case runs the real CLI in its own process group (stopped by pid in a
finally). None needs a swarm: they all fail before the node dials anyone (the
initial peer below is a closed port that is never reached).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

DEAD = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWJTjvve5CHTecvRiyBZSEgRN7cHWUDhThRpcBxcUEb3xX"
AGORA = [sys.executable, "-m", "agora_node"]


def _run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its reaper stops a DHT child or p2pd, if any
        proc.wait()


def _can_mount() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=4k tmpfs /mnt"]
    return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0


def _in_mount_ns(setup: str, argv: list[str]) -> list[str]:
    """`argv` in a private mount namespace after the shell commands `setup` (root only)."""
    return ["unshare", "-m", "sh", "-c", f"{setup} && exec {shlex.join(argv)}"]


def _join(data_dir: Path, *extra: str) -> list[str]:
    return [*AGORA, "join", "--initial-peers", DEAD, "--data-dir", str(data_dir), *extra]


def _data_dir_is_a_file(tmp: Path) -> list[str]:
    (tmp / "dir").write_text("")
    return _join(tmp / "dir")


def _data_dir_under_a_file(tmp: Path) -> list[str]:
    (tmp / "file").write_text("")
    return _join(tmp / "file" / "dir")


def _read_only_data_dir(tmp: Path) -> list[str]:
    ro = tmp / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
        return _join(ro)
    if not _can_mount():
        pytest.skip("root ignores permissions and cannot mount here (no read-only bind mount)")
    setup = f"mount --bind {ro} {ro} && mount -o remount,bind,ro {ro}"
    return _in_mount_ns(setup, _join(ro))


def _disk_full(tmp: Path) -> list[str]:
    if not _can_mount():
        pytest.skip("needs root and a private mount namespace for a full tmpfs")
    full = tmp / "full"
    full.mkdir()
    setup = f"mount -t tmpfs -o size=4k tmpfs {full} && head -c 4096 /dev/zero > {full}/fill"
    return _in_mount_ns(setup, _join(full / "node"))


def _damaged_identity(tmp: Path) -> list[str]:
    (tmp / "node").mkdir()
    (tmp / "node" / "identity.key").write_bytes(b"not a key\n")
    return _join(tmp / "node")


def _identity_path_under_a_file(tmp: Path) -> list[str]:
    (tmp / "file").write_text("")
    return _join(tmp / "node", "--identity-path", str(tmp / "file" / "me.key"))


def _own_id_not_listed(tmp: Path) -> list[str]:
    from agora_node.protocol.identity import Identity

    (tmp / "keys.txt").write_text(f"# somebody else\n{Identity.generate().peer_id}\n")
    return _join(tmp / "node", "--allow-keys", str(tmp / "keys.txt"))


def _control_socket_under_a_file(tmp: Path) -> list[str]:
    (tmp / "file").write_text("")
    return _join(tmp / "node", "--control-socket", str(tmp / "file" / "c.sock"))


CASES = {
    # before the swarm (whose DEAD initial peer would be the error otherwise)
    "control socket under a file": (_control_socket_under_a_file, "pass --control-socket"),
    "data dir is a file": (_data_dir_is_a_file, "a file is in the way"),
    "data dir under a file": (_data_dir_under_a_file, "pass a --data-dir whose directory"),
    "read-only data dir": (_read_only_data_dir, "pass a --data-dir this user can write"),
    "disk full": (_disk_full, "No space left on device): free some space"),
    "damaged identity key": (_damaged_identity, "restore it from your backup"),
    "identity path not writable": (_identity_path_under_a_file, "pass a --identity-path"),
    "own id not on --allow-keys": (_own_id_not_listed, "does not list this node's own peer id"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_data_dir_or_identity_problem_is_one_line_and_exit_1(case, tmp_path):
    make, needle = CASES[case]
    result = _run(make(tmp_path))
    _one_clear_line(result, needle)
    assert result.returncode == 1


@pytest.mark.parametrize("reuse_port", [False, True], ids=["plain", "another-libp2p-daemon"])
def test_a_busy_libp2p_port_is_one_line_naming_the_flag(tmp_path, reuse_port):
    """A listener with SO_REUSEPORT is what another p2pd holds: this one would have shared
    the port with it (found by a review), not failed."""
    with socket.socket() as busy:
        if reuse_port:
            busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = [*AGORA, "bootstrap", "--data-dir", str(tmp_path / "boot")]
        result = _run([*argv, "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}"])
    _one_clear_line(result, "already in use")
    assert "pass --host-maddrs with another port" in result.stdout + result.stderr
    assert result.returncode == 1


def test_another_daemons_control_socket_fails_before_joining_the_swarm(tmp_path):
    """It failed after the node had chosen a stage and published a record (found by a
    review): other nodes listed a phantom peer. Now it is checked before libp2p starts."""
    with socket.socket(socket.AF_UNIX) as live:
        live.bind(str(tmp_path / "c.sock"))
        live.listen()
        result = _run(_join(tmp_path / "node", "--control-socket", str(tmp_path / "c.sock")))
    _one_clear_line(result, "another agora-node daemon is listening")
    assert result.returncode == 1


def _one_clear_line(result: subprocess.CompletedProcess, needle: str) -> None:
    text = result.stdout + result.stderr
    assert result.returncode != 0, text[-2000:]
    assert "Traceback" not in text, text[-2000:]
    errors = [line for line in text.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and needle in errors[0], text[-2000:]
    assert errors[0] in result.stderr.splitlines(), "the error line goes to stderr"
