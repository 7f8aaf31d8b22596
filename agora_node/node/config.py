"""Daemon options: what `agora-node join` and `agora-node bootstrap` resolve and run with.

Each field declared with `option(...)` is the one source of that option's flag,
`AGORA_<OPTION>` variable, `--config` TOML key, default and help (node/options.py
generates them); `__post_init__` validates, raising UsageError, and resolves the
paths that default to places in the data dir. Fields without `option` are
internal settings.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agora_node.comms.linkemu import LinkSpec
from agora_node.node import datadir
from agora_node.node.errors import UsageError
from agora_node.node.options import flag_of, option
from agora_node.node.telemetry import check_login, check_url
from agora_node.protocol.allowlist import AllowListError, read_allow_keys
from agora_node.protocol.codecs import DENSE_CODEC_NAMES, UnknownCodecError, from_name
from agora_node.protocol.manifest import Manifest
from agora_node.protocol.records import DEFAULT_RECORD_TTL_S, MAX_RECORD_TTL_S
from agora_node.stages.device import (
    OPTIMIZER_STATES,
    OPTIMIZER_STEPS,
    PRECISIONS,
    Compute,
    DeviceError,
    check_names,
)
from agora_node.stages.manifest_files import load_manifest

LISTEN = "/ip4/127.0.0.1/tcp/0"
_LISTEN_HELP = "listen multiaddrs (use /ip4/0.0.0.0/tcp/PORT to be reachable)"


_PEER_ADDR = re.compile(
    r"/((ip4|ip6|dns|dns4|dns6)/[^/]+/(tcp|udp)/\d+(/[^/]+)*|dnsaddr/[^/]+)"
    r"/(p2p|ipfs)/[1-9A-HJ-NP-Za-km-z]{32,}/?"
)


def _check_peer_addrs(flag: str, addrs: list[str]) -> None:
    """Peer addresses as `agora-node bootstrap` prints them, checked before anything
    starts (libp2p would say it later, in its own words, and a missing /p2p/ part not at
    all clearly)."""
    for addr in addrs:
        if not _PEER_ADDR.fullmatch(addr):
            _not_a_peer_address(flag, addr, "expected /ip4/HOST/tcp/PORT/p2p/PEER_ID")


def _not_a_peer_address(flag: str, addr: str, why: str) -> None:
    raise UsageError(
        f"{flag} {addr!r} is not a peer address ({why}): as `agora-node bootstrap`"
        " prints it, /ip4/HOST/tcp/PORT/p2p/PEER_ID"
    )


def _check_codec(name: str) -> None:
    try:
        from_name(name, what="--activation-codec", allowed=DENSE_CODEC_NAMES)
    except UnknownCodecError as exc:
        raise UsageError(str(exc)) from None


def on_off(text: str) -> str:
    if text not in ("on", "off"):
        raise UsageError(f"expected on or off, not {text!r}")
    return text


@dataclass(kw_only=True)
class PipelineConfig:
    max_in_flight: int = option(
        0,
        help="micro-batches a stage-0 node keeps in flight (0: one inner step's worth, two "
        "when the manifest turns on weight prediction)",
    )
    """Micro-batches a head keeps in the pipeline; 0: the micro-batches of one inner
    step, or of two when the manifest asks for weight prediction (stages/memory.py, heads_in_flight).
    More hides more latency but makes gradients staler (measured in
    docs/benchmarks.md: 4 in flight cost tiny 4.7% validation loss at 98k tokens; the
    manifest's `inner.weight_prediction` wins back part of it, and with the Muon inner
    optimizer nearly all)."""
    max_queue: int = 16
    """Micro-batches a non-head node holds at once before answering busy."""
    hop_timeout_s: float = option(
        60.0,
        name="hop_timeout",
        help="seconds one request to the next stage may wait for its answer (the whole rest "
        "of the pipeline); a replica that membership declares dead is given up at once",
    )
    deadline_s: float = 120.0
    """A micro-batch that has not completed by then is dropped."""
    activation_codec: str = option(
        "int8",
        help="boundary activations and their gradients on the wire: "
        + ", ".join(DENSE_CODEC_NAMES)
        + " (int8: half of bf16's bytes at no measured loss; docs/benchmarks.md)",
    )
    canary_every: int = 64
    """One training micro-batch in n this node sends (drawn at random), the same input also
    goes, as a forward-only probe (to the last stage: as training, once answered), to
    `canary_replicas` replicas of the next stage (or a strict majority of them and one
    more, if that is more); one whose answer departs from a strict majority of the stage
    is flagged (node/canary.py). At stage 1, also one micro-batch in n a head sends this
    node: other heads recompute its activations. 0: never."""
    canary_replicas: int = 3
    canary_tolerance: float = 0.5
    """Relative distance (||a - b|| / max norm) within which two replicas' outputs agree;
    replicas drift apart by their inner steps since the last outer round."""

    def __post_init__(self) -> None:
        _at_least(self, 0, "max_in_flight", "canary_every")
        _positive(self, "hop_timeout_s")
        if not math.isfinite(self.hop_timeout_s):
            raise UsageError("--hop-timeout must be a finite number of seconds")
        if self.canary_replicas < 3:
            raise UsageError("canary_replicas must be at least 3 (a strict majority of 2 is both)")
        _check_codec(self.activation_codec)


@dataclass(kw_only=True)
class NodeConfig:
    initial_peers: list[str] = option(
        factory=list, help="multiaddrs of peers already in the swarm (any live one works)"
    )
    stage: str = option("auto", help="'auto' (the stage the swarm needs most) or a stage number")
    manifest: Manifest | None = option(
        None,
        parse=load_manifest,
        help="a local manifest (builtin name or TOML path) that must match the swarm's "
        "(default: take the swarm's)",
    )
    run: str = option(
        "",
        help="the run id to join when the swarm serves several (listed by the error and the "
        "status page); default: the only one",
    )
    identity_path: str = option(
        "",
        help="libp2p identity key file, created 0600 if missing (default DATA_DIR/identity.key; "
        "a bare file name such as gpu0.key is a file in DATA_DIR)",
    )
    data_dir: str = option(
        "",
        help="checkpoints, identity, control socket and lock live here; one daemon per data dir "
        "(default ~/.agora-node, or ~/.agora-node/nodes/NAME when only --identity-path "
        "NAME.key is given)",
    )
    host_maddrs: list[str] = option(factory=lambda: [LISTEN], help=_LISTEN_HELP)
    announce_maddrs: list[str] = option(
        factory=list, help="multiaddrs to announce to peers (public address and port)"
    )
    relay_for_others: str = option(
        "on",
        parse=on_off,
        help="on: pass requests on to peers behind NAT that keep a connection to this node "
        "(their streams only, signed end to end, bounded per peer: docs/security.md); off: never",
    )
    status_host: str = option("127.0.0.1", help="status page address")
    status_port: int = option(8421, help="status page port (0: any free port)")
    status_names: list[str] = option(
        factory=list,
        help="with --status-host beyond loopback: host names the status page answers to "
        "besides localhost, IP addresses and this machine's own names (a Prometheus target's "
        "or a reverse proxy's); others get 403 (DNS rebinding)",
    )
    control_socket: str | None = option(
        None, help="control API Unix socket (default DATA_DIR/control.sock)"
    )
    threads: int = option(0, help="torch threads (0: torch's default)")
    device: str = option(
        "auto",
        help="where the stage computes: auto (a CUDA GPU, else Apple MPS, else the CPU), "
        "cpu, cuda, cuda:N or mps",
    )
    precision: str = option(
        "auto",
        help=f"{', '.join(PRECISIONS)}: bf16 autocast over float32 weights (auto: bf16 on a "
        "CUDA GPU that supports it, fp32 elsewhere)",
    )
    optimizer_states: str = option(
        "fp32",
        help="how the inner optimizer holds AdamW's two moments: fp32, or 8bit (float8 with a "
        "scale per block of 256: 2 bytes per parameter instead of 8; docs/benchmarks.md has "
        "the loss cost)",
    )
    optimizer_step: str = option(
        "after-backward",
        help="when the inner optimizer steps: after-backward, or in-backward (each parameter "
        "as soon as its gradient is ready, so the gradients are never all held: one weight "
        "copy less; for runs that step every micro-batch, local_batch = micro_batch)",
    )
    record_ttl_s: float = option(
        DEFAULT_RECORD_TTL_S,
        name="record_ttl",
        help=f"seconds a directory record lives unless refreshed (at most {MAX_RECORD_TTL_S:g})",
    )
    refresh_s: float = option(
        3.0,
        name="refresh",
        help="seconds between record refreshes and directory reads (and at each round's end)",
    )
    settle_s: float = 1.5
    """Interval between a joiner's directory reads before it commits to a stage."""
    settle_rounds: int = 8
    state_deadline_s: float = 120.0
    """Longest a joiner spends getting attested state from replicas; then checkpoint/init."""
    rebalance_every_s: float = option(
        60.0,
        name="rebalance_every",
        help="mean seconds between stage re-evaluations of a --stage auto node (0: never)",
    )
    checkpoint_every_s: float = option(
        300.0, name="checkpoint_every", help="seconds between checkpoints"
    )
    eval_every_s: float = option(
        60.0, name="eval_every", help="seconds between validation losses (stage 0)"
    )
    ban_s: float = option(
        600.0,
        name="ban",
        help="seconds a peer caught sending outlier, forged or non-finite values is ignored "
        "(routing, outer rounds, state transfer)",
    )
    eval_samples: int = 16
    drain_timeout_s: float = 30.0
    max_tokens: int = option(
        0,
        help="stage 0: stop injecting after this many tokens and evaluate (0: never); a "
        "dropped micro-batch's tokens do not count (it stops short, with a warning, once more "
        "tokens failed than this), and a head helping a context-parallel cell counts the "
        "tokens it helped split",
    )
    emulate_link: str = option(
        "", help="benchmarks: shape this node's uplink as 'MBIT_PER_S,LATENCY_MS'"
    )
    mqtt_url: str = option(
        "",
        help="publish status and events to this MQTT broker, e.g. mqtt://127.0.0.1:1883 "
        "(needs the mqtt extra)",
    )
    mqtt_login: str = option(
        "",
        help="a file whose first line is USER:PASSWORD, the MQTT broker's login (readable "
        "by this user only; never shown on the status page or in the log)",
    )
    allow_keys: str = option(
        "",
        help="private swarm: a file of the peer ids (or hex Ed25519 public keys) allowed in, "
        "one per line, this node's own included; everything from other keys is refused "
        "(re-read when the file changes, or on SIGUSR1)",
    )
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)

    def __post_init__(self) -> None:
        if not self.initial_peers:
            raise UsageError("join needs --initial-peers (the line `agora-node bootstrap` printed)")
        _check_peer_addrs("--initial-peers", self.initial_peers)
        if self.stage != "auto" and not (self.stage.isascii() and self.stage.isdigit()):
            raise UsageError(f"--stage must be 'auto' or a stage number, not {self.stage!r}")
        _positive(self, "record_ttl_s", "refresh_s", "checkpoint_every_s", "eval_every_s")
        if self.record_ttl_s > MAX_RECORD_TTL_S:
            raise UsageError(
                f"--record-ttl must be at most {MAX_RECORD_TTL_S:g} (longer records are refused "
                f"by other nodes), not {self.record_ttl_s}"
            )
        if self.refresh_s >= self.record_ttl_s:
            raise UsageError(
                f"--refresh {self.refresh_s:g} must be shorter than --record-ttl "
                f"{self.record_ttl_s:g}: the record would lapse between refreshes"
            )
        if self.run and self.manifest is not None and self.run != self.manifest.run_id:
            raise UsageError(
                f"--run {self.run} and --manifest (run id {self.manifest.run_id}) disagree"
            )
        _at_least(self, 0, "threads", "max_tokens", "rebalance_every_s", "status_port", "ban_s")
        if not math.isfinite(self.ban_s):
            raise UsageError(f"--ban must be a finite number of seconds, not {self.ban_s}")
        try:
            check_names(self.device, self.precision)
        except DeviceError as exc:
            raise UsageError(str(exc)) from None
        if self.optimizer_states not in OPTIMIZER_STATES:
            raise UsageError(
                f"--optimizer-states must be one of {', '.join(OPTIMIZER_STATES)}, "
                f"not {self.optimizer_states!r}"
            )
        if self.optimizer_step not in OPTIMIZER_STEPS:
            raise UsageError(
                f"--optimizer-step must be one of {', '.join(OPTIMIZER_STEPS)}, "
                f"not {self.optimizer_step!r}"
            )
        if self.status_port > 65535:
            raise UsageError(f"--status-port must be at most 65535, not {self.status_port}")
        if self.emulate_link:
            try:
                LinkSpec.parse(self.emulate_link)
            except ValueError as exc:
                raise UsageError(f"--emulate-link: {exc}") from None
        if self.mqtt_url:
            check_url(self.mqtt_url)
        if self.mqtt_login:
            if not self.mqtt_url:
                raise UsageError("--mqtt-login needs --mqtt-url (the broker it logs in to)")
            self.mqtt_login = str(Path(self.mqtt_login).expanduser())
            check_login(self.mqtt_login)
        if self.allow_keys:
            self.allow_keys = str(Path(self.allow_keys).expanduser())
            try:
                read_allow_keys(self.allow_keys)
            except AllowListError as exc:
                raise UsageError(f"--allow-keys {exc}") from None
        data_dir = _data_dir(self.data_dir, self.identity_path, "identity.key")
        self.data_dir = str(data_dir)
        self.identity_path = _identity(data_dir, self.identity_path, "identity.key")
        self.control_socket = _path_or(self.control_socket, data_dir / "control.sock")

    def compute(self) -> Compute:
        """--device, --precision and the optimizer's memory options, resolved on this
        machine (DeviceError when it lacks the device)."""
        return Compute.resolve(
            self.device, self.precision, self.optimizer_states, self.optimizer_step
        )


@dataclass(kw_only=True)
class BootstrapConfig:
    manifest: Manifest = option(
        factory=lambda: load_manifest("tiny"),
        parse=load_manifest,
        shown="tiny",
        help="builtin manifest name or TOML path of the run to serve",
    )
    identity_path: str = option(
        "",
        help="libp2p identity key file (default DATA_DIR/bootstrap.key; a bare file name is a "
        "file in DATA_DIR): a stable peer id",
    )
    data_dir: str = option(
        "",
        help="where the identity, the lock and the remembered peers live (default "
        "~/.agora-node, or ~/.agora-node/nodes/NAME when only --identity-path NAME.key is given)",
    )
    host_maddrs: list[str] = option(factory=lambda: [LISTEN], help=_LISTEN_HELP)
    announce_maddrs: list[str] = option(
        factory=list, help="multiaddrs to announce (public address and port)"
    )
    relay_for_others: str = option(
        "on",
        parse=on_off,
        help="on: pass requests on to peers behind NAT that keep a connection to this node "
        "(their streams only, signed end to end, bounded per peer: docs/security.md); off: never",
    )
    initial_peers: list[str] = option(
        factory=list, help="other entry points of the same swarm, if any"
    )

    def __post_init__(self) -> None:
        _check_peer_addrs("--initial-peers", self.initial_peers)
        data_dir = _data_dir(self.data_dir, self.identity_path, "bootstrap.key")
        self.data_dir = str(data_dir)
        self.identity_path = _identity(data_dir, self.identity_path, "bootstrap.key")


def config_dict(config: Any) -> dict[str, Any]:
    """The resolved configuration as JSON-ready values (a manifest as its run id)."""

    def plain(value: Any) -> Any:
        if isinstance(value, Manifest):
            return value.run_id
        if dataclasses.is_dataclass(value):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return value

    return plain(config)


def _data_dir(data_dir: str, identity_path: str, default_identity: str) -> Path:
    if data_dir:
        return Path(data_dir).expanduser()
    return datadir.default_data_dir(identity_path, default_identity)


def _identity(data_dir: Path, identity_path: str, default_name: str) -> str:
    """The identity key's path (datadir.identity_file). A bare file name used to mean a
    file in the current directory: when only that one exists, say where the key goes
    now, rather than create a new key (a new peer id) beside the old one."""
    key = datadir.identity_file(data_dir, identity_path, default_name)
    old = Path(identity_path).absolute()
    if datadir.is_bare_name(identity_path) and old != key and old.is_file() and not key.exists():
        raise UsageError(
            f"--identity-path {identity_path} names {key} (a bare file name is a key in the "
            f"data dir), which does not exist, but {old} does: move that key there, or pass "
            f"--identity-path ./{identity_path} to keep it where it is"
        )
    return str(key)


def check_maddrs(config: NodeConfig | BootstrapConfig) -> None:
    """--host-maddrs and --announce-maddrs, parsed as libp2p will parse them: a UsageError
    (exit 2) naming the flag, before the status page, the control API or libp2p start.
    Not in __post_init__: the parser imports hivemind and torch (over a second of CPU),
    and a daemon must fail on a held data dir before that work (tests/surfaces/
    test_datadir.py); `join` and `bootstrap` call it once they hold the lock."""
    from hivemind.utils.multiaddr import Multiaddr

    from agora_node.comms.host_checks import HostError, check_maddr

    for name in ("host_maddrs", "announce_maddrs"):
        for maddr in getattr(config, name):
            try:
                check_maddr(maddr)
            except HostError as exc:
                raise UsageError(f"{flag_of(type(config), name)}: {exc}") from None
    for addr in config.initial_peers:
        try:  # its parts: /ip4/999.0.0.1/... or a cut peer id failed after start-up, exit 1
            Multiaddr(addr)
        except Exception as exc:  # noqa: BLE001 - the parser's own errors, any type
            _not_a_peer_address("--initial-peers", addr, str(exc).rsplit(": ", 1)[-1])


def _path_or(path: str | None, default: Path) -> str:
    return str(Path(path).expanduser() if path else default)


def _positive(config: Any, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not value > 0:  # also refuses NaN
            raise UsageError(f"{flag_of(type(config), name)} must be positive, not {value}")


def _at_least(config: Any, low: float, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not value >= low:
            raise UsageError(f"{flag_of(type(config), name)} must be at least {low}, not {value}")
