"""The control API: mutating actions on a running daemon, over gRPC on a Unix socket.

Only the owner may act on a daemon, so the API listens on a Unix socket with
0600 permissions (in a 0700 directory when we create it) instead of TCP. There
is no protoc step: `grpc.aio` generic handlers carry JSON bytes both ways.

Service `agora.Control`:

| method        | request           | response                                    |
| ------------- | ----------------- | ------------------------------------------- |
| `Leave`       | `{}`              | what `handlers.leave()` returned, or `{}`   |
| `Checkpoint`  | `{}`              | `{"path": str}`                             |
| `SwitchStage` | `{"stage": int}`  | what `handlers.switch_stage()` returned     |
| `Status`      | `{}`              | the status snapshot                         |

`Leave` is answered at once: it only asks the daemon to stop (`NodeControl.leave`
sets its stop event and answers `{"leaving": true, "peer_id": ...}`). The daemon
then drains, checkpoints, calls `ControlServer.stop()` and exits; a client that
must wait for that watches the daemon's pid or the socket (`agora-node leave` does).
Handler errors reach the client as one line: a `ValueError` as "invalid
argument", anything else as "failed".
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import socket
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import grpc

if TYPE_CHECKING:
    from agora_node.node.daemon import Node

log = logging.getLogger(__name__)

SERVICE = "agora.Control"
METHODS = ("Leave", "Checkpoint", "SwitchStage", "Status")
# sockaddr_un.sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_SOCKET_PATH = 107


class ControlHandlers(Protocol):
    async def leave(self) -> dict[str, Any] | None: ...
    async def checkpoint(self) -> str: ...
    async def switch_stage(self, stage: int) -> dict[str, Any]: ...
    async def status(self) -> dict[str, Any]: ...


class NodeControl:
    """What the control API may ask of the node (daemon.Node): ControlHandlers for it."""

    def __init__(self, node: Node) -> None:
        self.node = node

    async def leave(self) -> dict:
        self.node.stop_event.set()
        answer = {"leaving": True, "peer_id": self.node.peer_id}
        if self.node.checkpoint_error is not None:  # `agora-node leave` warns and exits 1
            answer["checkpoint_error"] = self.node.checkpoint_error
        return answer

    def _serving(self) -> None:
        if self.node.service is None or self.node.manifest is None:  # the socket opens first
            raise ValueError(f"this node is {self.node.state.value}: it serves no stage yet")

    async def checkpoint(self) -> str:
        self._serving()
        return await self.node.checkpoint()

    async def switch_stage(self, stage: int) -> dict:
        self._serving()
        await self.node.switch_stage(int(stage), "requested through the control API")
        return {"stage": self.node.service.index, "state": self.node.state.value}

    async def status(self) -> dict:
        return self.node.snapshot()


class ControlError(Exception):
    """A control call or the control server failed; the message is one line."""


def _encode(obj: Any) -> bytes:
    return json.dumps({} if obj is None else obj).encode()


def _decode(data: bytes) -> Any:
    return json.loads(data) if data else {}


def someone_listens(path: Path) -> bool:
    """True if a process accepts connections on the Unix socket at `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True  # e.g. EAGAIN on a full backlog: alive, just busy
        return True


# -- server ------------------------------------------------------------------


class ControlServer:
    """Serves `agora.Control` on the Unix socket `socket_path` for `handlers`."""

    def __init__(self, socket_path: str | Path, handlers: ControlHandlers) -> None:
        self.socket_path = Path(socket_path)
        self._handlers = handlers
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        path = self.socket_path
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise ControlError(
                f"control socket path is too long (>{MAX_SOCKET_PATH} bytes): {path}"
            )
        try:
            self._prepare_path(path)
        except OSError as exc:  # its directory under a file, not writable, ...
            raise ControlError(
                f"control socket {path} is not usable ({exc.strerror or exc}): "
                "pass --control-socket"
            ) from None
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((self._generic_handler(),))
        try:
            bound = server.add_insecure_port(f"unix:{path}")
        except RuntimeError:  # grpc raises where it once returned 0
            bound = 0
        if bound == 0:
            raise ControlError(f"cannot listen on control socket {path}: pass --control-socket")
        # grpc creates the file with the umask's mode; tighten it before serving.
        os.chmod(path, 0o600)
        await server.start()
        self._server = server
        log.info("control API on %s", path)

    @staticmethod
    def _prepare_path(path: Path) -> None:
        if not path.parent.exists():
            path.parent.mkdir(mode=0o700, parents=True)
        elif not path.parent.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "a file is in the way of its directory")
        if not path.exists() and not path.is_symlink():
            return
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ControlError(f"{path} exists and is not a socket: pass --control-socket")
        if someone_listens(path):
            raise ControlError(
                f"another agora-node daemon is listening on {path}: pass --control-socket"
            )
        path.unlink()  # left behind by a daemon that was killed

    async def stop(self, grace: float = 2.0) -> None:
        """Stop serving; calls in progress get `grace` seconds to finish."""
        if self._server is None:
            return
        await self._server.stop(grace)
        self._server = None
        self.socket_path.unlink(missing_ok=True)

    def _generic_handler(self) -> grpc.GenericRpcHandler:
        behaviours = {
            "Leave": self._leave,
            "Checkpoint": self._checkpoint,
            "SwitchStage": self._switch_stage,
            "Status": self._status,
        }
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                name: grpc.unary_unary_rpc_method_handler(
                    _guarded(name, fn), request_deserializer=_decode, response_serializer=_encode
                )
                for name, fn in behaviours.items()
            },
        )

    async def _leave(self, request: dict[str, Any]) -> Any:
        return await self._handlers.leave()

    async def _checkpoint(self, request: dict[str, Any]) -> Any:
        return {"path": str(await self._handlers.checkpoint())}

    async def _switch_stage(self, request: dict[str, Any]) -> Any:
        stage = request.get("stage") if isinstance(request, dict) else None
        if not isinstance(stage, int) or isinstance(stage, bool) or stage < 0:
            raise ValueError(f"stage must be a non-negative integer, got {stage!r}")
        return await self._handlers.switch_stage(stage)

    async def _status(self, request: dict[str, Any]) -> Any:
        return await self._handlers.status()


def _guarded(
    name: str, fn: Callable[[dict[str, Any]], Awaitable[Any]]
) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
    """Turn handler exceptions into gRPC status codes with a one-line message."""

    async def behaviour(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:
            log.exception("control %s failed", name)
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    return behaviour


# -- client ------------------------------------------------------------------


async def control_call(
    socket_path: str | Path, method: str, payload: dict[str, Any] | None = None, timeout: float = 5
) -> dict[str, Any]:
    """Call `method` on the daemon at `socket_path`; raises ControlError with one line."""
    if method not in METHODS:
        raise ControlError(f"unknown control method {method!r}; one of {', '.join(METHODS)}")
    path = Path(socket_path)
    if not path.exists():
        raise ControlError(f"no agora-node daemon listening on {path}")
    if not os.access(path, os.R_OK | os.W_OK):
        raise ControlError(f"permission denied on {path}: is the daemon run by another user?")
    # A channel of its own subchannels: from grpc's process-wide pool, a call right after a
    # failed one (a daemon restarting on the same socket) can inherit its reconnect backoff
    # and fail at once with UNAVAILABLE although the daemon now listens.
    options = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(f"unix:{path}", options=options) as channel:
        call = channel.unary_unary(
            f"/{SERVICE}/{method}", request_serializer=_encode, response_deserializer=_decode
        )
        try:
            return await call(payload or {}, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise _call_error(exc, path, method, timeout) from None


def _call_error(exc: grpc.aio.AioRpcError, path: Path, method: str, timeout: float) -> ControlError:
    code = exc.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return ControlError(f"no agora-node daemon listening on {path}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ControlError(f"the daemon on {path} did not finish {method} within {timeout:g} s")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ControlError(f"{method}: invalid argument: {exc.details()}")
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return ControlError(f"the daemon on {path} does not support {method} (older version?)")
    return ControlError(f"{method} failed: {exc.details()}")


def control_call_sync(
    socket_path: str | Path, method: str, payload: dict[str, Any] | None = None, timeout: float = 5
) -> dict[str, Any]:
    """`control_call` for code without a running event loop (the CLI)."""
    return asyncio.run(control_call(socket_path, method, payload, timeout))
