"""A checkpoint that fails to write (a full disk) leaves the previous one and no partial file."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from agora_node.node import checkpoint
from agora_node.node.checkpoint import list_checkpoints, load_latest_checkpoint, save_checkpoint

pytestmark = pytest.mark.timeout(60)


def test_a_full_disk_keeps_the_previous_checkpoint_and_no_partial_file(tmp_path, monkeypatch):
    state = {"w": torch.ones(4)}
    save_checkpoint(tmp_path, run_id="r", stage=0, step=1, state=state)

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(tmp_path, run_id="r", stage=0, step=2, state={"w": torch.zeros(4)})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-000000001.json",
        "ckpt-000000001.pt",
    ]
    assert [c.step for c in list_checkpoints(tmp_path)] == [1]
    info, loaded = load_latest_checkpoint(tmp_path, run_id="r", stage=0)
    assert info.step == 1 and torch.equal(loaded["w"], state["w"])
