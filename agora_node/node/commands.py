"""`agora-node bootstrap` and `agora-node join`: options, their precedence, and dry runs.

Every daemon option resolves as: command line > `AGORA_<OPTION>` environment
variable > `--config` TOML file > default. The resolved configuration is logged
at start and printed by `--dry-run`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import tomllib
from pathlib import Path
from typing import Any

from agora_node.node.errors import EXIT_FAILURE, EXIT_OK, UsageError
from agora_node.stages.manifest_files import load_manifest

log = logging.getLogger(__name__)

# option -> (default, type, help)
JOIN_OPTIONS: dict[str, tuple[Any, type, str]] = {
    "initial_peers": ([], list, "multiaddrs of peers already in the swarm (any live one works)"),
    "stage": ("auto", str, "'auto' (the stage the swarm needs most) or a stage number"),
    "manifest": (
        None,
        str,
        "a local manifest that must match the swarm's (default: take the swarm's)",
    ),
    "identity_path": (
        None,
        str,
        "libp2p identity key file, created 0600 if missing (default DATA_DIR/identity.key)",
    ),
    "data_dir": ("~/.agora-node", str, "checkpoints and identity live here"),
    "host_maddrs": (
        ["/ip4/127.0.0.1/tcp/0"],
        list,
        "listen multiaddrs (use /ip4/0.0.0.0/tcp/PORT to be reachable)",
    ),
    "announce_maddrs": ([], list, "multiaddrs to announce to peers (public address and port)"),
    "status_host": ("127.0.0.1", str, "status page address"),
    "status_port": (8421, int, "status page port (0: any free port)"),
    "control_socket": (None, str, "control API Unix socket (default DATA_DIR/control.sock)"),
    "threads": (0, int, "torch threads (0: torch's default)"),
    "max_in_flight": (
        0,
        int,
        "micro-batches a stage-0 node keeps in flight (0: one inner step's worth)",
    ),
    "checkpoint_every": (300.0, float, "seconds between checkpoints"),
    "eval_every": (60.0, float, "seconds between validation losses (stage 0)"),
    "activation_codec": ("bf16", str, "boundary activations on the wire: fp32, bf16, int8, int4"),
    "max_tokens": (
        0,
        int,
        "stage 0: stop injecting after this many tokens and evaluate (0: never)",
    ),
    "record_ttl": (15.0, float, "seconds a directory record lives unless refreshed"),
    "refresh": (3.0, float, "seconds between record refreshes and directory reads"),
    "rebalance_every": (
        60.0,
        float,
        "mean seconds between stage re-evaluations of a --stage auto node (0: never)",
    ),
    "emulate_link": ("", str, "benchmarks: shape this node's uplink as 'MBIT_PER_S,LATENCY_MS'"),
}


def add_daemon_options(
    p: argparse.ArgumentParser, options: dict[str, tuple[Any, type, str]]
) -> None:
    p.add_argument("--config", help="TOML file with options (keys as the long flags, with _ or -)")
    for name, (default, kind, text) in options.items():
        flag = "--" + name.replace("_", "-")
        shown = f" (default: {default})" if default not in (None, [], "") else ""
        if kind is list:
            p.add_argument(flag, nargs="+", default=None, help=text + shown)
        else:
            p.add_argument(flag, type=kind, default=None, help=text + shown)


def resolve_options(
    args: argparse.Namespace,
    options: dict[str, tuple[Any, type, str]],
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """CLI > AGORA_* environment > --config file > defaults."""
    env = os.environ if env is None else env
    file_values: dict[str, Any] = {}
    if getattr(args, "config", None):
        try:
            raw = tomllib.loads(Path(args.config).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise UsageError(f"--config {args.config}: {exc}") from None
        file_values = {k.replace("-", "_"): v for k, v in raw.items()}
        unknown = set(file_values) - set(options)
        if unknown:
            raise UsageError(
                f"--config {args.config}: unknown option(s) {', '.join(sorted(unknown))}"
            )
    resolved = {}
    for name, (default, kind, _) in options.items():
        value = getattr(args, name, None)
        if value is None and f"AGORA_{name.upper()}" in env:
            text = env[f"AGORA_{name.upper()}"]
            value = text.split() if kind is list else _convert(name, text, kind)
        if value is None:
            value = file_values.get(name, default)
        resolved[name] = value
    return resolved


def _convert(name: str, text: str, kind: type) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise UsageError(f"AGORA_{name.upper()}={text!r} is not a valid {kind.__name__}") from None


def _node_config(opts: dict[str, Any]):  # noqa: ANN202
    from agora_node.node.config import NodeConfig
    from agora_node.node.pipeline import PipelineConfig

    if opts["stage"] != "auto" and not str(opts["stage"]).isdigit():
        raise UsageError(f"--stage must be 'auto' or a stage number, not {opts['stage']!r}")
    if opts["activation_codec"] not in ("fp32", "bf16", "int8", "int4"):
        raise UsageError(
            f"--activation-codec must be fp32, bf16, int8 or int4, not {opts['activation_codec']!r}"
        )
    data_dir = Path(opts["data_dir"]).expanduser()
    return NodeConfig(
        initial_peers=list(opts["initial_peers"]),
        identity_path=str(
            Path(opts["identity_path"]).expanduser()
            if opts["identity_path"]
            else data_dir / "identity.key"
        ),
        data_dir=str(data_dir),
        stage=str(opts["stage"]),
        manifest=load_manifest(opts["manifest"]) if opts["manifest"] else None,
        host_maddrs=list(opts["host_maddrs"]),
        announce_maddrs=list(opts["announce_maddrs"]),
        status_host=opts["status_host"],
        status_port=int(opts["status_port"]),
        control_socket=opts["control_socket"] or str(data_dir / "control.sock"),
        threads=int(opts["threads"]),
        checkpoint_every_s=float(opts["checkpoint_every"]),
        eval_every_s=float(opts["eval_every"]),
        max_tokens=int(opts["max_tokens"]),
        record_ttl_s=float(opts["record_ttl"]),
        refresh_s=float(opts["refresh"]),
        rebalance_every_s=float(opts["rebalance_every"]),
        pipeline=PipelineConfig(
            max_in_flight=int(opts["max_in_flight"]), activation_codec=opts["activation_codec"]
        ),
    )


def cmd_join(args: argparse.Namespace) -> int:
    opts = resolve_options(args, JOIN_OPTIONS)
    if not opts["initial_peers"]:
        raise UsageError("join needs --initial-peers (the line `agora-node bootstrap` printed)")
    config = _node_config(opts)
    if opts["emulate_link"]:
        from agora_node.comms import linkemu

        try:
            linkemu.configure(linkemu.LinkSpec.parse(opts["emulate_link"]))
        except ValueError as exc:
            raise UsageError(f"--emulate-link: {exc}") from None
    if args.dry_run:
        return asyncio.run(_dry_run(config))
    import torch

    from agora_node.node.daemon import run_node

    if config.threads:
        torch.set_num_threads(config.threads)
    log.info("config: %s", json.dumps(opts, default=str))
    return _run_daemon(run_node(config))


def _run_daemon(coro) -> int:  # noqa: ANN001
    from agora_node.comms.host import HostError
    from agora_node.node.control import ControlError
    from agora_node.node.errors import JoinError
    from agora_node.node.status_server import StatusServerError

    try:
        return asyncio.run(coro)
    except (HostError, JoinError, StatusServerError, ControlError) as exc:
        print(f"agora-node: error: {exc}", flush=True)
        return EXIT_FAILURE


async def _dry_run(config) -> int:  # noqa: ANN001
    """Join the DHT read-only: fetch the manifest and directory, print the choice, leave."""
    from agora_node.comms.directory import Directory, fetch_manifest
    from agora_node.comms.host import Host, HostConfig
    from agora_node.protocol.identity import Identity
    from agora_node.stages import placement

    identity = Identity.load_or_create(config.identity_path)
    host = await Host.start(
        HostConfig(identity_path=config.identity_path, initial_peers=config.initial_peers)
    )
    try:
        manifest = await fetch_manifest(host, config.manifest)
        view = await Directory(host, identity, manifest.run_id, manifest.num_stages).fetch()
        if config.stage == "auto":
            choice = placement.choose_stage(view, manifest, identity.peer_id)
            stage, reason = choice.stage, choice.reason
        else:
            stage, reason = int(config.stage), "fixed by --stage"
        print_stage_plan(manifest, stage, reason, view)
    finally:
        await host.shutdown()
    return EXIT_OK


def print_stage_plan(manifest, stage: int, reason: str, view: dict | None = None) -> None:  # noqa: ANN001
    from agora_node.stages import placement

    if not 0 <= stage < manifest.num_stages:
        raise UsageError(
            f"--stage {stage} does not exist: this run has stages 0..{manifest.num_stages - 1}"
        )
    mem = placement.stage_memory_bytes(manifest, stage, optimizer=manifest.inner.optimizer)
    print(f"run {manifest.run_id} ({manifest.run.name}), {manifest.num_stages} stages")
    if view is not None:
        print(
            "directory: "
            + ", ".join(f"stage {s}: {len(r)} node(s)" for s, r in sorted(view.items()))
        )
    print(f"would serve stage {stage}: {reason}")
    print(f"layers {list(manifest.stage_layers(stage))}, memory needed:")
    for part, value in mem.items():
        print(f"  {part:<22} {value / 2**20:10.1f} MiB")


def cmd_bootstrap(args: argparse.Namespace) -> int:
    from agora_node.node.bootstrap import run_bootstrap

    opts = resolve_options(args, BOOTSTRAP_OPTIONS)
    manifest = load_manifest(opts["manifest"])
    data_dir = Path(opts["data_dir"]).expanduser()
    identity = (
        Path(opts["identity_path"]).expanduser()
        if opts["identity_path"]
        else data_dir / "bootstrap.key"
    )
    if args.dry_run:
        print(
            f"run {manifest.run_id} ({manifest.run.name}); identity {identity}; listen {opts['host_maddrs']}"
        )
        for stage in range(manifest.num_stages):
            print_stage_plan(manifest, stage, "per-stage requirements")
        return EXIT_OK
    return _run_daemon(
        run_bootstrap(
            manifest,
            str(identity),
            list(opts["host_maddrs"]),
            list(opts["announce_maddrs"]),
            list(opts["initial_peers"]),
        )
    )


BOOTSTRAP_OPTIONS: dict[str, tuple[Any, type, str]] = {
    "manifest": ("tiny", str, "builtin manifest name or TOML path of the run to serve"),
    "identity_path": (
        None,
        str,
        "libp2p identity key file (default DATA_DIR/bootstrap.key): a stable peer id",
    ),
    "data_dir": ("~/.agora-node", str, "where the identity lives"),
    "host_maddrs": (
        ["/ip4/127.0.0.1/tcp/0"],
        list,
        "listen multiaddrs (use /ip4/0.0.0.0/tcp/PORT to be reachable)",
    ),
    "announce_maddrs": ([], list, "multiaddrs to announce (public address and port)"),
    "initial_peers": ([], list, "other entry points of the same swarm, if any"),
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("join", help="join a swarm and serve the stage it needs most")
    add_daemon_options(p, JOIN_OPTIONS)
    p.add_argument(
        "--dry-run", action="store_true", help="print the chosen stage, its memory and why; exit"
    )
    p.set_defaults(func=cmd_join)
    p = sub.add_parser(
        "bootstrap", help="an entry point: publish a run's manifest, print the join line"
    )
    add_daemon_options(p, BOOTSTRAP_OPTIONS)
    p.add_argument(
        "--dry-run", action="store_true", help="print the run and per-stage memory; exit"
    )
    p.set_defaults(func=cmd_bootstrap)
