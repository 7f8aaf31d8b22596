"""Checkpoints: atomic, checksummed, the last few kept.

A checkpoint is two files in a directory: `ckpt-<seq>.pt` (torch.save of the
state) and `ckpt-<seq>.json` (run id, stage, step, sha256 of the .pt, the peer id
of the node that wrote it, and `seq`). `seq` orders the checkpoints of a directory:
each save takes one more than the highest there. Not the step: a daemon's step is its
inner optimizer's, which starts again at 0 when it adopts its replicas' state (a
fresh optimizer), and ordered by it the newest save sorted below the older ones, was
pruned as it was written and never resumed from. (Markers written before `seq`
existed are named by their step, which stands in for it.) The .pt
is written to a temporary name, fsynced and renamed; the .json, written the
same way after it, is the commit marker. A crash at any moment leaves either the
previous checkpoint or the new one, never a torn file that loads. A node never
resumes from a checkpoint that another identity wrote (a shared data dir).

Saves in one process take turns (a periodic save still running when the leave's starts),
each temporary file has a name of its own, and a save of what the newest checkpoint
already holds (same step, same content) writes nothing. A crash between a save's two
files leaves a .pt without a marker: not listed, and the next save writes over it.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agora_node.node.datadir import fsync_dir, write_atomically

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
    seq: int = 0
    """Its place in the directory's order of saves (the newest is the highest)."""


_SAVING = threading.RLock()
"""One save at a time in this process (the data dir's lock keeps other daemons out)."""
_TMP_GLOB = ".ckpt-*.tmp"


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
    """Write `state` as the newest checkpoint (of `step`); keep the newest `keep`."""
    directory = Path(directory)
    if not directory.is_dir():
        directory.mkdir(parents=True, exist_ok=True)
        fsync_dir(directory.parent)  # else a power cut can take the new directory along
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    digest = hashlib.sha256(payload).hexdigest()
    meta: dict[str, Any] = {"run_id": run_id, "stage": stage, "step": step, "sha256": digest}
    if peer_id is not None:
        meta["peer_id"] = peer_id
    with _SAVING:
        for stale in directory.glob(_TMP_GLOB):  # a crashed save's; no other save is running
            stale.unlink(missing_ok=True)
        saved = list_checkpoints(directory)
        newest = saved[0] if saved else None
        if newest is not None and newest.path.is_file() and _same(newest, meta):
            return newest  # this step, this content: already on disk, the newest
        seq = newest.seq + 1 if newest is not None else 1
        meta["seq"] = seq
        pt = directory / f"ckpt-{seq:09d}.pt"
        write_atomically(pt, payload)
        write_atomically(pt.with_suffix(".json"), json.dumps(meta).encode())
        for old in list_checkpoints(directory)[keep:]:
            for p in (old.path, old.path.with_suffix(".json")):
                p.unlink(missing_ok=True)
    return CheckpointInfo(pt, run_id, stage, step, digest, peer_id, seq)


def _same(info: CheckpointInfo, meta: dict[str, Any]) -> bool:
    return (info.run_id, info.stage, info.step, info.sha256, info.peer_id) == (
        meta["run_id"],
        meta["stage"],
        meta["step"],
        meta["sha256"],
        meta.get("peer_id"),
    )


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
        named = _NAME.search(meta_path.name)
        if not named:
            continue
        try:
            meta = json.loads(meta_path.read_text())
            info = CheckpointInfo(
                meta_path.with_suffix(".pt"),
                str(meta["run_id"]),
                int(meta["stage"]),
                int(meta["step"]),
                str(meta["sha256"]),
                meta.get("peer_id"),
                int(named.group(1)),  # the name holds seq (the step before seq existed)
            )
            if not info.path.exists():  # its .pt is gone: it took one of the kept places
                with _SAVING:  # (not while a save prunes: that deletes the .pt first)
                    if meta_path.exists() and not info.path.exists():
                        log.warning("checkpoint marker %s has no %s", meta_path, info.path.name)
                        _quarantine(info.path)
                continue
            found.append(info)
        except OSError as exc:  # perhaps passing (EMFILE, EIO), or pruned meanwhile: left as is
            log.warning("could not read checkpoint marker %s: %s", meta_path, exc)
        except (ValueError, KeyError) as exc:
            log.warning("ignoring unreadable checkpoint marker %s: %s", meta_path, exc)
            with _SAVING:  # not while a save writes markers
                _quarantine(meta_path.with_suffix(".pt"))
    return sorted(found, key=lambda c: c.seq, reverse=True)


def _quarantine(pt: Path) -> None:
    """Set a damaged checkpoint aside (`.corrupt` appended to both its files): it no longer
    takes one of the `keep` places, so pruning does not delete a good one for it, and it
    is not warned about at every save. Kept, not deleted, for whoever wants to look."""
    for path in (pt, pt.with_suffix(".json")):
        try:
            path.rename(path.with_name(path.name + ".corrupt"))
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not set the damaged checkpoint file %s aside: %s", path, exc)


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
            log.warning(
                "skipping checkpoint %s: checksum mismatch (corrupt file; set aside as .corrupt)",
                info.path,
            )
            with _SAVING:
                _quarantine(info.path)
            continue
        return info, torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    return None
