"""The `agora-node` command line: one subcommand per operator action.

`main(argv) -> int` never lets a known failure escape as a traceback: bad input
is one line on stderr and exit code 2; a failure at run time (another daemon
holds the data dir, the swarm cannot be reached) is one line and exit code 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from agora_node import __version__
from agora_node.comms.reaper import die_with_parent
from agora_node.node.datadir import DataDirError
from agora_node.node.errors import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, UsageError
from agora_node.protocol.manifest import ManifestError
from agora_node.stages.device import OPTIMIZER_STATES, OPTIMIZER_STEPS, Compute, DeviceError
from agora_node.stages.manifest_files import check_data_available, load_manifest


def _add_manifest_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--manifest",
        default="tiny",
        help="builtin manifest name (tiny, demo, bench, gpu-1b, long, cells) or path to a TOML file (default: tiny)",
    )


def cmd_train_local(args: argparse.Namespace) -> int:
    import torch

    from agora_node.node.train_local import LocalTrainConfig, LocalTrainer

    _positive_int_args(args)
    manifest = load_manifest(args.manifest)
    check_data_available(manifest)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        compute = Compute.resolve(
            args.device, args.precision, args.optimizer_states, args.optimizer_step
        )
    except DeviceError as exc:
        raise UsageError(str(exc)) from None
    config = LocalTrainConfig(
        compute=compute,
        steps=args.steps,
        eval_every=args.eval_every,
        checkpoint_dir=Path(args.checkpoint_dir) if args.checkpoint_dir else None,
        checkpoint_every=args.checkpoint_every,
    )
    print(
        f"run {manifest.run_id} ({manifest.run.name}): training all {manifest.num_stages} stages "
        f"locally on {compute.describe()}"
    )
    result = LocalTrainer(manifest, config).run()
    first, last = result.val_losses[0][1], result.val_losses[-1][1]
    print(
        f"done: {result.steps} steps, {result.tokens_per_s:.0f} tok/s, val_loss {first:.4f} -> {last:.4f}"
    )
    return EXIT_OK


def cmd_manifest(args: argparse.Namespace) -> int:
    manifest = load_manifest(args.manifest)
    if args.check_data:
        check_data_available(manifest)
    if args.action == "show":
        print(f"# run id {manifest.run_id}")
        print(manifest.to_toml(), end="")
    else:
        print(f"ok: run id {manifest.run_id}, {manifest.num_stages} stages")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agora-node",
        description="Train one pipeline stage of a language model together with strangers.",
    )
    parser.add_argument("--version", action="version", version=f"agora-node {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train-local", help="train the whole model in one process (the reference)")
    _add_manifest_arg(p)
    p.add_argument("--steps", type=int, default=200, help="inner steps (default 200)")
    p.add_argument(
        "--eval-every", type=int, default=50, help="steps between validation losses (default 50)"
    )
    p.add_argument("--checkpoint-dir", help="save checkpoints here and resume from the newest")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=100,
        help="steps between checkpoints in --checkpoint-dir (default 100; join's counts seconds)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (as join's)")
    p.add_argument("--precision", default="auto", help="auto, fp32 or bf16 (as join's)")
    p.add_argument("--optimizer-states", default="fp32", choices=OPTIMIZER_STATES, help="as join's")
    p.add_argument(
        "--optimizer-step", default="after-backward", choices=OPTIMIZER_STEPS, help="as join's"
    )
    p.set_defaults(func=cmd_train_local)

    p = sub.add_parser("manifest", help="validate or print a run manifest and its run id")
    p.add_argument("action", choices=("check", "show"))
    _add_manifest_arg(p)
    p.add_argument(
        "--check-data", action="store_true", help="also check the data source is readable"
    )
    p.set_defaults(func=cmd_manifest)

    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands() -> list[Callable[[argparse._SubParsersAction], None]]:
    """Subcommands defined next to the code they drive (imported lazily: torch-free parsing)."""
    from agora_node.node import commands, demo, status_cli

    return [commands.register, status_cli.register, demo.register]


def _positive_int_args(args: argparse.Namespace) -> None:
    for name in ("steps", "eval_every", "checkpoint_every"):  # train-local's own flags
        value = getattr(args, name, None)
        if value is not None and value <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if getattr(args, "threads", 0) < 0:
        raise UsageError(f"--threads must be positive (0: torch's choice), got {args.threads}")
    checkpoints = getattr(args, "checkpoint_dir", None)
    if checkpoints and Path(checkpoints).exists() and not Path(checkpoints).is_dir():
        raise UsageError(f"--checkpoint-dir {checkpoints} is a file: pass a directory")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed its one-line usage error
        return EXIT_OK if exc.code == 0 else EXIT_USAGE
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        return args.func(args)
    except (ManifestError, UsageError) as exc:
        print(f"agora-node: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except DataDirError as exc:  # in use by another daemon, or not writable
        print(f"agora-node: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("agora-node: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    die_with_parent()
    sys.exit(main())
