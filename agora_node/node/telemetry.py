"""Telemetry to an MQTT broker (`--mqtt-url`; the optional `mqtt` extra, aiomqtt).

Under `agora/<run>/<peer>/` the node publishes:
  status  a compact JSON of its own fields (no history, no swarm view), retained,
          every few seconds; the broker publishes {"state": "gone"} there (the last
          will) if the connection dies, and the node {"state": "left"} when it leaves;
  events  one JSON object per event: joined, stage_chosen, stage_switched,
          outer_round (group, bytes), leaving. They come from the difference between
          two snapshots, so the daemon needs no hooks.
Nothing is subscribed: no broker input reaches the node. A broker that is down or
slow costs a bounded queue (oldest dropped, counted) and a log line now and then:
the connection lives in its own task, retries with capped exponential backoff, and
every wait on the broker has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import os
import random
import ssl
import stat
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from agora_node.node.errors import UsageError
from agora_node.protocol.names import telemetry_prefix

log = logging.getLogger(__name__)
_client_log = logging.getLogger(__name__ + ".mqtt")
"""aiomqtt's and paho's own lines (see `_DemoteLineTrouble`)."""


class _DemoteLineTrouble(logging.Filter):
    """Demotes the clients' lines to debug, except reports of an exception in a callback.

    Their warnings and errors about a line ("Could not gracefully disconnect", "failed to
    receive on socket") come on every dropped connection, and repeat what the connection
    loop logs spaced 1, 2, 4, 8... attempts apart; with `-v` they are all still there.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info or str(record.msg).startswith("Caught exception"):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return _client_log.isEnabledFor(logging.DEBUG)


_client_log.addFilter(_DemoteLineTrouble())

INSTALL_HINT = "--mqtt-url needs the mqtt extra: pip install 'agora-node[mqtt]'"
PORTS = {"mqtt": 1883, "mqtts": 8883}
MAX_PAYLOAD = 4096
"""Bytes; a payload that would be larger is replaced by a short note saying so."""
MAX_TEXT = 200
"""Characters kept of any text field (a stage choice's reason, say)."""
STATUS_FIELDS = (
    "peer_id",
    "run_id",
    "version",
    "stage",
    "num_stages",
    "state",
    "started_at",
    "inner_step",
    "outer_step",
    "tokens_seen",
    "throughput",
    "compute_rate",
    "utilization",
    "rss_bytes",
    "queue",
    "in_flight",
    "microbatches",
    "val_loss",
    "completed_tokens_per_s",
    "stage_choice",
)


def _read_ending(client: Any, seen: Any = None) -> Any:
    """Have the client's record of why its connection ended read (and logged at debug level)
    as soon as it is set.

    aiomqtt 2 keeps that in a private future, replaced on connecting if the line already
    dropped, and read only by a later publish. A drop right after the broker's CONNACK leaves
    it unread, and asyncio reports "Future exception was never retrieved" when it is
    collected. The loop logs the failure the client raised instead ("not currently
    connected", a timeout), so the cause goes to the debug log. Call after creating the
    client and again after entering it (entering may replace the future), passing what
    the first call returned as `seen`.
    """
    ended = getattr(client, "_disconnected", None)
    if isinstance(ended, asyncio.Future) and ended is not seen:
        ended.add_done_callback(_log_ending)
    return ended


def _log_ending(ended: asyncio.Future) -> None:
    if not ended.cancelled() and ended.exception() is not None:
        log.debug("telemetry: the connection ended: %r", ended.exception())


@dataclass(frozen=True)
class Broker:
    host: str
    port: int
    tls: bool

    @classmethod
    def parse(cls, url: str) -> Broker:
        """mqtt://HOST[:PORT] or mqtts://HOST[:PORT]; ValueError says what is wrong."""
        parts = urlsplit(url)
        if parts.scheme not in PORTS:
            raise ValueError(f"{url!r} must start with mqtt:// or mqtts://")
        if parts.username or parts.password:
            raise ValueError("credentials in the URL are not supported (the status page shows it)")
        if not parts.hostname or parts.path not in ("", "/") or parts.query:
            raise ValueError(f"{url!r} must be mqtt://HOST[:PORT]")
        try:
            port = parts.port or PORTS[parts.scheme]
        except ValueError:
            raise ValueError(f"{url!r} has a bad port") from None
        return cls(parts.hostname, port, parts.scheme == "mqtts")


def check_url(url: str) -> None:
    """Validate `--mqtt-url` at configuration time (UsageError: one line for the operator)."""
    try:
        Broker.parse(url)
    except ValueError as exc:
        raise UsageError(f"--mqtt-url: {exc}") from None
    if not _have_aiomqtt():
        raise UsageError(INSTALL_HINT)


def read_login(path: str) -> tuple[str, str]:
    """The broker login in `path`: its first line, USER:PASSWORD (the password may hold
    colons). ValueError says what is wrong, never what the file holds. The file must be
    readable by its owner only (as an ssh key): the password is a shared secret."""
    try:  # (non-blocking: opening a pipe would wait for a writer)
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if not stat.S_ISREG(mode):  # a pipe (`<(pass show ...)`) reads once, then never
                raise ValueError(f"{path} is not a plain file (it is read at each connection)")
            first = f.read(MAX_LOGIN_BYTES + 1).split(b"\n", 1)[0].rstrip(b"\r")
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror or exc}") from None
    if mode & 0o077:
        raise ValueError(f"{path} is readable by others: chmod 600 {path}")
    user, colon, password = first.decode("utf-8", "replace").partition(":")
    if len(first) > MAX_LOGIN_BYTES or not colon or not user:
        raise ValueError(f"{path}: the first line must be USER:PASSWORD (at most 512 bytes)")
    return user, password


MAX_LOGIN_BYTES = 512


def check_login(path: str) -> None:
    """Validate `--mqtt-login` at configuration time."""
    try:
        read_login(path)
    except ValueError as exc:
        raise UsageError(f"--mqtt-login {exc}") from None


def _have_aiomqtt() -> bool:
    try:
        import aiomqtt  # noqa: F401  (lazy: the daemon runs without the extra)
    except ImportError:
        return False
    return True


# ---- what is published (pure) ---------------------------------------------------------------
def status_payload(node: dict[str, Any], dropped: int = 0) -> dict[str, Any]:
    """The retained status: the snapshot's node fields that fit in a line, plus totals."""
    out = {k: node.get(k) for k in STATUS_FIELDS}
    outer = node.get("outer") or {}
    losses = node.get("last_losses") or []
    out |= {
        "loss": losses[-1] if losses else None,
        "bytes_sent": sum((node.get("bytes_sent") or {}).values()),
        "bytes_received": sum((node.get("bytes_received") or {}).values()),
        "outer_rounds": outer.get("rounds", 0),
        "outer_bytes_sent": outer.get("bytes_sent", 0),
        "telemetry_dropped": dropped,
        "at": time.time(),
    }
    return out


def events_between(prev: dict[str, Any] | None, now: dict[str, Any]) -> list[dict[str, Any]]:
    """What happened between two snapshots' node fields (prev None: the first one)."""
    if prev is None:
        stage, reason = now.get("stage"), now.get("stage_choice")
        return [
            {"event": "joined", "stage": stage, "num_stages": now.get("num_stages")},
            {"event": "stage_chosen", "stage": stage, "reason": reason},
        ]
    out: list[dict[str, Any]] = []
    if now.get("stage") != prev.get("stage"):
        out.append(
            {
                "event": "stage_switched",
                "from": prev.get("stage"),
                "to": now.get("stage"),
                "reason": now.get("stage_choice"),
            }
        )
    else:
        was, outer = prev.get("outer") or {}, now.get("outer") or {}
        done = outer.get("rounds", 0) - was.get("rounds", 0)
        last = outer.get("last_round") or {}
        if done > 0 and last:
            out.append(
                {
                    "event": "outer_round",
                    "stage": now.get("stage"),
                    "round": last.get("round"),
                    "rounds": done,
                    "group": len(last.get("delta_group") or ()),
                    "participants": last.get("participants"),
                    "bytes_sent": last.get("bytes_sent"),
                    "bytes_received": last.get("bytes_received"),
                    "seconds_blocked": last.get("seconds_blocked"),
                }
            )
    if now.get("state") == "leaving" and prev.get("state") != "leaving":
        out.append({"event": "leaving", "stage": now.get("stage")})
    return out


def encode(payload: dict[str, Any]) -> bytes:
    """Compact JSON, text clipped, non-finite numbers as null, at most MAX_PAYLOAD bytes."""
    data = json.dumps(_plain(payload), separators=(",", ":")).encode()
    if len(data) > MAX_PAYLOAD:
        data = json.dumps({"truncated": len(data), "event": payload.get("event")}).encode()
    return data


def _plain(value: Any) -> Any:
    if isinstance(value, str):
        return value[:MAX_TEXT]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k)[:MAX_TEXT]: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def backoff_s(failures: int, low: float, high: float) -> float:
    """Seconds before the next connection attempt: doubling from `low`, capped at `high`."""
    return min(high, low * 2 ** min(max(failures - 1, 0), 30))


def _level(text: str) -> str:
    """One topic level: no separators or wildcards."""
    return "".join("_" if c in "/+#\0" else c for c in text)[:MAX_TEXT] or "_"


# ---- the client ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _Message:
    topic: str
    payload: bytes
    retain: bool


def client_id(prefix: str, secret: bytes) -> str:
    """The MQTT client id of the node publishing under `prefix`."""
    return "agora" + hashlib.sha256(secret + prefix.encode()).hexdigest()[:16]


class Telemetry:
    """Publishes the node's status and events; `start` after the node is active, `stop` last.

    With an empty URL both are no-ops, so the daemon needs no branch.
    """

    def __init__(
        self,
        url: str,
        snapshot: Callable[[], dict[str, Any]],
        *,
        every_s: float = 5.0,
        backoff: tuple[float, float] = (1.0, 60.0),
        max_queue: int = 256,
        keepalive_s: int = 15,
        timeout_s: float = 5.0,
        secret: bytes = b"",
        login: str = "",
    ) -> None:
        """`secret`: what makes the MQTT client id unguessable (the daemon derives it from
        its private key, so it is also the same after a restart). `login`: a file holding
        the broker's USER:PASSWORD (`read_login`), read at each connection."""
        self.broker = Broker.parse(url) if url else None
        self._secret = secret
        self._login = login
        clear = self.broker is not None and not self.broker.tls
        if login and clear and self.broker.host not in ("127.0.0.1", "::1", "localhost"):
            log.warning(
                "telemetry: the MQTT login goes to %s in the clear (mqtt://); "
                "use mqtts:// beyond this machine",
                self.broker.host,
            )
        self._snapshot = snapshot
        self.every_s, self.backoff, self.keepalive_s, self.timeout_s = (
            every_s,
            backoff,
            keepalive_s,
            timeout_s,
        )
        self.queue: deque[_Message] = deque()
        self.max_queue = max_queue
        self.dropped = 0
        self.connected = False
        self.connects = 0
        self.failures = 0
        self.prefix = ""
        self._last: dict[str, Any] | None = None
        self._node: dict[str, Any] = {}
        self._wake = asyncio.Event()
        self._closing = False
        self._sampler: asyncio.Task | None = None
        self._sender: asyncio.Task | None = None

    def start(self) -> None:
        if self.broker is None or self._sender is not None:
            return
        if not _have_aiomqtt():  # check_url refused this at configuration already
            log.error("telemetry: %s", INSTALL_HINT)
            return
        node = self._snapshot()["node"]
        self.prefix = telemetry_prefix(_level(node["run_id"]), _level(node["peer_id"]))
        self._observe()
        self._sampler = asyncio.create_task(self._sample_loop())
        self._sender = asyncio.create_task(self._connection_loop())

    async def stop(self, flush_s: float = 3.0) -> None:
        """Say the node left (events, then a retained "left"); while connected, flush for up
        to `flush_s`."""
        if self._sender is None or self._closing:
            return
        self._sampler.cancel()
        with contextlib.suppress(Exception):
            self._observe()
        gone = {"state": "left", "peer_id": self._node.get("peer_id"), "at": time.time()}
        self._put(self.prefix + "/status", encode(gone), retain=True)
        self._closing = True
        self._wake.set()
        flush_s = flush_s if self.connected else 0.0  # a broker that is down costs no time
        done, _ = await asyncio.wait({self._sender}, timeout=flush_s)
        if not done:
            self._sender.cancel()
            await asyncio.wait({self._sender}, timeout=1.0)
        await asyncio.wait({self._sampler}, timeout=1.0)

    # ---- producing ----
    def _observe(self) -> None:
        """Read a snapshot; queue its events and the status."""
        node = self._snapshot()["node"]
        if node.get("stage") is None and node.get("state") != "leaving":
            return  # between two stages: wait for the next one
        self._node = node
        for event in events_between(self._last, node):
            event |= {"at": time.time()}
            self._put(self.prefix + "/events", encode(event), retain=False)
        self._last = node
        self._put(self.prefix + "/status", encode(status_payload(node, self.dropped)), retain=True)

    async def _sample_loop(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                self._observe()
            except Exception as exc:  # a snapshot bug must not stop the daemon
                log.warning("telemetry: could not read the status (%r)", exc)

    def _put(self, topic: str, payload: bytes, retain: bool) -> None:
        if retain:  # a newer retained status supersedes a queued one: not a drop
            for old in [m for m in self.queue if m.topic == topic and m.retain]:
                self.queue.remove(old)
        if len(self.queue) >= self.max_queue:
            self.queue.popleft()
            self.dropped += 1
        self.queue.append(_Message(topic, payload, retain))
        self._wake.set()

    # ---- sending ----
    async def _connection_loop(self) -> None:
        import aiomqtt

        rng = random.Random()
        while True:
            try:
                login = await asyncio.to_thread(read_login, self._login) if self._login else None
                client = self._client(aiomqtt, login)
                first = _read_ending(client)
                async with client:
                    _read_ending(client, seen=first)
                    self.connected, self.connects = True, self.connects + 1
                    await self._drain(client)
                    return  # closing, and everything queued is out
            except Exception as exc:  # the broker's trouble is never the node's
                self.failures += 1
                if self.failures & (self.failures - 1) == 0:  # 1, 2, 4, 8...: now and then
                    log.warning(
                        "telemetry: broker %s:%d: %s (attempt %d; %d queued, %d dropped)",
                        self.broker.host,
                        self.broker.port,
                        exc or type(exc).__name__,
                        self.failures,
                        len(self.queue),
                        self.dropped,
                    )
            finally:
                self.connected = False
            if self._closing:
                return
            delay = backoff_s(self.failures, *self.backoff)
            await asyncio.sleep(delay * (0.5 + rng.random() / 2))

    def _client(self, aiomqtt: Any, login: tuple[str, str] | None = None) -> Any:
        will = {"state": "gone", "peer_id": self._node.get("peer_id")}
        user, password = login or (None, None)
        return aiomqtt.Client(
            self.broker.host,
            self.broker.port,
            username=user,
            password=password,
            # Stable, so a reconnect takes the old session over at once (its will, if any,
            # lands before our next status) instead of lingering until its keepalive ends;
            # secret, since whoever connects with it takes the session over (the broker
            # cut this node off and fired its "gone" will: it was the hash of public names);
            # 21 letters and digits, which every MQTT 3.1.1 broker must accept.
            identifier=client_id(self.prefix, self._secret),
            logger=_client_log,
            will=aiomqtt.Will(self.prefix + "/status", encode(will), qos=1, retain=True),
            keepalive=self.keepalive_s,
            timeout=self.timeout_s,
            tls_context=ssl.create_default_context() if self.broker.tls else None,
            # We subscribe to nothing; a broker that sends anyway costs one slot, not memory.
            max_queued_incoming_messages=1,
        )

    async def _drain(self, client: Any) -> None:
        announced = False
        while True:
            while self.queue:
                msg = self.queue[0]
                await client.publish(msg.topic, msg.payload, qos=1, retain=msg.retain)
                # A broker that accepts and then drops every connection is not back: the
                # back-off (and the warnings' spacing) resets on an acknowledged message.
                if not announced:
                    announced = True
                    log.info(
                        "telemetry: publishing to %s:%d under %s%s",
                        self.broker.host,
                        self.broker.port,
                        self.prefix,
                        f" (after {self.failures} failed attempts)" if self.failures else "",
                    )
                    self.failures = 0
                if self.queue and self.queue[0] is msg:
                    self.queue.popleft()
            if self._closing:
                return
            self._wake.clear()
            await self._wake.wait()
