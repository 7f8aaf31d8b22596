"""A periodic checkpoint cut by the leave: its task is cancelled, but its writing thread
runs on. The leave's newer snapshot must still be the newest checkpoint on disk
(checkpoints are ordered by when they are saved)."""

import asyncio
import contextlib
import threading
from types import SimpleNamespace

import pytest
import torch

from agora_node.node import checkpoint, service
from agora_node.node.service import StageService

pytestmark = pytest.mark.timeout(60)


class _Rounds:
    def __init__(self) -> None:
        self.value = 0.0
        self.replica_ids = lambda: ["partner"]

    @contextlib.asynccontextmanager
    async def consistent(self):  # noqa: ANN201
        yield

    def state_dict(self) -> dict:
        return {"round": 0}


def test_a_cancelled_save_lands_before_the_next_snapshot(tmp_path, monkeypatch):
    rounds = _Rounds()
    state = {"w": 0.0}

    async def call(fn, *args):  # noqa: ANN001, ANN202
        return fn(*args)

    worker = SimpleNamespace(
        call=call,
        state_dict=lambda: {"w": torch.tensor(state["w"])},
        optimizer=SimpleNamespace(steps=7),
    )
    ctx = SimpleNamespace(
        checkpoint_dir=lambda i: tmp_path,
        manifest=SimpleNamespace(run_id="r"),
        peer_id="me",
        peers_of=lambda stage: ["me", "partner", "liar"],
        suspects=SimpleNamespace(is_banned=lambda p: p == "liar"),
    )
    node = SimpleNamespace(
        ctx=ctx, worker=worker, rounds=rounds, index=0,
        _checkpointing=asyncio.Lock(), _saving=None,
    )  # fmt: skip
    release, first, second = threading.Event(), threading.Event(), threading.Event()
    real = checkpoint.save_checkpoint

    def slow_first(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if not first.is_set():
            first.set()
            assert release.wait(30)
        else:
            second.set()
        return real(*args, **kwargs)

    monkeypatch.setattr(service, "save_checkpoint", slow_first)

    async def play() -> None:
        periodic = asyncio.create_task(StageService.checkpoint(node))
        await asyncio.to_thread(first.wait, 30)
        periodic.cancel()  # the leave cancels the periodic save; its thread runs on
        with contextlib.suppress(asyncio.CancelledError):
            await periodic
        state["w"] = 1.0  # trained on: the leave's snapshot is newer
        leave = asyncio.create_task(StageService.checkpoint(node))
        # the leave's write may not start while the cut one's thread is still writing
        # (before, it did, and finished first): give it the chance, then let the first go
        if await asyncio.to_thread(second.wait, 2.0):
            await leave
        release.set()
        await leave

    asyncio.run(play())
    _, loaded = checkpoint.load_latest_checkpoint(tmp_path, run_id="r", stage=0)
    assert float(loaded["w"]) == 1.0 and loaded["replicas"] == ["partner"]
