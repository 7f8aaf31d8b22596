"""Node.switch_stage when the checkpoint before the switch fails (a full disk): it raised
through the rebalance loop, so the node left; from the control API it left the node
warming with its service closed and its record withdrawn, never to train again."""

from __future__ import annotations

import types

import pytest

from agora_node.node import daemon
from agora_node.node.daemon import Node
from agora_node.protocol.records import NodeState

pytestmark = pytest.mark.timeout(30)


class _Service:
    def __init__(self, index: int) -> None:
        self.index, self.closed = index, False

    async def drain(self, timeout: float) -> None:
        pass

    async def checkpoint(self) -> str:
        raise OSError(28, "No space left on device")

    async def close(self) -> None:
        self.closed = True


async def test_a_failed_checkpoint_before_a_switch_does_not_stop_the_switch(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(daemon, "node_record", lambda node: None)  # what withdraw is given
    old = _Service(1)
    opened: list[int] = []

    async def nothing(*_args, **_kwargs) -> None:  # noqa: ANN002, ANN003
        pass

    node = types.SimpleNamespace(
        manifest=types.SimpleNamespace(num_stages=3),
        state=NodeState.ACTIVE,
        service=old,
        config=types.SimpleNamespace(record_ttl_s=30.0, drain_timeout_s=1.0),
        liveness=types.SimpleNamespace(announce=lambda *a: None),
        directory=types.SimpleNamespace(withdraw=nothing),
        compute=types.SimpleNamespace(release_memory=lambda: None),
        stage_changes=[],
        can_hold=None,
        last_checkpoint=None,
        stats=types.SimpleNamespace(losses=[1.65, 1.79], val_loss=1.8),  # stage 1's
        _publish=nothing,
    )
    node._note_stage_change = types.MethodType(Node._note_stage_change, node)
    node.checkpoint = types.MethodType(Node.checkpoint, node)

    async def open_service(stage: int) -> None:
        opened.append(stage)
        node.service = _Service(stage)

    node._open_service = open_service
    await Node.switch_stage(node, 2, "test")
    assert old.closed and opened == [2]
    assert node.state == NodeState.ACTIVE and node.service.index == 2
    # the old stage's losses were shown as the new one's until it trained (for minutes)
    assert node.stats.losses == [] and node.stats.val_loss is None


async def test_a_stage_the_node_cannot_hold_is_refused_by_a_switch() -> None:
    """Through the control API a node without the run's data could be moved to stage 0."""
    node = types.SimpleNamespace(manifest=types.SimpleNamespace(num_stages=3), can_hold=[1, 2])
    with pytest.raises(ValueError, match="cannot serve stage 0"):
        await Node.switch_stage(node, 0, "asked")


@pytest.mark.parametrize(
    ("stage", "can_hold", "pinned"),
    [("auto", None, 0), ("auto", [0, 1, 2], 0), ("auto", [1, 2], 1), ("1", None, 1)],
)
def test_a_node_that_cannot_hold_every_stage_is_announced_pinned(stage, can_hold, pinned) -> None:  # noqa: ANN001
    """Others elected it to move to stage 0, which it could not serve (no data, or too
    little memory): it stayed, and they waited for it, with stage 0 empty."""
    from agora_node.node.snapshot import node_record

    node = types.SimpleNamespace(
        manifest=types.SimpleNamespace(num_stages=3, run_id="r" * 16),
        config=types.SimpleNamespace(stage=stage),
        can_hold=can_hold,
        service=None,
        peer_id="12D3KooWmine",
        stage=1,
        state=NodeState.ACTIVE,
        addrs=[],
    )
    node.limited = Node.limited.fget(node)
    assert node_record(node).pinned == pinned


async def test_a_limited_node_does_not_move_itself(monkeypatch) -> None:  # noqa: ANN001
    """Pinned in others' elections but not in its own, it elected itself while another
    node elected itself too: both moved, and their stage could be left with none."""
    import asyncio

    from agora_node.node import joining

    asked: list[int] = []
    monkeypatch.setattr(joining, "better_stage", lambda *a, **k: asked.append(1))
    stop = asyncio.Event()
    waits = [0]

    async def wait_stop(seconds: float) -> None:
        waits[0] += 1
        if waits[0] > 3:
            stop.set()

    for limited, expected in ((True, 0), (False, 3)):
        asked.clear()
        stop.clear()
        waits[0] = 0
        node = types.SimpleNamespace(
            peer_id="12D3KooWmine",
            config=types.SimpleNamespace(rebalance_every_s=1.0),
            stop_event=stop,
            state=NodeState.ACTIVE,
            limited=limited,
            view={},
            manifest=None,
            stage=1,
            can_hold=[1, 2] if limited else None,
            liveness=types.SimpleNamespace(answered=lambda peer: True),
            _wait_stop=wait_stop,
        )
        await Node._rebalance_loop(node)
        assert len(asked) == expected, limited


async def test_a_failed_checkpoint_is_remembered_until_one_succeeds() -> None:
    """A checkpoint that failed at every try (a file where its directory belongs) showed
    nowhere but the log, and a leave that could not write one exited 0: `agora-node
    leave` said the daemon left, as if nothing were lost."""
    from agora_node.node.control import NodeControl

    service = _Service(0)
    node = types.SimpleNamespace(
        service=service,
        last_checkpoint=None,
        checkpoint_error=None,
        stop_event=types.SimpleNamespace(set=lambda: None),
        peer_id="12D3KooWmine",
    )
    with pytest.raises(OSError):
        await Node.checkpoint(node)
    assert node.checkpoint_error == "OSError: [Errno 28] No space left on device"
    assert (await NodeControl(node).leave())["checkpoint_error"] == node.checkpoint_error

    async def written() -> str:
        return "/data/checkpoints/run/stage-0/ckpt-000000001.pt"

    service.checkpoint = written
    assert await Node.checkpoint(node) == "/data/checkpoints/run/stage-0/ckpt-000000001.pt"
    assert node.checkpoint_error is None
    assert "checkpoint_error" not in await NodeControl(node).leave()


def test_agora_node_leave_says_whether_the_leaves_own_checkpoint_was_written(
    monkeypatch, capsys, tmp_path
) -> None:  # noqa: ANN001
    """The CLI is not the daemon's parent: the daemon notes in its data dir how its leave
    ended. Read at the Leave request, the earlier failure said the opposite of the leave's
    own checkpoint when the operator had freed space in between."""
    import time

    from agora_node.node import datadir, status_cli

    answer = {"leaving": True, "peer_id": "12D3KooWmine", "checkpoint_error": "OSError: disk"}
    monkeypatch.setattr(status_cli, "control_call_sync", lambda *a, **k: answer)
    monkeypatch.setattr(status_cli, "_wait_gone", lambda *a: True)
    args = types.SimpleNamespace(control_socket=None, data_dir=str(tmp_path), timeout=5.0)

    def leave_ending(error: str | None) -> int:
        monkeypatch.setattr(
            status_cli,
            "control_call_sync",
            lambda *a, **k: datadir.note_left(tmp_path, error) or answer,
        )
        return status_cli.cmd_leave(args)

    assert leave_ending("OSError: still full") != 0
    assert "left without a checkpoint (OSError: still full)" in capsys.readouterr().err
    assert leave_ending(None) == 0  # space freed: the leave's own checkpoint was written
    assert "the daemon left" in capsys.readouterr().out
    # no note (a daemon of an older version, or a data dir it could not write to)
    (tmp_path / datadir.LEFT_NAME).write_text('{"at": %f}' % (time.time() - 3600))
    monkeypatch.setattr(status_cli, "control_call_sync", lambda *a, **k: answer)
    assert status_cli.cmd_leave(args) != 0
    assert "before the leave had failed (OSError: disk)" in capsys.readouterr().err
