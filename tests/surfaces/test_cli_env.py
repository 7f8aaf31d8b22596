"""Commands and the AGORA_* environment (found by a review): `leave` and `status` find the
daemon the environment configured, `demo` keeps the operator's AGORA_* options away from
its nodes; and bad `--stage` / `--nodes` values are usage errors (exit 2)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from agora_node.node.cli import main
from agora_node.node.demo import Swarm, child_env
from agora_node.node.errors import JoinError, UsageError
from agora_node.node.joining import fixed_stage
from agora_node.node.status_cli import default_url, leave_target
from agora_node.stages.manifest_files import load_manifest

from .test_status_cli import Leaving, run, serve

pytestmark = pytest.mark.timeout(60)

OPERATOR = {
    "PATH": "/usr/bin",
    "AGORA_HOST_MADDRS": "/ip4/0.0.0.0/tcp/31337",
    "AGORA_IDENTITY_PATH": "/home/me/.agora-node/identity.key",
    "AGORA_STAGE": "1",
    "AGORA_ALLOW_KEYS": "/etc/agora/allow",
    "AGORA_MQTT_URL": "mqtt://broker",
    "AGORA_DATA_DIR": "/var/lib/agora-node",
    "AGORA_MALLOC_TRIM": "0",
}


# -- demo: the nodes' environment ---------------------------------------------------


def test_demo_nodes_do_not_inherit_the_operators_node_options():
    env = child_env(OPERATOR)
    assert not {k for k in env if k.startswith("AGORA_")} - {"AGORA_MALLOC_TRIM"}
    assert env["PATH"] == "/usr/bin" and env["AGORA_MALLOC_TRIM"] == "0"  # not a node option
    assert env["PYTHONUNBUFFERED"] == "1" and env["OMP_NUM_THREADS"] == "1"


def test_what_the_demo_sets_explicitly_is_kept():
    env = child_env(OPERATOR, {"AGORA_STAGE": "0", "OMP_NUM_THREADS": "2"})
    assert env["AGORA_STAGE"] == "0" and env["OMP_NUM_THREADS"] == "2"
    assert "AGORA_HOST_MADDRS" not in env


def test_a_spawned_node_sees_no_agora_option(tmp_path: Path, monkeypatch):
    (tmp_path / "envdump.py").write_text(
        "import json, os\n"
        "print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('AGORA_')}))\n"
    )
    for key, value in OPERATOR.items():
        if key != "PATH":
            monkeypatch.setenv(key, value)
    swarm = Swarm(tmp_path)
    child = swarm.spawn(
        "dump", [], module="envdump", env={"PYTHONPATH": str(tmp_path), "AGORA_RUN": "x"}
    )
    assert child.proc.wait(timeout=30) == 0
    seen = json.loads(child.log_path.read_text())
    # the starter's pid is no option: a node takes it out at start (reaper.die_with_parent)
    parent = {"AGORA_DIE_WITH_PARENT": str(os.getpid())}
    assert seen == {"AGORA_MALLOC_TRIM": "0", "AGORA_RUN": "x", **parent}


# -- demo --nodes ---------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "-3"])
def test_demo_refuses_fewer_than_one_node(value, capsys):
    assert main(["demo", "--nodes", value]) == 2
    err = capsys.readouterr().err
    assert f"argument --nodes: must be at least 1, not {int(value)}" in err, err


@pytest.mark.parametrize("port", ["65535", "-3"])
def test_demo_refuses_status_ports_out_of_range_before_starting_anything(port, capsys):
    """Node-1's status port 65536 failed 12 s in, with its reason only in its log."""
    assert main(["demo", "--nodes", "2", "--base-port", port]) == 2
    err = capsys.readouterr().err
    assert f"--base-port {port}: the 2 nodes' status ports must lie in 1..65535" in err, err


def test_demo_nodes_defaults_to_two_per_stage():
    from agora_node.node.cli import build_parser

    args = build_parser().parse_args(["demo"])
    assert args.nodes is None  # cmd_demo: 2 * num_stages
    assert build_parser().parse_args(["demo", "--nodes", "3"]).nodes == 3


# -- --stage N out of range -------------------------------------------------------------


def test_a_stage_the_run_lacks_is_a_usage_error_as_under_dry_run():
    manifest = load_manifest("tiny")
    last = manifest.num_stages - 1
    assert fixed_stage(manifest, str(last)) == last
    with pytest.raises(UsageError) as caught:
        fixed_stage(manifest, "9")
    assert not isinstance(caught.value, JoinError)
    assert str(caught.value) == f"--stage 9 does not exist: this run has stages 0..{last}"


# -- leave and status: the daemon's environment ---------------------------------------


def leave_args(*argv: str) -> argparse.Namespace:
    from .test_status_cli import parse

    return parse(["leave", *argv])


def test_leave_target_follows_flags_then_the_environment(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    home = tmp_path / ".agora-node"
    env = {"AGORA_DATA_DIR": "/var/lib/agora-node"}
    var = Path("/var/lib/agora-node")
    assert leave_target(leave_args(), {}) == (home / "control.sock", home)
    assert leave_target(leave_args(), env) == (var / "control.sock", var)
    assert leave_target(leave_args(), {"AGORA_DATA_DIR": ""}) == (home / "control.sock", home)
    # the default data dir the daemon takes for a named identity
    named = {"AGORA_IDENTITY_PATH": str(tmp_path / "gpu0.key")}
    assert leave_target(leave_args(), named)[1] == home / "nodes" / "gpu0"
    both = {**env, "AGORA_CONTROL_SOCKET": "/run/agora.sock"}
    assert leave_target(leave_args(), both) == (Path("/run/agora.sock"), var)
    # explicit flags win over the environment
    mine = tmp_path / "mine"
    assert leave_target(leave_args("--data-dir", str(mine)), both) == (mine / "control.sock", mine)
    sock = tmp_path / "s.sock"
    assert leave_target(leave_args("--control-socket", str(sock)), both) == (sock, None)


async def test_leave_uses_agora_data_dir_like_the_daemon(tmp_path: Path, monkeypatch, capsys):
    """Under the systemd unit (AGORA_DATA_DIR=/var/lib/agora-node) `leave` looked in
    ~/.agora-node."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    data_dir = tmp_path / "var-lib"
    data_dir.mkdir()
    monkeypatch.setenv("AGORA_DATA_DIR", str(data_dir))
    server = await serve(Leaving(), data_dir / "control.sock")
    try:
        assert await run(["leave"]) == 0, capsys.readouterr()
    finally:
        await server.stop()
    assert f"asking the daemon on {data_dir / 'control.sock'}" in capsys.readouterr().out


def test_status_url_follows_the_daemons_environment():
    assert default_url({}) == "http://127.0.0.1:8421"
    assert default_url({"AGORA_STATUS_PORT": "9000"}) == "http://127.0.0.1:9000"
    assert default_url({"AGORA_STATUS_PORT": ""}) == "http://127.0.0.1:8421"
    assert default_url({"AGORA_STATUS_HOST": "0.0.0.0"}) == "http://127.0.0.1:8421"
    assert default_url({"AGORA_STATUS_HOST": "::", "AGORA_STATUS_PORT": "1"}) == "http://[::1]:1"
    assert default_url({"AGORA_STATUS_HOST": "10.0.0.2"}) == "http://10.0.0.2:8421"


async def test_status_uses_agora_status_port(status_server, monkeypatch, capsys):
    monkeypatch.setenv("AGORA_STATUS_PORT", str(status_server.port))
    assert await run(["status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"]["stage"] == 1
    # an explicit --url wins
    monkeypatch.setenv("AGORA_STATUS_PORT", "1")
    assert await run(["status", "--url", f"http://127.0.0.1:{status_server.port}"]) == 0


def test_the_dry_runs_memory_follows_max_in_flight_on_a_head(capsys):
    """`join --dry-run --max-in-flight N` sized stage 0 with the default in flight."""
    from agora_node.node.commands import print_stage_plan
    from agora_node.node.worker import MAX_GRAPHS

    manifest = load_manifest("demo")
    print_stage_plan(manifest, 0, "fixed by --stage", max_in_flight=5)
    assert "memory needed with 5 micro-batch(es) in flight" in capsys.readouterr().out
    print_stage_plan(manifest, 0, "fixed by --stage", max_in_flight=100000)
    assert f"with {MAX_GRAPHS} micro-batch(es) in flight" in capsys.readouterr().out  # recomputed
    print_stage_plan(manifest, 0, None)  # a bootstrap's listing: it serves no stage
    out = capsys.readouterr().out
    assert "stage 0:" in out and "would serve" not in out


def test_a_manifest_from_the_swarm_may_not_name_this_machines_files_for_the_head(tmp_path):
    """A stranger's manifest with data.source = /proc/self/environ passed every check, and
    the head sent that file's bytes, as token ids, to the next stages."""
    import dataclasses

    from agora_node.stages.data import head_data_missing

    secret = tmp_path / "environ"
    secret.write_text("TOKEN=hunter2\n")
    demo = load_manifest("demo")
    theirs = dataclasses.replace(demo, data=dataclasses.replace(demo.data, source=str(secret)))
    assert head_data_missing(theirs, local=True) is None  # the operator's own manifest: fine
    why = head_data_missing(theirs, local=False)
    assert why is not None and "named by the swarm's manifest" in why and str(secret) in why
    assert head_data_missing(demo, local=False) is None  # the built-in corpus is fine


def test_leave_and_status_find_a_daemon_configured_by_its_file(tmp_path: Path, monkeypatch):
    """A daemon whose data dir, control socket or status port came from its --config file
    was not found: `leave` read only flags and the environment."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = tmp_path / "node.toml"
    cfg.write_text('data-dir = "/srv/n1"\nstatus_port = 9100\n')
    file = {"data_dir": "/srv/n1", "status_port": 9100}
    from agora_node.node.status_cli import daemon_file

    assert daemon_file(leave_args("--config", str(cfg)), {}) == file
    assert daemon_file(leave_args(), {"AGORA_CONFIG": str(cfg)}) == file
    n1 = Path("/srv/n1")
    assert leave_target(leave_args(), {}, file) == (n1 / "control.sock", n1)
    # the environment wins over the file, as for the daemon
    var = {"AGORA_DATA_DIR": "/var/lib/agora-node"}
    assert leave_target(leave_args(), var, file)[1] == Path("/var/lib/agora-node")
    sock = {"control_socket": "/run/a.sock", "identity_path": str(tmp_path / "gpu0.key")}
    assert leave_target(leave_args(), {}, sock) == (Path("/run/a.sock"), None)
    named = leave_target(leave_args(), {}, {"identity_path": str(tmp_path / "gpu0.key")})
    assert named[1] == tmp_path / ".agora-node" / "nodes" / "gpu0"
    assert default_url({}, file) == "http://127.0.0.1:9100"
    assert default_url({"AGORA_STATUS_PORT": "9000"}, file) == "http://127.0.0.1:9000"


def test_a_broken_agora_config_does_not_stop_leave(tmp_path: Path, capsys):
    """AGORA_CONFIG naming a file `leave` cannot use (another command's, broken) made it
    exit 2 with the daemon still running, even with --data-dir given."""
    from agora_node.node.status_cli import daemon_file

    broken = tmp_path / "bootstrap.toml"
    broken.write_text("no-such-option = 1\n")
    assert daemon_file(leave_args(), {"AGORA_CONFIG": str(broken)}) == {}
    assert "warning" in capsys.readouterr().err
    with pytest.raises(UsageError):  # given on purpose: an error
        daemon_file(leave_args("--config", str(broken)), {})
