"""`agora-node bootstrap` and `agora-node join`: options, their precedence, and dry runs.

Every daemon option resolves as: command line > `AGORA_<OPTION>` environment
variable > `--config` TOML file > default; NodeConfig and BootstrapConfig
(node/config.py) define them all. A daemon first takes its data dir's lock (one
daemon per data dir), then logs the resolved configuration; `--dry-run` prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agora_node import signals
from agora_node.node import datadir, options
from agora_node.node.config import BootstrapConfig, NodeConfig, check_maddrs, config_dict
from agora_node.node.errors import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, UsageError

log = logging.getLogger(__name__)


def add_daemon_options(p: argparse.ArgumentParser, cls: type) -> None:
    p.add_argument("--config", help="TOML file with options (keys as the long flags, with _ or -)")
    options.add_arguments(p, cls)


def resolve_config(
    args: argparse.Namespace, cls: type, env: Mapping[str, str] | None = None
) -> Any:
    """CLI > AGORA_* environment > --config file > defaults, validated by the dataclass.
    The file itself may come from AGORA_CONFIG (as every option, the help says)."""
    env = os.environ if env is None else env
    path, name = options.config_file(getattr(args, "config", None), env)
    file_values = options.read_config_file(path, cls, name) if path else {}
    return options.resolve(cls, vars(args), env, file_values, f"{name} {path}")


def config_json(config: Any) -> str:
    return json.dumps(config_dict(config))


def prepare_identity(path: str) -> None:
    """Read the identity key, or create it, before the daemon starts: a damaged key or
    a place that cannot be written is one line naming the fix, not a traceback."""
    from agora_node.protocol.identity import Identity, IdentityError

    try:
        Identity.load_or_create(path)
    except IdentityError as exc:
        raise datadir.DataDirError(
            f"identity key {path}: {exc}: restore it from your backup, or move it away "
            "to start as a new peer"
        ) from None
    except OSError as exc:
        raise datadir.unusable(Path(path), exc, "identity key", "--identity-path") from None


def _hold_identity(stack: contextlib.ExitStack, path: str) -> None:
    """Hold the key file while this daemon runs (datadir.lock_identity), where it can be."""
    lock = datadir.lock_identity(path)
    if lock is not None:
        stack.enter_context(lock)


def cmd_join(args: argparse.Namespace) -> int:
    config = resolve_config(args, NodeConfig)
    with contextlib.ExitStack() as stack:
        stack.enter_context(signals.while_starting())  # until the daemon's loop handles them
        stack.enter_context(datadir.lock_data_dir(config.data_dir))  # a second daemon fails at once
        check_maddrs(config)  # imports hivemind: after the lock, before anything starts
        # Probing the device imports torch (about a second): after the lock, before the key.
        compute = _resolve_compute(config)
        if compute is None:
            return EXIT_USAGE
        prepare_identity(config.identity_path)
        _hold_identity(stack, config.identity_path)
        if config.emulate_link:
            from agora_node.comms import linkemu

            linkemu.configure(linkemu.LinkSpec.parse(config.emulate_link))
        if args.dry_run:
            print(f"config: {config_json(config)}", flush=True)
            return _run_daemon(_dry_run(config, compute))
        import torch

        from agora_node.node.run import run_node

        if config.threads:
            torch.set_num_threads(config.threads)
        log.info("config: %s", config_json(config))
        log.info("computing on %s", compute.describe())
        return _run_daemon(run_node(config, compute))


def _resolve_compute(config: NodeConfig):  # noqa: ANN202
    """--device/--precision on this machine, or None after printing why not."""
    from agora_node.stages.device import DeviceError

    try:
        return config.compute()
    except DeviceError as exc:
        print(f"agora-node: error: {exc}", file=sys.stderr, flush=True)
        return None


def _run_daemon(coro) -> int:  # noqa: ANN001
    from agora_node.comms.host import HostError
    from agora_node.node.control import ControlError
    from agora_node.node.errors import JoinError
    from agora_node.node.status_server import StatusServerError

    try:
        return asyncio.run(coro)
    except (HostError, JoinError, StatusServerError, ControlError) as exc:
        print(f"agora-node: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILURE


async def _dry_run(config, compute) -> int:  # noqa: ANN001
    """Join the DHT read-only: fetch the manifest and directory, print the choice, leave."""
    from agora_node.comms.directory import Directory, RunDiscoveryError, fetch_manifest
    from agora_node.comms.host import Host, HostConfig
    from agora_node.node.errors import JoinError
    from agora_node.node.joining import stages_fitting, without_the_head
    from agora_node.protocol.identity import Identity
    from agora_node.protocol.records import RecordLimits
    from agora_node.stages import placement
    from agora_node.stages.data import head_data_missing

    identity = Identity.load_or_create(config.identity_path)
    print(f"peer id: {identity.peer_id}", flush=True)  # what --allow-keys files list
    host = await Host.start(
        HostConfig(identity_path=config.identity_path, initial_peers=config.initial_peers)
    )
    try:
        try:
            manifest = await fetch_manifest(host, config.manifest, config.run or None)
        except RunDiscoveryError as exc:
            raise JoinError(str(exc)) from None
        view = await Directory(
            host,
            identity,
            manifest.run_id,
            manifest.num_stages,
            limits=RecordLimits.for_manifest(manifest),
        ).fetch()
        # as the daemon decides (Node._choose_stage)
        no_data = head_data_missing(manifest, local=config.manifest is not None)
        if config.stage == "auto":
            can_hold = stages_fitting(manifest, compute)
            if no_data is not None:
                can_hold = without_the_head(manifest, can_hold, no_data)
                print(f"not serving stage 0: {no_data}")
            choice = placement.choose_stage(view, manifest, identity.peer_id, can_hold=can_hold)
            stage, reason = choice.stage, choice.reason
        else:
            stage, reason = int(config.stage), "fixed by --stage"
        print_stage_plan(
            manifest, stage, reason, view, compute, max_in_flight=config.pipeline.max_in_flight
        )
        if stage == 0 and no_data is not None:
            print(f"cannot serve it: {no_data}")
    finally:
        await host.shutdown()
    return EXIT_OK


def print_stage_plan(
    manifest,  # noqa: ANN001
    stage: int,
    reason: str | None,
    view=None,  # noqa: ANN001
    compute=None,  # noqa: ANN001
    max_in_flight: int = 0,
) -> None:
    """What serving `stage` takes (`reason`: why this node would serve it; None: a bootstrap's
    listing of every stage). `max_in_flight`: this node's --max-in-flight, which sets what a
    head (stage 0) keeps in flight; graphs past the worker's MAX_GRAPHS are recomputed."""
    from agora_node.node.worker import MAX_GRAPHS
    from agora_node.stages import memory
    from agora_node.stages.device import OptimizerMode

    if not 0 <= stage < manifest.num_stages:
        raise UsageError(
            f"--stage {stage} does not exist: this run has stages 0..{manifest.num_stages - 1}"
        )
    mode = compute.optimizer_mode if compute is not None else OptimizerMode()
    in_flight = memory.default_in_flight(manifest, stage)
    if stage == 0 and max_in_flight > 0 and stage < manifest.num_stages - 1:
        in_flight = min(max_in_flight, MAX_GRAPHS)
    need = functools.partial(
        memory.stage_memory_bytes,
        manifest,
        stage,
        optimizer=manifest.inner.optimizer,
        in_flight=in_flight,
        optimizer_states=mode.states,
        optimizer_step=mode.step,
    )
    mem = need()
    print(f"run {manifest.run_id} ({manifest.run.name}), {manifest.num_stages} stages")
    if view is not None:
        print(
            "directory: "
            + ", ".join(f"stage {s}: {len(r)} node(s)" for s, r in sorted(view.items()))
        )
    print(f"would serve stage {stage}: {reason}" if reason else f"stage {stage}:")
    print(
        f"layers {list(manifest.stage_layers(stage))}, memory needed with {in_flight} "
        "micro-batch(es) in flight (device_bytes: on the stage's device at its peak; "
        "total_bytes adds the outer state, on the host):"
    )
    for part, value in mem.items():
        shown = f"{value / 1e6:10.2f} M" if part == "params" else f"{value / 2**20:10.1f} MiB"
        print(f"  {part:<22} {shown}")
    cells = manifest.model.cp_degree
    if cells > 1:
        shared = need(cp_degree=cells)
        print(
            f"  in a context-parallel cell of {cells} (each peer holds 1/{cells} of a sequence): "
            f"activation_bytes {shared['activation_bytes'] / 2**20:.1f} MiB, "
            f"total_bytes {shared['total_bytes'] / 2**20:.1f} MiB per peer"
        )
    if compute is not None:
        free = compute.free_bytes()
        room = "" if free is None else f", {free / 2**30:.2f} GiB free"
        print(f"device: {compute.describe()}{room}")
        reason = memory.does_not_fit(manifest, stage, compute.device, free, mode)
        if reason is not None:
            print(f"does not fit: {reason}")
        elif free is not None:
            graphs = memory.graph_budget(manifest, stage, free, mode, most=MAX_GRAPHS)
            print(
                f"keeps the graphs of {graphs} micro-batch(es) in flight on {compute.device}; "
                "more are recomputed at backward"
            )


def cmd_bootstrap(args: argparse.Namespace) -> int:
    config = resolve_config(args, BootstrapConfig)
    manifest = config.manifest
    if args.dry_run:
        check_maddrs(config)
        print(f"config: {config_json(config)}")
        print(f"run {manifest.run_id} ({manifest.run.name}); identity {config.identity_path}")
        for stage in range(manifest.num_stages):
            print_stage_plan(manifest, stage, None)  # a bootstrap serves none
        return EXIT_OK
    from agora_node.node.bootstrap import run_bootstrap

    # Its own lock name: a bootstrap and the default node may share ~/.agora-node.
    with contextlib.ExitStack() as stack:
        stack.enter_context(signals.while_starting())  # until the bootstrap's loop does
        stack.enter_context(datadir.lock_data_dir(config.data_dir, "bootstrap.lock"))
        check_maddrs(config)
        prepare_identity(config.identity_path)
        _hold_identity(stack, config.identity_path)
        log.info("config: %s", config_json(config))
        return _run_daemon(
            run_bootstrap(
                manifest,
                config.identity_path,
                config.host_maddrs,
                config.announce_maddrs,
                config.initial_peers,
                data_dir=config.data_dir,
                relay_for_others=config.relay_for_others == "on",
            )
        )


_SOURCES = (
    "Every option can also come from an environment variable (AGORA_ and the option's name "
    "in capitals, - as _: AGORA_STAGE=2, AGORA_INITIAL_PEERS) or from a TOML file (--config; "
    "keys are the long options without --). A flag wins over a variable, a variable over "
    "the file, the file over the default."
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "join", help="join a swarm and serve the stage it needs most", epilog=_SOURCES
    )
    add_daemon_options(p, NodeConfig)
    p.add_argument(
        "--dry-run", action="store_true", help="print the chosen stage, its memory and why; exit"
    )
    p.set_defaults(func=cmd_join)
    p = sub.add_parser(
        "bootstrap",
        help="an entry point: publish a run's manifest, print the join line",
        epilog=_SOURCES,
    )
    add_daemon_options(p, BootstrapConfig)
    p.add_argument(
        "--dry-run", action="store_true", help="print the run and per-stage memory; exit"
    )
    p.set_defaults(func=cmd_bootstrap)
