"""The status web endpoint: a read-only view of one daemon, served from a snapshot.

`StatusServer` runs an aiohttp app inside the daemon's own asyncio loop. Every
handler reads `snapshot_provider.snapshot()`, a dict the daemon has already
computed in a background task, so a request never waits on the network (the
DHT, peers). Mutating actions are not here: they go through the control API
(`control.py`) on a Unix socket that only the owner can open.

Routes: `/` (dashboard), `/api/v1/status`, `/api/v1/peers`, `/api/v1/config`,
`/healthz`, `/readyz`, `/metrics`.

Snapshot schema (what `snapshot()` returns; see the TypedDicts below):

    {
      "snapshot_at": float,            # unix time the daemon built this snapshot
      "node": NodeStatus,              # this node
      "stages": [StageView, ...],      # one per stage 0..num_stages-1, even if empty
      "config": {...},                 # resolved config, JSON-safe, no secrets
      "history": {"loss": [[t, v], ...], "val_loss": [...], "throughput": [...]},
    }

`History` below keeps those bounded lists for the daemon.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import json
import logging
import math
import secrets
import socket
import time
from collections import deque
from collections.abc import Iterable
from importlib import resources
from typing import Any, Protocol, TypedDict

from aiohttp import web

from agora_node.node.metrics import Metrics

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8421
HISTORY_SERIES = ("loss", "val_loss", "throughput")
IDLE_CLOSE_S = 15.0
"""A connection that has not sent a whole request this long after it opened or after its
last answer is closed (aiohttp's keep-alive timer, 3630 s by default, also covers a request
whose headers never end): half-sent requests cannot hold sockets for an hour. The
dashboard asks every 2 s, so its connection stays open."""


class PeerView(TypedDict):
    """One directory entry as this node sees it (the record, then this node's own view)."""

    peer_id: str
    state: str  # joining | warming | active | leaving
    throughput: float  # announced compute rate: tokens per compute-second, each micro-batch once
    utilization: float  # announced fraction of wall time computing (0..1; 0 from older peers)
    queue: int  # micro-batches waiting or in flight there
    inner_step: int
    outer_step: int
    tokens_seen: int  # tokens it trained, as announced
    pinned: bool  # its operator fixed its stage (--stage N)
    version: str
    updated_at: float  # unix time (this node's clock) the entry was last refreshed
    is_self: bool
    swim: str | None  # SWIM's verdict here: alive | suspect | dead | left | self | None (unknown)
    rtt_ms: float | None  # this node's SWIM probes' round trip to it; None until one answered
    # (and age_s, added by the server: seconds since updated_at)
    rounds_together: int  # of this node's recent outer rounds (the last 20), those it mixed in
    bytes_sent: int  # micro-batch bytes this node sent it (outer rounds: `outer`)
    bytes_received: int
    flags: dict[str, int]  # {"failed" | "outlier" | "direction_outlier" | "replayed" |
    # "mismatched" | "equivocated": recent rounds}, empty if none
    anchor_agrees: bool | None  # same stage: its attested anchor equals ours for that round


class StageView(TypedDict):
    stage: int
    peers: list[PeerView]


class NodeStatus(TypedDict):
    """This node. `stage` is None until one is chosen."""

    peer_id: str
    run_id: str
    version: str
    stage: int | None
    num_stages: int
    state: str  # joining | warming | active | leaving
    started_at: float  # unix time the daemon started; the server derives uptime_s
    inner_step: int
    outer_step: int
    tokens_seen: int
    throughput: float  # compute rate (tokens per compute-second, last minute), as announced
    queue: int  # micro-batches waiting at this node
    in_flight: int  # micro-batches this node has sent and not yet got back
    gradient_lag: float  # steps a gradient lands after the step its forward's weights came
    # from (moving average; 0 when every forward sees the latest step): the staleness
    microbatches: dict[str, int]  # {"ok", "dropped", "rejected"} totals
    hop_failures: dict[str, int]  # failed requests to next-stage replicas by kind ("busy",
    # "timeout", "error", "rejected", "refused"); the micro-batch went elsewhere or was dropped
    bytes_sent: dict[str, int]  # per peer id (bounded; "other" beyond the cap)
    bytes_received: dict[str, int]
    last_losses: list[float]  # most recent last, a few at most
    val_loss: float | None
    val_loss_at: float | None  # unix time this node measured it (heads take turns)
    outer: dict[str, Any]  # this stage's rounds: totals, "last_round", "recent_rounds"
    # ([{round, at, participants, group, anchor_mixed, consistent, bytes_sent,
    # bytes_received, seconds_blocked, failed_peers, outliers, direction_outliers,
    # replayed, mismatched, equivocated}], oldest
    # first) and "agreement" ({round: {"agree": [peer], "differ": [peer]}})
    members: dict[str, Any]  # SWIM: "view", "counters", "events" ([{at, peer_id,
    # event: joined | suspected | dead | left | alive | moved, stage}], oldest first)
    stage_changes: list[dict[str, Any]]  # [{at, from, to, reason}]: the choice, then switches
    waiting_on: str | None  # "stage 2 (no replica downstream)" when a neighbour stage is empty
    time_split: dict[str, float]  # the last progress interval's shares of wall time: "compute",
    # "downstream" (forwards awaiting gradients), "idle" (beyond stage 0: waiting on
    # upstream), "outer" (blocked in outer rounds); node/waits.py. {} before the first
    # interval.
    memory: dict[str, int]  # "max_graphs" (graphs kept open), "recomputed" (backwards that
    # recomputed their forward), "out_of_memory" (micro-batches refused for lack of device
    # memory); on CUDA also "allocated", "reserved", "peak_allocated" bytes
    # Also, per node: compute_rate (tokens per compute-second), compute_s, utilization,
    # rss_bytes, device, precision, dropped, stage_choice (why this stage), last_checkpoint
    # (path or None), checkpoint_error (why the last one failed; None once one succeeds),
    # canaries (probes sent, compared, replicas flagged, skipped for too_many_replicas), addrs, reachability, relay, state_origin (where its weights came from),
    # states_served, final_val_loss, injected_tokens, completed_tokens (a head's),
    # completed_tokens_per_s, rejected_codes ({wire code: count}), and from the server
    # uptime_s and snapshot_age_s; history ({series: [[unix time, value]]}).
    # And: records_rejected ({reason: count}, run_pointer_* for run pointer entries),
    # unlisted_refused ({what: count}: inputs from peers not on --allow-keys; {} in an open swarm)
    # runs_seen ([{"run_id", "name"}]: the runs the swarm's signed run pointer announces)
    # and requests_refused ({protocol: {reason: count}}: what handlers' guards refused or cut).
    # suspects: {"ban_s", "banned_count", "banned": [{"peer", "reason", "evidence", "flags",
    # "flagged_s_ago", "ban_left_s"}] (the 64 most recently flagged), "flagged_total":
    # {reason: count}} (node/suspects.py).
    # cell: this stage's context-parallel cell (node/cell.py), None without one: {"size",
    # "role": alone | leader | helper, "members", "ready", "microbatches", "failed",
    # "helped", "kv_bytes_sent", "kv_bytes_per_token", "exchange_wait_s", "refused", "frames_resent", "answers_resent"}.


class Snapshot(TypedDict):
    snapshot_at: float
    node: NodeStatus
    stages: list[StageView]
    config: dict[str, Any]
    history: dict[str, list[list[float]]]  # series name -> [[unix time, value], ...]


class SnapshotProvider(Protocol):
    def snapshot(self) -> Snapshot | dict[str, Any]:
        """Return the latest precomputed snapshot; must not block or do I/O."""
        ...


class History:
    """Bounded time series for the dashboard plots (the snapshot's `history`)."""

    def __init__(self, maxlen: int = 720) -> None:  # 720 points = 12 min at one a second
        self._series = {name: deque(maxlen=maxlen) for name in HISTORY_SERIES}

    def add(self, name: str, value: float, at: float | None = None) -> None:
        self._series[name].append([time.time() if at is None else at, value])

    def as_dict(self) -> dict[str, list[list[float]]]:
        return {name: list(points) for name, points in self._series.items()}


class StatusServerError(Exception):
    """The status endpoint could not start; the message is one line for the operator."""


class PortInUseError(StatusServerError):
    pass


def _dashboard_html() -> str:
    return resources.files("agora_node.node").joinpath("static/dashboard.html").read_text()


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=lambda d: json.dumps(d, allow_nan=False))


def _finite(value: Any) -> Any:
    """NaN/inf become None: JSON has no NaN, and a diverged loss must not break the page."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _host_name(host: str | None) -> str:
    """The name of a Host header, without its port ("[::1]:8421" -> "::1")."""
    host = (host or "").strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return name.removesuffix(".")  # "node1.lan." is "node1.lan"


def _is_loopback(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def own_names() -> frozenset[str]:
    """This machine's own names (its host name, fully qualified, and mDNS's .local), which a
    browser on the LAN may use for a status page bound to all interfaces. May ask DNS."""
    short = socket.gethostname().lower()
    return frozenset({short, socket.getfqdn().lower(), f"{short.split('.')[0]}.local"})


def answers_to(name: str, bound: str, names: frozenset[str] = frozenset()) -> bool:
    """Whether a request whose Host header names `name` is answered by a status server
    bound to `bound`. A web page whose own name was re-pointed at this machine (DNS
    rebinding) names that name: it gets a 403, not the node's peer id, addresses and
    config. Loopback names always; bound elsewhere, also IP addresses and `names` (the
    machine's own). Before, a server bound to 0.0.0.0 (the Docker image's) answered any
    name, so a page could read it through a port published on 127.0.0.1."""
    if _is_loopback(name):
        return True
    return not _is_loopback(bound) and (_is_ip(name) or name in names)


class StatusServer:
    """Serves the daemon's snapshot over HTTP on `host:port` (port 0: any free port)."""

    def __init__(
        self,
        snapshot_provider: SnapshotProvider,
        metrics: Metrics,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        names: Iterable[str] = (),
    ) -> None:
        """`names`: host names answered besides those `answers_to` always answers."""
        self._provider = snapshot_provider
        self._metrics = metrics
        self._host = host
        self._requested_port = port
        self._runner: web.AppRunner | None = None
        self._html = _dashboard_html()
        self._names = frozenset(_host_name(n) for n in names)
        if not _is_ip(host.strip("[]")):  # bound to a name: that name is answered too
            self._names |= {_host_name(host)}
        self._refused_names: set[str] = set()

    @property
    def port(self) -> int:
        """The bound port (the real one when constructed with port 0)."""
        if self._runner is None or not self._runner.addresses:
            raise RuntimeError("status server is not started")
        return self._runner.addresses[0][1]

    @property
    def url(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        if not _is_loopback(self._host):  # (getfqdn may ask DNS: off the loop)
            self._names |= await asyncio.to_thread(own_names)
        app = web.Application(middlewares=[self._known_names_only])
        app.add_routes(
            [
                web.get("/", self._index),
                web.get("/api/v1/status", self._status),
                web.get("/api/v1/peers", self._peers),
                web.get("/api/v1/config", self._config),
                web.get("/healthz", self._healthz),
                web.get("/readyz", self._readyz),
                web.get("/metrics", self._metrics_text),
            ]
        )
        # access_log: a 2 s poller would flood the log
        runner = web.AppRunner(app, access_log=None, keepalive_timeout=IDLE_CLOSE_S)
        await runner.setup()
        try:
            await web.TCPSite(runner, self._host, self._requested_port).start()
        except OSError as exc:
            await runner.cleanup()
            raise self._bind_error(exc) from exc
        self._runner = runner
        log.info("status endpoint on %s", self.url)

    @web.middleware
    async def _known_names_only(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Only requests that name this machine as `answers_to` says (DNS rebinding)."""
        name = _host_name(request.host)
        if not answers_to(name, self._host, self._names):
            if len(self._refused_names) < 16 and name not in self._refused_names:
                self._refused_names.add(name)  # once per name: a scraper asks every 15 s
                log.warning(
                    "status page: refused a request naming %r (DNS rebinding guard); only "
                    "if that name is this machine's own, pass it with --status-names",
                    name[:100],
                )
            return web.Response(
                status=403,
                text="this endpoint answers to localhost, IP addresses and this machine's "
                "own names only\n",
            )
        return await handler(request)

    def _bind_error(self, exc: OSError) -> StatusServerError:
        where = f"{self._host}:{self._requested_port}"
        if exc.errno == errno.EADDRINUSE:
            return PortInUseError(
                f"status port {self._requested_port} is in use ({where}): pass --status-port"
            )
        return StatusServerError(f"cannot serve status on {where}: {exc.strerror or exc}")

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- handlers: each reads the snapshot and nothing else -----------------

    async def _index(self, request: web.Request) -> web.Response:
        # A per-response nonce lets only our inline script run; peer-supplied
        # strings are escaped by the page, the CSP is the second line of defence.
        nonce = secrets.token_urlsafe(16)
        csp = (
            "default-src 'none'; connect-src 'self'; style-src 'unsafe-inline'; "
            f"script-src 'nonce-{nonce}'; base-uri 'none'; form-action 'none'"
        )
        body = self._html.replace("{{nonce}}", nonce)
        return web.Response(
            text=body,
            content_type="text/html",
            headers={"Content-Security-Policy": csp, "Cache-Control": "no-store"},
        )

    async def _status(self, request: web.Request) -> web.Response:
        snap = self._provider.snapshot()
        node = dict(snap["node"])
        now = time.time()
        node["uptime_s"] = max(0.0, now - node.get("started_at", now))
        node["snapshot_age_s"] = max(0.0, now - snap.get("snapshot_at", now))
        node["history"] = snap.get("history", {})
        return _json(_finite(node))

    async def _peers(self, request: web.Request) -> web.Response:
        snap = self._provider.snapshot()
        now = time.time()
        stages = [
            {
                "stage": entry["stage"],
                "peers": [
                    {**p, "age_s": max(0.0, now - p.get("updated_at", now))}
                    for p in entry.get("peers", [])
                ],
            }
            for entry in snap.get("stages", [])
        ]
        node = snap["node"]
        body = {
            "run_id": node.get("run_id"),
            "num_stages": node.get("num_stages", len(stages)),
            "self": node.get("peer_id"),
            "snapshot_age_s": max(0.0, now - snap.get("snapshot_at", now)),
            "stages": stages,
        }
        return _json(_finite(body))

    async def _config(self, request: web.Request) -> web.Response:
        return _json(_finite(self._provider.snapshot().get("config", {})))

    async def _healthz(self, request: web.Request) -> web.Response:
        # Answering at all proves the daemon's event loop is not blocked.
        return _json({"ok": True})

    async def _readyz(self, request: web.Request) -> web.Response:
        state = self._provider.snapshot()["node"].get("state", "unknown")
        ready = state == "active"
        return _json({"ready": ready, "state": state}, status=200 if ready else 503)

    async def _metrics_text(self, request: web.Request) -> web.Response:
        self._metrics.update_from_snapshot(self._provider.snapshot())
        return web.Response(
            body=self._metrics.render(), headers={"Content-Type": self._metrics.content_type}
        )
