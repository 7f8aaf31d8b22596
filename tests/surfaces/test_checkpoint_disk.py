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


def test_saves_at_once_take_turns_and_each_lands_whole(tmp_path):
    """A periodic save still running when the leave's begins (both in threads): neither
    fails nor mixes the other's bytes; the newest checkpoint is one of the two, whole."""
    import threading

    states = [{"w": torch.full((1 << 16,), float(i))} for i in range(2)]
    errors: list[BaseException] = []

    def save(state: dict) -> None:
        try:
            save_checkpoint(tmp_path, run_id="r", stage=0, step=5, state=state)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(s,)) for s in states]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    info, loaded = load_latest_checkpoint(tmp_path, run_id="r", stage=0)
    assert info.step == 5 and any(torch.equal(loaded["w"], s["w"]) for s in states)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-000000001.json",
        "ckpt-000000001.pt",
        "ckpt-000000002.json",
        "ckpt-000000002.pt",
    ]


def test_the_same_step_again_writes_nothing_and_a_crash_rewriting_it_keeps_the_old(
    tmp_path, monkeypatch
):
    first = save_checkpoint(tmp_path, run_id="r", stage=0, step=3, state={"w": torch.ones(4)})
    before = (tmp_path / "ckpt-000000001.pt").stat().st_mtime_ns
    again = save_checkpoint(tmp_path, run_id="r", stage=0, step=3, state={"w": torch.ones(4)})
    assert again == first and (tmp_path / "ckpt-000000001.pt").stat().st_mtime_ns == before

    def crash(src, dst) -> None:  # noqa: ANN001 - the process dies before the .pt lands
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, run_id="r", stage=0, step=3, state={"w": torch.zeros(4)})
    monkeypatch.undo()
    info, loaded = load_latest_checkpoint(tmp_path, run_id="r", stage=0)
    assert info.step == 3 and torch.equal(loaded["w"], torch.ones(4))  # the old one, whole


def test_a_crashed_saves_temporary_file_is_removed_by_the_next_save(tmp_path):
    (tmp_path / ".ckpt-000000001.pt.abc123.tmp").write_bytes(b"partial")
    save_checkpoint(tmp_path, run_id="r", stage=0, step=2, state={"w": torch.ones(4)})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-000000001.json",
        "ckpt-000000001.pt",
    ]


def test_the_newest_save_wins_though_its_step_is_lower(tmp_path):
    """A daemon's step is its inner optimizer's, which starts at 0 again when it adopts
    its replicas' state: the save after that is still the newest, kept and resumed from
    (ordered by step it was pruned as it was written, and a restart went back)."""
    for step in (1000, 1100, 1200):
        save_checkpoint(tmp_path, run_id="r", stage=0, step=step, state={"w": torch.ones(4)})
    adopted = {"w": torch.full((4,), 7.0)}
    info = save_checkpoint(tmp_path, run_id="r", stage=0, step=300, state=adopted)
    assert info.path.is_file()
    assert [c.step for c in list_checkpoints(tmp_path)] == [300, 1200, 1100]
    found, loaded = load_latest_checkpoint(tmp_path, run_id="r", stage=0)
    assert found.step == 300 and torch.equal(loaded["w"], adopted["w"])


def test_checkpoints_named_by_step_before_seq_existed_still_order_before_new_ones(tmp_path):
    """An older daemon's markers carry no seq and are named by their step: the next save
    is numbered above them, so it is the newest."""
    old = save_checkpoint(tmp_path, run_id="r", stage=0, step=1, state={"w": torch.ones(4)})
    old.path.rename(tmp_path / "ckpt-000000500.pt")
    marker = old.path.with_suffix(".json")
    marker.rename(tmp_path / "ckpt-000000500.json")
    info = save_checkpoint(tmp_path, run_id="r", stage=0, step=2, state={"w": torch.zeros(4)})
    assert info.seq == 501
    assert [c.step for c in list_checkpoints(tmp_path)] == [2, 1]


def test_damaged_checkpoints_are_set_aside_and_take_no_place_of_a_good_one(tmp_path):
    """A damaged marker (ckpt-4.json) and a damaged file (ckpt-5.pt): the node resumed
    from ckpt-3, and later saves deleted ckpt-3 and kept both damaged ones (4 .pt files on
    disk, against the 3 kept), warning about the marker at every save."""
    for step in range(1, 6):
        save_checkpoint(tmp_path, run_id="r", stage=0, step=step, state={"w": torch.ones(4)})
    (tmp_path / "ckpt-000000004.json").write_text("{not json")
    (tmp_path / "ckpt-000000005.pt").write_bytes(b"damaged")
    info, _ = load_latest_checkpoint(tmp_path, run_id="r", stage=0)
    assert info.step == 3
    for step in range(6, 9):
        save_checkpoint(tmp_path, run_id="r", stage=0, step=step, state={"w": torch.ones(4)})
    kept = sorted(p.name for p in tmp_path.glob("ckpt-*.pt"))
    assert len(kept) == 3 and [c.step for c in list_checkpoints(tmp_path)] == [8, 7, 6]
    aside = sorted(p.name for p in tmp_path.glob("*.corrupt"))
    assert aside == [
        "ckpt-000000004.json.corrupt",
        "ckpt-000000004.pt.corrupt",
        "ckpt-000000005.json.corrupt",
        "ckpt-000000005.pt.corrupt",
    ]


def test_a_marker_without_its_file_takes_no_place_of_a_good_one(tmp_path):
    """A QA run: a marker whose .pt was deleted stayed, took one of the 3 kept places, and
    two saves later the good checkpoint before it had been pruned (2 usable left)."""
    for step in range(1, 4):
        save_checkpoint(tmp_path, run_id="r", stage=0, step=step, state={"w": torch.ones(4)})
    (tmp_path / "ckpt-000000003.pt").unlink()
    info, _ = load_latest_checkpoint(tmp_path, run_id="r", stage=0)
    assert info.step == 2
    for step in range(4, 6):
        save_checkpoint(tmp_path, run_id="r", stage=0, step=step, state={"w": torch.ones(4)})
    assert [c.step for c in list_checkpoints(tmp_path)] == [5, 4, 2]
    assert [p.name for p in tmp_path.glob("*.corrupt")] == ["ckpt-000000003.json.corrupt"]
