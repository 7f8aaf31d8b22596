"""Control API over a real Unix socket: permissions, each method, clear errors."""

from __future__ import annotations

import asyncio
import socket
import stat
from pathlib import Path
from typing import Any

import pytest

from agora_node.node.control import (
    ControlError,
    ControlServer,
    control_call,
    control_call_sync,
)

pytestmark = pytest.mark.timeout(60)


class FakeHandlers:
    """Records which daemon action the control API asked for."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def leave(self) -> dict[str, Any]:
        self.calls.append(("leave", None))
        return {"state": "leaving", "checkpoint": "/ckpt/step-120.pt"}

    async def checkpoint(self) -> str:
        self.calls.append(("checkpoint", None))
        return "/ckpt/step-121.pt"

    async def switch_stage(self, stage: int) -> dict[str, Any]:
        self.calls.append(("switch_stage", stage))
        if stage == 99:
            raise RuntimeError("stage 99 does not exist in this run")
        return {"from": 1, "to": stage}

    async def status(self) -> dict[str, Any]:
        self.calls.append(("status", None))
        return {"peer_id": "me", "state": "active"}


@pytest.fixture
def sock(tmp_path: Path) -> Path:
    return tmp_path / "run" / "control.sock"


@pytest.fixture
async def control(sock: Path):
    handlers = FakeHandlers()
    server = ControlServer(sock, handlers)
    await server.start()
    try:
        yield handlers
    finally:
        await server.stop()


async def test_socket_is_owner_only(control, sock: Path):
    assert stat.S_ISSOCK(sock.stat().st_mode)
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700


async def test_each_method_reaches_its_handler(control: FakeHandlers, sock: Path):
    assert await control_call(sock, "Leave") == {
        "state": "leaving",
        "checkpoint": "/ckpt/step-120.pt",
    }
    assert await control_call(sock, "Checkpoint") == {"path": "/ckpt/step-121.pt"}
    assert await control_call(sock, "SwitchStage", {"stage": 2}) == {"from": 1, "to": 2}
    assert await control_call(sock, "Status") == {"peer_id": "me", "state": "active"}
    assert control.calls == [
        ("leave", None),
        ("checkpoint", None),
        ("switch_stage", 2),
        ("status", None),
    ]


@pytest.mark.parametrize("payload", [{}, {"stage": -1}, {"stage": "1"}, {"stage": True}])
async def test_switch_stage_validates(control: FakeHandlers, sock: Path, payload):
    with pytest.raises(ControlError, match="SwitchStage: invalid argument: stage must be"):
        await control_call(sock, "SwitchStage", payload)
    assert control.calls == []


async def test_handler_failure_is_one_line(control, sock: Path):
    with pytest.raises(ControlError) as info:
        await control_call(sock, "SwitchStage", {"stage": 99})
    assert (
        str(info.value) == "SwitchStage failed: RuntimeError: stage 99 does not exist in this run"
    )


async def test_missing_socket_is_a_clear_error(tmp_path: Path):
    path = tmp_path / "nothing.sock"
    with pytest.raises(ControlError, match=f"^no agora-node daemon listening on {path}$"):
        await control_call(path, "Status")


async def test_unknown_method_is_refused(sock: Path):
    with pytest.raises(ControlError, match="unknown control method"):
        await control_call(sock, "Reboot")


async def test_stale_socket_is_replaced(sock: Path):
    sock.parent.mkdir(mode=0o700)
    dead = socket.socket(socket.AF_UNIX)  # bound, never listening: what a SIGKILL leaves
    dead.bind(str(sock))
    dead.close()
    with pytest.raises(ControlError, match="no agora-node daemon listening"):
        await control_call(sock, "Status")
    server = ControlServer(sock, FakeHandlers())
    await server.start()
    try:
        assert (await control_call(sock, "Status"))["state"] == "active"
    finally:
        await server.stop()
    assert not sock.exists()


async def test_live_socket_is_not_stolen(control, sock: Path):
    with pytest.raises(ControlError, match="another agora-node daemon is listening"):
        await ControlServer(sock, FakeHandlers()).start()
    assert (await control_call(sock, "Status"))["state"] == "active"


async def test_regular_file_is_not_removed(tmp_path: Path):
    path = tmp_path / "control.sock"
    path.write_text("precious")
    with pytest.raises(ControlError, match="is not a socket"):
        await ControlServer(path, FakeHandlers()).start()
    assert path.read_text() == "precious"


async def test_sync_wrapper(control, sock: Path):
    # The sync wrapper runs its own loop, as the CLI does; here in a thread so
    # that this test's loop keeps serving.
    result = await asyncio.to_thread(control_call_sync, sock, "Checkpoint")
    assert result == {"path": "/ckpt/step-121.pt"}
