"""`agora-node status` and `agora-node leave`: operator commands that talk to a running daemon.

`status` reads the status endpoint (stdlib urllib, no event loop) and prints
this node and the swarm by stage as a table, or the raw JSON with `--json`.
`leave` asks the daemon, over the control socket, to drain, checkpoint and exit.

`register(subparsers)` adds both to the `agora-node` parser; each handler
returns an exit code: 0 ok, 1 when the daemon cannot be reached or refuses
(one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from agora_node.node import datadir, options
from agora_node.node.control import ControlError, control_call_sync, someone_listens
from agora_node.node.errors import UsageError
from agora_node.node.status_server import DEFAULT_HOST, DEFAULT_PORT

EXIT_OK, EXIT_UNREACHABLE = 0, 1
DEFAULT_URL = f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"


class StatusUnavailable(Exception):
    """The status endpoint did not answer usefully; the message is one line."""


def _fail(message: str) -> int:
    print(f"agora-node: error: {message}", file=sys.stderr)
    return EXIT_UNREACHABLE


# -- fetching ----------------------------------------------------------------


def fetch_json(url: str, timeout: float) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        raise StatusUnavailable(f"{url} answered HTTP {exc.code}") from None
    except urllib.error.URLError as exc:
        reason = getattr(exc.reason, "strerror", None) or exc.reason
        raise StatusUnavailable(f"no agora-node status endpoint at {url} ({reason})") from None
    except TimeoutError:
        raise StatusUnavailable(f"{url} did not answer within {timeout:g} s") from None
    except (ValueError, OSError, http.client.HTTPException) as exc:
        # not JSON, the connection broke mid-body, or not HTTP at all (say a libp2p port)
        said = "".join(c for c in " ".join(str(exc).split()) if c.isprintable())[:120]
        raise StatusUnavailable(f"{url} did not return agora-node status ({said})") from None


def fetch_status(base_url: str, timeout: float = 5.0) -> tuple[dict[str, Any], dict[str, Any]]:
    """(status, peers) from the daemon whose status endpoint is `base_url`."""
    base = base_url.rstrip("/")
    return fetch_json(f"{base}/api/v1/status", timeout), fetch_json(f"{base}/api/v1/peers", timeout)


# -- rendering -----------------------------------------------------------------


def _short(peer_id: str | None) -> str:
    peer_id = peer_id or "?"
    return f"{peer_id[:10]}...{peer_id[-6:]}" if len(peer_id) > 19 else peer_id


def _age(at: float | None) -> str:
    """ " (2m ago)" for a unix time, "" without one."""
    if not isinstance(at, int | float) or not math.isfinite(at):
        return ""
    return f" ({_duration(max(0.0, time.time() - at))} ago)"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _duration(seconds: float | None) -> str:
    s = int(seconds or 0)
    h, m = divmod(s // 60, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s % 60:02d}s" if m else f"{s}s"


def format_node(s: dict[str, Any]) -> str:
    stage = "choosing" if s.get("stage") is None else f"{s['stage']}/{s.get('num_stages', '?')}"
    losses = s.get("last_losses") or []
    mb = s.get("microbatches") or {}
    first = (
        f"this node  {_short(s.get('peer_id'))}  run {str(s.get('run_id', ''))[:12]}  "
        f"stage {stage}  {s.get('state', '?')}  up {_duration(s.get('uptime_s'))}  "
        f"on {s.get('device', '?')} {s.get('precision', '')}".rstrip()
    )
    if (s.get("reachability") or {}).get("state") == "unreachable":
        first += "  NOT DIALABLE by peers"
    relays = (s.get("relay") or {}).get("relays") or []
    if relays:
        first += f"  RELAYED via {', '.join(relays)}"
    cell = s.get("cell") or {}
    if cell.get("role") in ("leader", "helper"):
        others = [_short(m) for m in cell.get("members", []) if m != s.get("peer_id")]
        first += f"  CELL {cell['role']} with {', '.join(others)}"
    second = (
        f"           inner {s.get('inner_step', 0)}  outer {s.get('outer_step', 0)}  "
        f"compute {_num(s.get('compute_rate', s.get('throughput')))} tok/compute-s  "
        f"queue {s.get('queue', 0)}  "
        f"in flight {s.get('in_flight', 0)}  dropped {mb.get('dropped', 0)}  "
        f"rejected {mb.get('rejected', 0)}  "
        f"loss {_num(losses[-1] if losses else None, 4)}  val {_num(s.get('val_loss'), 4)}"
        + _age(s.get("val_loss_at"))
    )
    runs = s.get("runs_seen") or []
    if len(runs) > 1:  # more than ours: joiners without --manifest must choose (--run)
        listed = ", ".join(f"{r.get('run_id')} ({r.get('name')!r})" for r in runs)
        second += f"\n           runs in this swarm: {listed}"
    return f"{first}\n{second}"


def _notes(peer: dict[str, Any], banned: Collection[str]) -> str:
    """What this node knows against a peer beyond its record: SWIM's verdict when it is not
    "alive" (its record lives on until it expires), and a ban of this node's."""
    notes = []
    if peer.get("swim") not in (None, "self", "alive"):
        notes.append(f"swim {peer['swim']}")
    if peer.get("peer_id") in banned:
        notes.append("banned")
    return ", ".join(notes)


def format_stage(entry: dict[str, Any], banned: Collection[str] = ()) -> list[str]:
    """One stage's table; `banned`: the peers this node banned (their rows say so)."""
    peers = entry.get("peers", [])
    lines = [f"stage {entry['stage']}  ({len(peers)} peer{'' if len(peers) == 1 else 's'})"]
    if not peers:
        return [*lines, "    (no peer serves this stage)"]
    lines.append(
        f"    {'PEER':<21} {'STATE':<8} {'COMPUTE':>9} {'QUEUE':>5} {'OUTER':>5} {'AGE':>6}  NOTE"
    )
    for p in peers:
        mark = "*" if p.get("is_self") else " "
        lines.append(
            f"  {mark} {_short(p.get('peer_id')):<21} {str(p.get('state', '?')):<8} "
            f"{_num(p.get('throughput')):>9} {p.get('queue', 0):>5} "
            f"{p.get('outer_step', 0):>5} {_duration(p.get('age_s')):>6}  {_notes(p, banned)}"
        )
    return lines


def format_table(status: dict[str, Any], peers: dict[str, Any]) -> str:
    """The human-readable `agora-node status` output (`*` marks this node)."""
    lines = [format_node(status), ""]
    suspects = status.get("suspects") or {}
    banned = {b.get("peer") for b in suspects.get("banned", []) if isinstance(b, dict)}
    for entry in peers.get("stages", []):
        lines.extend(format_stage(entry, banned))
    return "\n".join(lines)


# -- commands ------------------------------------------------------------------


def daemon_file(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, Any]:
    """The options in the config file the daemon was started with (`--config`, else
    AGORA_CONFIG, as the daemon reads it; {} without one): where its status page, control
    socket and data dir are, when the file says. A file that AGORA_CONFIG names and that
    cannot be read is left out with a warning (it may be another command's); one given
    with --config is an error."""
    from agora_node.node.config import NodeConfig

    path, name = options.config_file(getattr(args, "config", None), env)
    if not path:
        return {}
    try:
        return options.read_config_file(path, NodeConfig, name)
    except UsageError as exc:
        if name == "--config":
            raise
        print(f"agora-node: warning: {exc} (not used)", file=sys.stderr)
        return {}


def default_url(env: Mapping[str, str], file: Mapping[str, Any] | None = None) -> str:
    """The status endpoint of a daemon started in this environment: AGORA_STATUS_HOST and
    AGORA_STATUS_PORT as the daemon reads them (an empty variable counts as unset), else
    its config file's (`file`: daemon_file), a wildcard host reached on loopback."""
    file = file or {}
    host = env.get("AGORA_STATUS_HOST") or str(file.get("status_host") or DEFAULT_HOST)
    port = env.get("AGORA_STATUS_PORT") or str(file.get("status_port") or DEFAULT_PORT)
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # noqa: S104 - a client
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port.strip()}"


def leave_target(
    args: argparse.Namespace, env: Mapping[str, str], file: Mapping[str, Any] | None = None
) -> tuple[Path, Path | None]:
    """(the daemon's control socket, its data dir for its pid, or None when unknown), as
    the daemon derives them: flags first, then AGORA_CONTROL_SOCKET, AGORA_DATA_DIR (and
    AGORA_IDENTITY_PATH, which names the default data dir), each else its config file's
    (`file`: daemon_file), then ~/.agora-node."""
    file = file or {}

    def path(text: str) -> Path:
        return Path(text).expanduser()

    def setting(var: str, key: str) -> str | None:
        return env.get(var) or (str(file[key]) if file.get(key) else None)

    if args.control_socket:
        return path(args.control_socket), path(args.data_dir) if args.data_dir else None
    if args.data_dir:
        return path(args.data_dir) / "control.sock", path(args.data_dir)
    dir_text = setting("AGORA_DATA_DIR", "data_dir")
    socket = setting("AGORA_CONTROL_SOCKET", "control_socket")
    if socket:
        return path(socket), path(dir_text) if dir_text else None
    data_dir = (
        path(dir_text)
        if dir_text
        else datadir.default_data_dir(
            setting("AGORA_IDENTITY_PATH", "identity_path"), "identity.key"
        )
    )
    return data_dir / "control.sock", data_dir


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (a timeout of 0 or -1 failed as if no daemon ran)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def cmd_status(args: argparse.Namespace) -> int:
    url = args.url or default_url(os.environ, daemon_file(args, os.environ))  # (lazy)
    url = url.rstrip("/").removesuffix("/api/v1/status")  # the status URL itself, pasted
    try:
        status, peers = fetch_status(url, args.timeout)
    except StatusUnavailable as exc:
        return _fail(f"{exc}: is the daemon running? pass --url")
    if args.json:
        print(json.dumps({"status": status, "peers": peers}, indent=2))
    else:
        print(format_table(status, peers))
    return EXIT_OK


def cmd_leave(args: argparse.Namespace) -> int:
    settled = args.control_socket or args.data_dir  # the flags say where: no file read
    file = {} if settled else daemon_file(args, os.environ)
    path, data_dir = leave_target(args, os.environ, file)
    print(f"asking the daemon on {path} to leave (drain, checkpoint, exit)...", flush=True)
    started, asked_at = time.monotonic(), time.time()
    # its pid, from its data dir's lock file, when we know the data dir
    pid = None if data_dir is None else datadir.holder_pid(data_dir)
    try:
        result = control_call_sync(path, "Leave", timeout=args.timeout)
    except ControlError as exc:
        return _fail(str(exc))
    details = ", ".join(f"{k} {v}" for k, v in result.items())
    # The answer only says it began: wait for the drain, the checkpoint and the exit, which
    # a script that powers the machine off next must not cut short.
    if not _wait_gone(path, pid, started + args.timeout):
        return _fail(
            f"the daemon began to leave ({details}) but still ran after {args.timeout:g} s"
        )
    outcome = None if data_dir is None else datadir.left_since(data_dir, asked_at)
    if outcome is not None and outcome.get("checkpoint_error"):
        return _fail(
            f"the daemon left without a checkpoint ({outcome['checkpoint_error']}): what it"
            " trained since its last good one is not on disk"
        )
    if outcome is None and "checkpoint_error" in result:  # how the leave's own went: unknown
        return _fail(
            f"the daemon left; its last checkpoint before the leave had failed"
            f" ({result['checkpoint_error']}): its log says whether the leave's was written"
        )
    print(f"the daemon left{': ' + details if details else ''}")
    return EXIT_OK


def _wait_gone(control: Path, pid: int | None, deadline: float) -> bool:
    """Until `deadline`: has the daemon's process `pid` exited or, without its pid, has its
    control socket stopped answering (which it does after its checkpoint)?"""
    while True:
        running = datadir.alive(pid) if pid is not None else someone_listens(control)
        if not running:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)  # a CLI waiting on another process: nothing to wake it


CONFIG_HELP = (
    "the daemon's TOML config file (default AGORA_CONFIG), for where it is when the file says"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `status` and `leave` to the `agora-node` subcommands."""
    p = subparsers.add_parser("status", help="show a running daemon's view of the swarm")
    p.add_argument(
        "--url",
        help=f"the daemon's status endpoint (default {DEFAULT_URL}, or the host and port "
        "AGORA_STATUS_HOST and AGORA_STATUS_PORT give, as for the daemon)",
    )
    p.add_argument("--json", action="store_true", help="print the raw JSON of status and peers")
    p.add_argument("--config", help=CONFIG_HELP)
    p.add_argument("--timeout", type=_seconds, default=5.0, help="seconds to wait (default 5)")
    p.set_defaults(func=cmd_status)

    p = subparsers.add_parser("leave", help="ask a running daemon to drain, checkpoint and exit")
    p.add_argument(
        "--control-socket",
        help="the daemon's control socket (default AGORA_CONTROL_SOCKET, else "
        "DATA_DIR/control.sock)",
    )
    p.add_argument(
        "--data-dir",
        help=f"the daemon's data dir, for its control socket (default AGORA_DATA_DIR, else "
        f"the one AGORA_IDENTITY_PATH names, else {datadir.HOME}; a daemon started with "
        f"--identity-path NAME.key: {datadir.HOME}/nodes/NAME)",
    )
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=120.0,
        help="seconds to wait for the daemon to drain, checkpoint and exit (default 120)",
    )
    p.add_argument("--config", help=CONFIG_HELP)
    p.set_defaults(func=cmd_leave)
