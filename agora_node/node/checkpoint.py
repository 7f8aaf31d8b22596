"""Checkpoints: atomic, checksummed, the last few kept.

A checkpoint is two files in a directory: `ckpt-<step>.pt` (torch.save of the
state) and `ckpt-<step>.json` (run id, stage, step, sha256 of the .pt, and the
peer id of the node that wrote it). The .pt
is written to a temporary name, fsynced and renamed; the .json, written the
same way after it, is the commit marker. A crash at any moment leaves either the
previous checkpoint or the new one, never a torn file that loads. A node never
resumes from a checkpoint that another identity wrote (a shared data dir).

Saves in one process take turns (a periodic save still running when the leave's starts),
each temporary file has a name of its own, and a save of a step already saved with the
same content writes nothing. Saved again with other content, a crash between the two
files leaves the old marker beside the new .pt: its digest fails and the step is skipped
for the one before, as for any torn checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)
_NAME = re.compile(r"ckpt-(\d{9})\.json$")


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    run_id: str
    stage: int
    step: int
    sha256: str
    peer_id: str | None = None
    """The identity that wrote it (None: written before checkpoints recorded it)."""


_SAVING = threading.Lock()
"""One save at a time in this process (the data dir's lock keeps other daemons out)."""
_TMP_GLOB = ".ckpt-*.tmp"


def _atomic_write(path: Path, data: bytes) -> None:
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(name)
    try:
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not also keep a partial copy
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_checkpoint(
    directory: str | os.PathLike,
    *,
    run_id: str,
    stage: int,
    step: int,
    state: dict[str, Any],
    keep: int = 3,
    peer_id: str | None = None,
) -> CheckpointInfo:
    """Write `state` as the checkpoint of `step`; keep the newest `keep` checkpoints."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    digest = hashlib.sha256(payload).hexdigest()
    pt = directory / f"ckpt-{step:09d}.pt"
    marker = pt.with_suffix(".json")
    meta = {"run_id": run_id, "stage": stage, "step": step, "sha256": digest}
    if peer_id is not None:
        meta["peer_id"] = peer_id
    info = CheckpointInfo(pt, run_id, stage, step, digest, peer_id)
    with _SAVING:
        for stale in directory.glob(_TMP_GLOB):  # a crashed save's; no other save is running
            stale.unlink(missing_ok=True)
        if _committed(marker) == meta and pt.is_file():
            return info  # this step, this content: already on disk
        _atomic_write(pt, payload)
        _atomic_write(marker, json.dumps(meta).encode())
        for old in list_checkpoints(directory)[keep:]:
            for p in (old.path, old.path.with_suffix(".json")):
                p.unlink(missing_ok=True)
    return info


def _committed(marker: Path) -> dict[str, Any] | None:
    try:
        return json.loads(marker.read_text())
    except (OSError, ValueError):
        return None


def list_checkpoints(directory: str | os.PathLike) -> list[CheckpointInfo]:
    """Committed checkpoints in `directory`, newest first (content not verified yet)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for meta_path in directory.glob("ckpt-*.json"):
        if not _NAME.search(meta_path.name):
            continue
        try:
            meta = json.loads(meta_path.read_text())
            found.append(
                CheckpointInfo(
                    meta_path.with_suffix(".pt"),
                    str(meta["run_id"]),
                    int(meta["stage"]),
                    int(meta["step"]),
                    str(meta["sha256"]),
                    meta.get("peer_id"),
                )
            )
        except (ValueError, KeyError, OSError) as exc:
            log.warning("ignoring unreadable checkpoint marker %s: %s", meta_path, exc)
    return sorted(found, key=lambda c: c.step, reverse=True)


def load_latest_checkpoint(
    directory: str | os.PathLike, *, run_id: str, stage: int, peer_id: str | None = None
) -> tuple[CheckpointInfo, dict[str, Any]] | None:
    """The newest checkpoint of this run and stage whose checksum verifies, or None.

    With `peer_id`, a checkpoint that another identity wrote is skipped (one that
    records no peer id predates the field and is accepted).
    """
    for info in list_checkpoints(directory):
        if info.run_id != run_id or info.stage != stage:
            continue
        if peer_id is not None and info.peer_id not in (None, peer_id):
            log.warning(
                "skipping checkpoint %s: written by peer %s, not by this node's identity %s",
                info.path,
                info.peer_id,
                peer_id,
            )
            continue
        try:
            payload = info.path.read_bytes()
        except OSError as exc:
            log.warning("skipping checkpoint %s: %s", info.path, exc)
            continue
        if hashlib.sha256(payload).hexdigest() != info.sha256:
            log.warning("skipping checkpoint %s: checksum mismatch (corrupt file)", info.path)
            continue
        return info, torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    return None
