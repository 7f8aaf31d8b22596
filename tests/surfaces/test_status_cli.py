"""`agora-node status` and `agora-node leave` against live servers, and with nothing listening."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from agora_node.node.control import ControlServer
from agora_node.node.status_cli import register

from .test_control import FakeHandlers

pytestmark = pytest.mark.timeout(60)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="agora-node")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


async def run(argv: list[str]) -> int:
    # The commands block (urllib, asyncio.run); a thread keeps this loop serving them.
    args = parse(argv)
    return await asyncio.to_thread(args.func, args)


async def test_status_table(status_server, capsys):
    assert await run(["status", "--url", status_server.url]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(
        "this node  12D3KooWSe...AAAAAA  run 3f2a1b0c9d8e  stage 1/3  active"
    )
    assert (
        "compute 1234.5 tok/compute-s" in lines[1]
        and "dropped 1" in lines[1]
        and "loss 3.8120" in lines[1]
    )
    assert "stage 1  (2 peers)" in out and "stage 2  (0 peers)" in out
    assert "(no peer serves this stage)" in out
    self_row = next(line for line in lines if line.startswith("  * "))
    assert self_row.split()[2:6] == ["active", "1234.5", "2", "3"]
    assert any("leaving" in line for line in lines)


async def test_status_json(status_server, capsys):
    assert await run(["status", "--url", status_server.url + "/", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["status"]["stage"] == 1 and len(body["peers"]["stages"]) == 3


async def test_status_takes_the_status_url_itself(status_server, capsys):
    """`--url http://host:port/api/v1/status` (the address a browser shows) got the path
    twice, a 404, and "is the daemon running?"."""
    assert await run(["status", "--url", status_server.url + "/api/v1/status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"]["stage"] == 1


@pytest.mark.parametrize("command", ["status", "leave"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "x"])
def test_a_timeout_must_be_a_positive_number_of_seconds(command, value, capsys):
    """`leave --timeout -1` said the daemon did not finish within -1 s; `status --timeout 0`
    that no daemon ran."""
    with pytest.raises(SystemExit) as exit_:
        parse([command, "--timeout", value])
    assert exit_.value.code == 2 and "--timeout" in capsys.readouterr().err


async def test_status_unreachable(status_server, capsys):
    url = status_server.url
    await status_server.stop()  # the port is now closed
    assert await run(["status", "--url", url, "--timeout", "2"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith(f"agora-node: error: no agora-node status endpoint at {url}")
    assert "Traceback" not in captured.err


HOLDER = """
import sys
from agora_node.node.datadir import lock_data_dir
lock = lock_data_dir(sys.argv[1])
print("held", flush=True)
sys.stdin.read()  # until the test closes stdin (the daemon's exit) or kills it
"""


def daemon_process(data_dir: Path) -> subprocess.Popen:
    """A process holding `data_dir` as a daemon does (its pid in the lock file)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(data_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline() == "held\n"
    return proc


class Leaving(FakeHandlers):
    """A daemon that, asked to leave, stops its control API and exits a moment later (its
    drain and checkpoint): the process holding its data dir, when given one."""

    def __init__(self, process: subprocess.Popen | None = None) -> None:
        super().__init__()
        self.server: ControlServer | None = None
        self.process = process
        self.stopped: asyncio.Task | None = None

    async def leave(self) -> dict:
        result = await super().leave()
        asyncio.get_running_loop().call_later(0.3, self._exit)
        return result

    def _exit(self) -> None:
        if self.process is not None:
            self.process.stdin.close()  # it exits
        self.stopped = asyncio.ensure_future(self.server.stop())


async def serve(handlers: FakeHandlers, sock: Path) -> ControlServer:
    server = ControlServer(sock, handlers)
    handlers.server = server
    await server.start()
    return server


async def test_leave(tmp_path: Path, capsys):
    sock = tmp_path / "control.sock"
    handlers = Leaving()
    server = await serve(handlers, sock)
    try:
        assert await run(["leave", "--control-socket", str(sock)]) == 0
    finally:
        await server.stop()
    assert handlers.calls == [("leave", None)]
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "the daemon left: state leaving, checkpoint /ckpt/step-120.pt"


async def test_leave_waits_until_the_daemon_has_exited(tmp_path: Path, capsys):
    """The answer to Leave only says it began (found by a review: `leave` returned while the
    daemon still drained, so `leave && poweroff` could cut off the checkpoint)."""
    daemon = daemon_process(tmp_path)
    try:
        server = await serve(Leaving(daemon), tmp_path / "control.sock")
        try:
            assert await run(["leave", "--data-dir", str(tmp_path)]) == 0
            assert daemon.poll() is not None  # it returned only once the daemon had exited
        finally:
            await server.stop()
        # a daemon that does not exit within --timeout is an error, not "left"
        stuck = daemon_process(tmp_path)
        server = await serve(FakeHandlers(), tmp_path / "control.sock")
        try:
            assert await run(["leave", "--data-dir", str(tmp_path), "--timeout", "1"]) == 1
        finally:
            await server.stop()
            stuck.kill()
            stuck.wait(timeout=10)
    finally:
        daemon.kill()
        daemon.wait(timeout=10)
    assert "but still ran after 1 s" in capsys.readouterr().err


async def test_leave_finds_the_daemons_default_socket_in_its_data_dir(
    tmp_path: Path, capsys, monkeypatch
):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))  # a login session: not used
    named = tmp_path / ".agora-node" / "nodes" / "a"
    for argv, sock in (([], tmp_path / ".agora-node"), (["--data-dir", str(named)], named)):
        sock.mkdir(parents=True, exist_ok=True)
        server = await serve(Leaving(), sock / "control.sock")
        try:
            assert await run(["leave", *argv]) == 0, capsys.readouterr()
        finally:
            await server.stop()


async def test_leave_without_daemon(tmp_path: Path, capsys):
    sock = tmp_path / "control.sock"
    assert await run(["leave", "--control-socket", str(sock)]) == 1
    err = capsys.readouterr().err
    assert err == f"agora-node: error: no agora-node daemon listening on {sock}\n"


def test_node_lines_list_the_runs_when_the_swarm_serves_several():
    from agora_node.node.status_cli import format_node

    one = {"peer_id": "p", "runs_seen": [{"run_id": "aa", "name": "tiny"}]}
    assert "runs in this swarm" not in format_node(one)
    two = {"runs_seen": [{"run_id": "aa", "name": "tiny"}, {"run_id": "bb", "name": "x"}]}
    assert "runs in this swarm: aa ('tiny'), bb ('x')" in format_node(two)


def test_the_node_line_says_when_peers_could_not_dial_it():
    from agora_node.node.status_cli import format_node

    assert "NOT DIALABLE" not in format_node({"reachability": {"state": "reachable"}})
    assert "NOT DIALABLE" not in format_node({})  # not checked yet, or an older daemon
    assert "NOT DIALABLE by peers" in format_node({"reachability": {"state": "unreachable"}})
    relayed = {"reachability": {"state": "unreachable"}, "relay": {"relays": ["Zz99Yy88"]}}
    assert "NOT DIALABLE by peers  RELAYED via Zz99Yy88" in format_node(relayed)
    assert "RELAYED" not in format_node({"relay": {"addrs": [], "relays": []}})


def test_the_node_line_names_the_other_members_of_its_cell():
    from agora_node.node.status_cli import format_node

    me, other = "12D3KooW" + "a" * 40 + "Me000001", "12D3KooW" + "b" * 40 + "Other002"
    cell = {"role": "helper", "members": [other, me]}
    assert "CELL helper with 12D3KooWbb...her002" in format_node({"peer_id": me, "cell": cell})
    assert "CELL" not in format_node({"peer_id": me, "cell": {"role": "alone", "members": [me]}})
    assert "CELL" not in format_node({"peer_id": me, "cell": None})


async def test_status_of_a_port_that_is_not_http_is_one_line(capsys):
    """A libp2p port answers with multistream-select, not HTTP (was a BadStatusLine traceback)."""

    async def libp2p_like(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"\x13/multistream/1.0.0\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(libp2p_like, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        assert await run(["status", "--url", url, "--timeout", "5"]) == 1
    finally:
        server.close()
        await server.wait_closed()
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1, captured.err
    assert "did not return agora-node status" in captured.err


def test_the_stage_table_says_what_swim_and_bans_know():
    """A peer SIGKILLed showed as `active` until its record expired (SWIM had declared it
    dead seconds before), and a banned liar as plain `active`."""
    from agora_node.node.status_cli import format_table

    peers = {
        "stages": [
            {
                "stage": 1,
                "peers": [
                    {"peer_id": "12D3KooWdeadpeer0001", "state": "active", "swim": "dead"},
                    {"peer_id": "12D3KooWliarpeer0002", "state": "active", "swim": "alive"},
                    {"peer_id": "12D3KooWgoodpeer0003", "state": "active", "swim": "alive"},
                ],
            }
        ]
    }
    status = {"suspects": {"banned": [{"peer": "12D3KooWliarpeer0002", "reason": "canary"}]}}
    rows = format_table(status, peers).splitlines()
    dead, liar, good = (next(r for r in rows if key in r) for key in ("0001", "0002", "0003"))
    assert dead.rstrip().endswith("swim dead") and liar.rstrip().endswith("banned")
    assert "swim" not in good and "banned" not in good
