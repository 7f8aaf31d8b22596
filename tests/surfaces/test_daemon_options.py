"""Daemon options from their dataclasses: precedence, one-line errors, default data dirs.

Every case is generated from NodeConfig's fields: a new option is covered
without editing this file (add a sample value below if its text is validated).
"""

from __future__ import annotations

import atexit
import json
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agora_node.node import commands
from agora_node.node.cli import build_parser, main
from agora_node.node.config import BootstrapConfig, NodeConfig, PipelineConfig
from agora_node.node.options import Option, options_of
from agora_node.protocol.manifest import Manifest

pytestmark = pytest.mark.timeout(60)

PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWJTjvve5CHTecvRiyBZSEgRN7cHWUDhThRpcBxcUEb3xX"
# Four distinct valid texts (toml, env, cli, and one spare) for options whose text is validated.
SAMPLES = {
    "stage": ["1", "2", "3", "4"],
    "manifest": ["bench", "gpu-1b", "tiny", "bench"],
    "activation_codec": ["int8", "int4", "fp32", "bf16"],
    "emulate_link": ["10,1", "20,2", "30,3", "40,4"],
    "mqtt_url": ["mqtt://127.0.0.1:1883", "mqtt://b.example:1884", "mqtts://b.example", "mqtt://h"],
    "device": ["cpu", "cuda:1", "mps", "cuda"],  # names are checked at start, machines later
    "precision": ["fp32", "bf16", "auto", "fp32"],
    "optimizer_states": ["8bit", "fp32", "8bit", "fp32"],  # two formats: file and cli share one
    "optimizer_step": ["in-backward", "after-backward", "in-backward", "after-backward"],
    "relay_for_others": ["off", "on", "off", "on"],
    # each longer than the default --refresh (3 s), as a record must outlive a refresh
    "record_ttl": [5.5, 6.5, 7.5, 8.5],
    "refresh": [0.5, 1.5, 2.5, 3.5],
    "initial_peers": [[PEER.replace("127.0.0.1", f"10.0.0.{i}")] for i in range(1, 5)],
}
JOIN_OPTIONS = options_of(NodeConfig)


def _sample_files(prefix: str, text: Callable[[int], str]) -> list[str]:
    """Four valid files for an option that checks its file when it is resolved (owner-only,
    as a login file must be), removed at exit."""
    folder = Path(tempfile.mkdtemp(prefix=f"agora-{prefix}-"))
    atexit.register(shutil.rmtree, folder, True)
    paths = []
    for i in range(4):
        path = folder / f"{prefix}-{i}"
        path.write_text(text(i))
        path.chmod(0o600)
        paths.append(str(path))
    return paths


def _peer_id(_i: int) -> str:
    from agora_node.protocol.identity import Identity

    return Identity.generate().peer_id + "\n"


SAMPLES["allow_keys"] = _sample_files("allow-keys", _peer_id)
SAMPLES["mqtt_login"] = _sample_files("mqtt-login", lambda i: f"user{i}:password{i}\n")


def samples(opt: Option) -> list[Any]:
    """Four distinct valid values, as a TOML file would hold them."""
    if opt.name in SAMPLES:
        return SAMPLES[opt.name]
    if opt.kind is list:
        return [[f"/ip4/10.0.0.{i}/tcp/1"] for i in range(1, 5)]
    if opt.kind is int:
        return [1, 2, 3, 4]
    if opt.kind is float:
        return [1.5, 2.5, 3.5, 4.5]
    return [f"/tmp/agora-{opt.name}-{i}" for i in range(1, 5)]


def as_text(value: Any) -> str:
    return " ".join(value) if isinstance(value, list) else str(value)


def resolved(config: Any, opt: Option) -> Any:
    for name in opt.path:
        config = getattr(config, name)
    return config.run_id if isinstance(config, Manifest) else config


def expected(opt: Option, value: Any) -> Any:
    if opt.name == "manifest":
        from agora_node.stages.manifest_files import load_manifest

        return load_manifest(value).run_id
    if opt.kind is float:
        return float(value)
    return value


def join(
    argv: list[str], env: dict[str, str], toml: Path | None = None, peers: bool = True
) -> NodeConfig:
    """`agora-node join ARGV` resolved against `env` and the TOML file, as cmd_join does."""
    base = ["join", "--initial-peers", PEER] if peers else ["join"]
    config = ["--config", str(toml)] if toml else []
    args = build_parser().parse_args([*base, *argv, *config])
    return commands.resolve_config(args, NodeConfig, env=env)


def write_toml(path: Path, name: str, value: Any) -> Path:
    text = json.dumps(value)  # JSON scalars and string lists are valid TOML values
    path.write_text(f"{name.replace('_', '-')} = {text}\n")
    return path


def test_every_option_has_a_flag_a_variable_and_a_key():
    names = {o.name for o in JOIN_OPTIONS}
    assert {"refresh", "record_ttl", "checkpoint_every", "eval_every", "rebalance_every"} <= names
    assert {"max_in_flight", "activation_codec", "emulate_link", "data_dir"} <= names
    assert len(names) == len(JOIN_OPTIONS)
    flags = {o.flag for o in JOIN_OPTIONS}
    assert "--refresh" in flags and "--max-in-flight" in flags
    assert {o.env for o in JOIN_OPTIONS} >= {"AGORA_REFRESH", "AGORA_ACTIVATION_CODEC"}
    refresh = next(o for o in JOIN_OPTIONS if o.name == "refresh")
    assert refresh.path == ("refresh_s",)
    codec = next(o for o in JOIN_OPTIONS if o.name == "activation_codec")
    assert codec.path == ("pipeline", "activation_codec")


@pytest.mark.parametrize("opt", JOIN_OPTIONS, ids=lambda o: o.name)
def test_precedence_cli_over_env_over_file_over_default(opt: Option, tmp_path: Path):
    in_file, in_env, on_cli, _ = samples(opt)
    toml = write_toml(tmp_path / "agora.toml", opt.name, in_file)
    cli = [opt.flag, *as_text(on_cli).split()]
    env = {opt.env: as_text(in_env)}
    other = tmp_path / "dir"  # keeps path options from depending on $HOME
    keep = [] if opt.name == "data_dir" else ["--data-dir", str(other)]
    if opt.name == "mqtt_login":  # a login needs a broker
        keep += ["--mqtt-url", "mqtt://127.0.0.1:1883"]
    peers = opt.name != "initial_peers"

    assert resolved(join([*keep, *cli], env, toml, peers), opt) == expected(opt, on_cli)
    assert resolved(join(keep, env, toml, peers), opt) == expected(opt, in_env)
    assert resolved(join(keep, {}, toml, peers), opt) == expected(opt, in_file)
    if opt.name not in ("initial_peers", "data_dir", "identity_path", "control_socket"):
        assert resolved(join(keep, {}), opt) == resolved(NodeConfig(initial_peers=[PEER]), opt)


def test_the_config_file_may_come_from_agora_config(tmp_path: Path):
    """The help says every option can come from the environment: AGORA_CONFIG was ignored
    without a word, and the node ran on defaults."""
    toml = tmp_path / "node.toml"
    toml.write_text('stage = "0"\nthreads = 1\n')
    config = join(["--data-dir", str(tmp_path / "d")], {"AGORA_CONFIG": str(toml)})
    assert (config.stage, config.threads) == ("0", 1)
    other = write_toml(tmp_path / "other.toml", "threads", 3)  # --config wins over it
    assert (
        join(["--data-dir", str(tmp_path / "d")], {"AGORA_CONFIG": str(toml)}, other).threads == 3
    )


def test_derived_paths_and_lists_resolve():
    config = join(
        ["--data-dir", "/srv/a"], {"AGORA_HOST_MADDRS": "/ip4/1.2.3.4/tcp/1 /ip6/::1/tcp/2"}
    )
    assert config.identity_path == "/srv/a/identity.key"
    assert config.control_socket == "/srv/a/control.sock"
    assert config.host_maddrs == ["/ip4/1.2.3.4/tcp/1", "/ip6/::1/tcp/2"]
    assert config.pipeline == PipelineConfig()


INVALID = [
    # (option, bad text, what the one line says)
    ("refresh", "soon", "is not a number"),
    ("status_port", "8421.5", "is not an integer"),
    ("max_in_flight", "-1", "--max-in-flight must be at least 0"),
    ("stage", "two", "--stage must be 'auto' or a stage number"),
    ("stage", "²", "--stage must be 'auto' or a stage number"),  # str.isdigit() says yes
    ("relay_for_others", "maybe", "expected on or off, not 'maybe'"),
    ("hop_timeout", "0", "--hop-timeout must be positive"),
    ("hop_timeout", "nan", "--hop-timeout must be positive"),
    ("hop_timeout", "inf", "--hop-timeout must be a finite number"),
    ("refresh", "100", "must be shorter than --record-ttl"),
    ("activation_codec", "int3", "--activation-codec must be one of"),
    ("checkpoint_every", "0", "--checkpoint-every must be positive"),
    ("emulate_link", "fast", "--emulate-link"),
    ("manifest", "nope-not-a-file", "not found"),
    ("mqtt_url", "http://127.0.0.1:1883", "--mqtt-url: 'http://127.0.0.1:1883' must start with"),
    ("allow_keys", "/nonexistent/keys.txt", "--allow-keys /nonexistent/keys.txt: no such"),
    ("ban", "-5", "--ban must be at least 0"),
    ("ban", "inf", "--ban must be a finite number"),
    ("device", "tpu", "--device must be one of auto, cpu, cuda, cuda:N, mps"),
    ("precision", "fp16", "--precision must be one of auto, fp32, bf16"),
    ("optimizer_states", "int4", "--optimizer-states must be one of fp32, 8bit"),
    ("optimizer_step", "fused", "--optimizer-step must be one of after-backward, in-backward"),
]


@pytest.mark.parametrize("source", ["cli", "env", "toml"])
@pytest.mark.parametrize(("name", "bad", "says"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_value_in_each_source_is_one_line_and_exit_2(
    source, name, bad, says, tmp_path, monkeypatch, capsys
):
    opt = next(o for o in JOIN_OPTIONS if o.name == name)
    argv = ["join", "--initial-peers", PEER, "--data-dir", str(tmp_path / "d")]
    if source == "cli":
        argv += [opt.flag, bad]
    elif source == "env":
        monkeypatch.setenv(opt.env, bad)
    else:
        argv += ["--config", str(write_toml(tmp_path / "a.toml", name, bad))]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("agora-node: error: "), err
    assert says in err and "Traceback" not in err
    if "is not" in says or "expected" in says:  # a conversion error names where the text was
        assert {"cli": opt.flag, "env": opt.env, "toml": f"a.toml: {name}"}[source] in err
    elif says.startswith(opt.flag) and source != "cli":  # so does a range check, after it
        assert {"env": f"(set by {opt.env})", "toml": f"(set by {name} in "}[source] in err
    assert not (tmp_path / "d").exists()  # refused before anything was created


def test_toml_type_and_unknown_key_errors_are_one_line(tmp_path, capsys):
    for text, says in [
        ("host-maddrs = 5\n", "is not a list of strings"),
        ("threads = 1.5\n", "is not an integer"),
        ("refresh_s = 3\n", "unknown option(s) refresh_s"),
        ("status-port = 1\nstatus_port = 2\n", "given twice (with - and _): status_port"),
        ("refresh = \n", "--config"),
    ]:
        path = tmp_path / "c.toml"
        path.write_text(text)
        assert main(["join", "--initial-peers", PEER, "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err


@pytest.mark.parametrize("command", ["join", "bootstrap"])
@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("notamultiaddr", "expected /ip4/"),
        ("/ip4/127.0.0.1/tcp/9", "expected /ip4/"),  # no /p2p/ part
        # well-formed, with a part that is not: they failed after start-up, exit 1
        ("/ip4/999.0.0.1/tcp/1/p2p/" + PEER.rsplit("/", 1)[-1], "is not IPv4"),
        ("/ip4/127.0.0.1/tcp/1/p2p/" + "1" * 40, "multihash"),
    ],
)
def test_an_initial_peer_that_is_no_peer_address_is_one_line(command, bad, why, tmp_path, capsys):
    """Checked before anything starts (it was libp2p's raw log line, after 3 s, exit 1); its
    form before the data dir is taken, its parts (hivemind's parser) right after."""
    assert main([command, "--initial-peers", bad, "--data-dir", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a peer address" in err and why in err, err
    if why.startswith("expected"):
        assert not (tmp_path / "d").exists()


def test_join_without_initial_peers_is_one_line(capsys):
    assert main(["join"]) == 2
    assert "join needs --initial-peers" in capsys.readouterr().err


def test_default_data_dirs_differ_per_identity(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    home = tmp_path / ".agora-node"
    plain = NodeConfig(initial_peers=[PEER])
    assert (plain.data_dir, plain.identity_path) == (str(home), str(home / "identity.key"))
    assert plain.control_socket == str(home / "control.sock")
    same = NodeConfig(initial_peers=[PEER], identity_path="~/.agora-node/identity.key")
    assert same.data_dir == str(home)  # naming the default identity keeps the default dir

    one = NodeConfig(initial_peers=[PEER], identity_path=str(tmp_path / "keys" / "one.key"))
    two = NodeConfig(initial_peers=[PEER], identity_path=str(tmp_path / "keys" / "two.key"))
    assert one.data_dir == str(home / "nodes" / "one")
    assert two.data_dir == str(home / "nodes" / "two")
    assert one.control_socket != two.control_socket
    assert one.identity_path == str(tmp_path / "keys" / "one.key")

    chosen = NodeConfig(initial_peers=[PEER], identity_path="/k/one.key", data_dir="/srv/x")
    assert chosen.data_dir == "/srv/x"  # --data-dir always wins

    boot = BootstrapConfig()
    assert (boot.data_dir, boot.identity_path) == (str(home), str(home / "bootstrap.key"))
    assert BootstrapConfig(identity_path="/k/entry.key").data_dir == str(home / "nodes" / "entry")


def test_dry_run_prints_the_resolved_dataclass(tmp_path, capsys):
    argv = ["bootstrap", "--data-dir", str(tmp_path), "--manifest", "bench", "--dry-run"]
    assert main(argv) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("config: ")
    shown = json.loads(first.removeprefix("config: "))
    assert shown["data_dir"] == str(tmp_path)
    assert shown["identity_path"] == str(tmp_path / "bootstrap.key")
    from agora_node.stages.manifest_files import load_manifest

    assert shown["manifest"] == load_manifest("bench").run_id


def test_dry_run_of_a_context_parallel_run_shows_memory_per_peer_with_and_without_cells(
    tmp_path, capsys
):
    argv = ["bootstrap", "--data-dir", str(tmp_path), "--manifest", "long", "--dry-run"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    alone = re.findall(r"^  activation_bytes\s+([\d.]+) MiB", out, re.MULTILINE)
    in_cell = re.findall(r"cell of 2 .*activation_bytes ([\d.]+) MiB", out)
    assert len(alone) == len(in_cell) == 4  # one line each per stage
    assert all(float(c) < 0.6 * float(a) for a, c in zip(alone, in_cell, strict=True))


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["train-local", "--threads", "-1"], "--threads must be positive"),
        (["train-local", "--checkpoint-dir", "{file}"], "is a file: pass a directory"),
        (["manifest", "check", "--manifest", "{latin1}"], "is not UTF-8 text"),
        (["demo", "--interval", "-1"], "--interval must be >= 0"),
        (["demo", "--minutes", "nan"], "--minutes must be >= 0"),
        (["demo", "--eval-every", "0"], "must be positive"),
    ],
    ids=["threads", "checkpoint-dir", "manifest-encoding", "interval", "minutes", "eval-every"],
)
def test_other_commands_refuse_bad_values_in_one_line(argv, says, tmp_path, capsys):
    """Each was a traceback (found by a review), raised after torch had loaded or later."""
    (tmp_path / "file").write_text("")
    (tmp_path / "latin1.toml").write_bytes("[run]\nname = 'caf\xe9'\n".encode("latin-1"))
    paths = {"{file}": str(tmp_path / "file"), "{latin1}": str(tmp_path / "latin1.toml")}
    assert main([paths.get(a, a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and "Traceback" not in err, err
