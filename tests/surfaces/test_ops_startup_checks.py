"""Operator mistakes refused at start, and a key that does not depend on the directory.

`--host-maddrs` / `--announce-maddrs` garbage is one line and exit 2, under `--dry-run`
too, before the status page, the control API or libp2p start (it was accepted by the
dry run, and the real join failed only after the status page and control API had
started). A bare `--identity-path NAME.key` is a key in the data dir: the same command
run from two directories is the same peer.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agora_node.node.cli import main
from agora_node.node.config import BootstrapConfig, NodeConfig, check_maddrs
from agora_node.node.status_cli import leave_target

PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWJTjvve5CHTecvRiyBZSEgRN7cHWUDhThRpcBxcUEb3xX"


# ---- multiaddrs ----------------------------------------------------------------------


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "join"])
@pytest.mark.parametrize("flag", ["--host-maddrs", "--announce-maddrs"])
def test_a_malformed_multiaddr_is_one_line_and_exit_2(flag, dry_run, tmp_path, capsys):
    data_dir = tmp_path / "d"
    argv = ["join", "--initial-peers", PEER, "--data-dir", str(data_dir), "--status-port", "0"]
    argv += [flag, "garbage"] + ["--dry-run"] * dry_run
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.count("\n") == 1, err
    assert err.startswith(f"agora-node: error: {flag}: invalid multiaddr 'garbage'"), err
    assert "config:" not in captured.out and "peer id" not in captured.out
    assert not (data_dir / "control.sock").exists()  # nothing started
    assert not (data_dir / "identity.key").exists()


def test_a_malformed_multiaddr_from_the_environment_or_a_file(tmp_path, monkeypatch, capsys):
    argv = ["join", "--initial-peers", PEER, "--data-dir", str(tmp_path / "d"), "--dry-run"]
    monkeypatch.setenv("AGORA_HOST_MADDRS", "/ip4/0.0.0.0/tcp/31337 /ip4/1.2.3.4/tcp/port")
    assert main(argv) == 2
    assert "--host-maddrs: invalid multiaddr '/ip4/1.2.3.4/tcp/port'" in capsys.readouterr().err
    monkeypatch.delenv("AGORA_HOST_MADDRS")
    config = tmp_path / "agora.toml"
    config.write_text('announce-maddrs = ["ip4/1.2.3.4/tcp/1"]\n')
    assert main([*argv, "--config", str(config)]) == 2
    assert "--announce-maddrs: invalid multiaddr" in capsys.readouterr().err


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "bootstrap"])
def test_bootstrap_refuses_a_malformed_multiaddr_too(dry_run, tmp_path, capsys):
    argv = ["bootstrap", "--data-dir", str(tmp_path), "--host-maddrs", "/ip4/0.0.0.0/tcp/x"]
    assert main(argv + ["--dry-run"] * dry_run) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--host-maddrs: invalid multiaddr" in err, err


def test_well_formed_multiaddrs_pass():
    config = NodeConfig(
        initial_peers=[PEER],
        data_dir="/srv/x",
        host_maddrs=["/ip4/0.0.0.0/tcp/31337", "/ip6/::/tcp/31337"],
        announce_maddrs=["/ip4/203.0.113.7/tcp/31337", "/dns4/node.example.org/tcp/31337"],
    )
    check_maddrs(config)
    check_maddrs(BootstrapConfig(data_dir="/srv/x"))


# ---- where the identity key is -----------------------------------------------------


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home" / ".agora-node"


def test_a_bare_key_name_is_the_same_key_from_any_directory(home, tmp_path, monkeypatch):
    seen = []
    for cwd in (tmp_path / "a", tmp_path / "b" / "c"):
        cwd.mkdir(parents=True)
        monkeypatch.chdir(cwd)
        config = NodeConfig(initial_peers=[PEER], identity_path="gpu0.key")
        seen.append((config.data_dir, config.identity_path))
    node_dir = home / "nodes" / "gpu0"
    assert seen == [(str(node_dir), str(node_dir / "gpu0.key"))] * 2
    assert NodeConfig(initial_peers=[PEER], identity_path="gpu0.key").control_socket == str(
        node_dir / "control.sock"
    )
    # `leave` finds the same data dir from AGORA_IDENTITY_PATH
    from .test_status_cli import parse

    env = {"AGORA_IDENTITY_PATH": "gpu0.key"}
    assert leave_target(parse(["leave"]), env) == (node_dir / "control.sock", node_dir)


def test_key_paths_with_data_dirs_and_directories(home, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    chosen = NodeConfig(initial_peers=[PEER], identity_path="gpu0.key", data_dir="/srv/n1")
    assert (chosen.data_dir, chosen.identity_path) == ("/srv/n1", "/srv/n1/gpu0.key")
    here = NodeConfig(initial_peers=[PEER], identity_path="./gpu0.key")  # a directory part
    assert here.identity_path == str(tmp_path / "gpu0.key")  # as given, made absolute
    assert here.data_dir == str(home / "nodes" / "gpu0")
    keys = NodeConfig(initial_peers=[PEER], identity_path="keys/gpu0.key", data_dir="/srv/n1")
    assert keys.identity_path == str(tmp_path / "keys" / "gpu0.key")
    absolute = NodeConfig(initial_peers=[PEER], identity_path="/k/one.key")
    assert (absolute.data_dir, absolute.identity_path) == (
        str(home / "nodes" / "one"),
        "/k/one.key",
    )
    default = NodeConfig(initial_peers=[PEER], identity_path="identity.key")
    assert (default.data_dir, default.identity_path) == (str(home), str(home / "identity.key"))
    boot = BootstrapConfig(identity_path="entry.key")
    assert boot.identity_path == str(home / "nodes" / "entry" / "entry.key")
    assert BootstrapConfig(identity_path="bootstrap.key").identity_path == str(
        home / "bootstrap.key"
    )


def test_a_key_left_in_the_current_directory_is_not_silently_replaced(
    home, tmp_path, monkeypatch, capsys
):
    """Earlier versions kept `--identity-path gpu0.key` in the current directory: a new
    key in the data dir would have made the node a new peer without a word."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpu0.key").write_bytes(b"old key")
    argv = ["join", "--initial-peers", PEER, "--identity-path", "gpu0.key", "--dry-run"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    key = home / "nodes" / "gpu0" / "gpu0.key"
    assert err.count("\n") == 1 and f"names {key}" in err and str(tmp_path / "gpu0.key") in err
    assert "--identity-path ./gpu0.key" in err
    assert not key.exists() and not key.parent.exists()  # refused before anything was made
    key.parent.mkdir(parents=True)
    key.write_bytes(b"moved key")  # once moved (or present), the data dir's key is the one
    assert NodeConfig(initial_peers=[PEER], identity_path="gpu0.key").identity_path == str(key)
    monkeypatch.chdir(key.parent)  # run from the data dir itself: the same file
    assert NodeConfig(initial_peers=[PEER], identity_path="gpu0.key").identity_path == str(key)
