"""A daemon's data dir: where it is by default, and the lock that makes it one daemon's.

Default: a node given neither `--data-dir` nor `--identity-path` uses
`~/.agora-node` (identity `~/.agora-node/identity.key`). A node given only
`--identity-path KEY` uses `~/.agora-node/nodes/<KEY's file name without suffix>`,
so several daemons on one machine, each with its own identity, never share
checkpoints or a control socket. A bare file name as `--identity-path` (`gpu0.key`,
no directory part) is a key in the data dir (`identity_file`), so the same command
run from any directory is the same peer; any other path is taken as given.

Lock: `lock_data_dir` takes an exclusive flock on `DATA_DIR/lock` and writes this
process's pid into it. The daemon holds it for its whole life; the kernel drops
it when the process dies, however it dies, so a SIGKILLed node never blocks its
own restart. hivemind forks its DHT process without exec: the child closes its
copy of the descriptor at once, so a straggling child cannot keep the lock. A joining
node holds its identity key the same way (`lock_identity`), so two daemons with one key
(say a second data dir given the first one's `--identity-path`) cannot both run.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
import tempfile
import time
from pathlib import Path

from agora_node.comms.reaper import proc_stat

log = logging.getLogger(__name__)

HOME = "~/.agora-node"
LOCK_NAME = "lock"

_held: dict[int, Path] = {}  # descriptor -> lock file, closed in forked children


class DataDirError(RuntimeError):
    """The data dir cannot be used: the cause and the fix in one line (exit code 1)."""


class DataDirInUse(DataDirError):
    """Another live process holds the data dir (one line for the operator, exit code 1)."""


def default_data_dir(identity_path: str | None, default_identity: str) -> Path:
    """`~/.agora-node` for the default identity, else `~/.agora-node/nodes/<identity stem>`."""
    home = Path(HOME).expanduser()
    if not identity_path:
        return home
    if is_bare_name(identity_path):  # a key in the data dir: identity_file
        return (
            home if identity_path == default_identity else home / "nodes" / Path(identity_path).stem
        )
    identity = Path(identity_path).expanduser().absolute()
    if identity == home.absolute() / default_identity:
        return home
    return home / "nodes" / identity.stem


def is_bare_name(path: str) -> bool:
    """A file name without a directory part (`gpu0.key`; not `./gpu0.key`, `~/k`, `/k`)."""
    return bool(path) and "/" not in path and not path.startswith("~") and path not in (".", "..")


def identity_file(data_dir: Path, identity_path: str | None, default_name: str) -> Path:
    """Where the identity key is: `data_dir/default_name` when no `--identity-path` is
    given, `data_dir/NAME` for a bare file name NAME (so it does not depend on the
    directory the command runs from), else the path given, made absolute."""
    if not identity_path:
        return data_dir / default_name
    if is_bare_name(identity_path):
        return data_dir / identity_path
    return Path(identity_path).expanduser().absolute()


class DataDirLock:
    """An exclusive hold on a data dir; released on `release()` or when the process dies."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            _held.pop(self._fd, None)
            os.close(self._fd)  # drops the flock; the file stays (unlinking would race)
            self._fd = None

    def __enter__(self) -> DataDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def write_atomically(path: Path, data: bytes) -> None:
    """`path` holds `data` or what it held before, whatever stops the write. The copy is
    made under a fresh random name (mkstemp: O_EXCL, mode 0600), so a file or symlink
    planted at a fixed temporary name is neither followed nor written through."""
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
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new entry in `directory` survive a power cut (where supported)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_private(directory: Path) -> None:
    """Refuse a data dir that other users can write: whoever can plant a file there can
    plant `identity.key` (this node then runs with a key they know), or a link where the
    node writes (root writing through it clobbers any file). Writable by everyone (even
    with the sticky bit, as /tmp), or owned by a user other than this one and root (root
    too: a container's root given a bind mount of its operator's is told to chown it, or
    to run as that user): DataDirError naming the fix. Writable by its group: a warning."""
    info = directory.stat()
    me = os.geteuid()
    if info.st_mode & stat.S_IWOTH:
        who, fix = "every user can write it", f"chmod o-w {directory}"
    elif info.st_uid not in (me, 0):
        who = f"user {info.st_uid} owns it"
        fix = f"chown {me} {directory} (or run as user {info.st_uid})"
    else:
        if info.st_mode & stat.S_IWGRP:
            log.warning("data dir %s is writable by its group: chmod g-w %s", directory, directory)
        return
    raise DataDirError(
        f"data dir {directory} is not private ({who}): another user could plant its identity "
        f"key; {fix}, or pass a --data-dir of this user's own"
    )


def lock_data_dir(data_dir: str | os.PathLike, name: str = LOCK_NAME) -> DataDirLock:
    """Hold `data_dir/name` for this process, or raise DataDirInUse naming the holder's pid.
    A data dir other users can write is refused first (`check_private`)."""
    directory = Path(data_dir).expanduser()
    path = directory / name
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_private(directory)
        # close-on-exec (not in exec'd children); never through a link, never a file with
        # another name too: it is truncated and written (a planted link made a root daemon
        # overwrite the file it named with its pid)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            os.close(fd)
            raise DataDirError(f"{path} is not a plain file of its own: move it away")
    except OSError as exc:
        raise unusable(directory, exc) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder_pid(fd)
        os.close(fd)
        raise DataDirInUse(
            f"data dir {directory} is in use by another agora-node daemon (pid {holder}); "
            "give this one its own --data-dir"
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        os.close(fd)
        raise unusable(directory, exc) from None
    _held[fd] = path
    return DataDirLock(path, fd)


def lock_identity(path: str | os.PathLike) -> DataDirLock | None:
    """Hold the identity key file itself (an flock, nothing written), or raise DataDirInUse:
    two daemons of one machine with one key would be one peer id to the swarm, each taking
    the other's connections and records. (A copy of the key on another machine is found by
    the swarm: joining.check_identity_unused.) None where the file system cannot lock it
    (some network file systems): then only that check guards."""
    key = Path(path).expanduser()
    try:  # for writing where allowed: NFS emulates flock with locks that need it
        fd = os.open(key, os.O_RDWR)  # close-on-exec: not in exec'd children
    except PermissionError:
        fd = os.open(key, os.O_RDONLY)
    except OSError as exc:
        raise unusable(key, exc, "identity key", "--identity-path") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DataDirInUse(
            f"identity key {key} is in use by another agora-node daemon on this machine; "
            "give each daemon its own --identity-path"
        ) from None
    except OSError as exc:
        os.close(fd)
        log.warning("cannot lock identity key %s (%s): not guarded on this machine", key, exc)
        return None
    _held[fd] = key
    return DataDirLock(key, fd)


LEFT_NAME = "left.json"
"""How the daemon's last leave ended, for `agora-node leave` (which is not its parent)."""


def note_left(data_dir: str | os.PathLike, checkpoint_error: str | None) -> None:
    """Record, as the daemon exits after a leave, whether its checkpoint was written."""
    try:
        body = {"at": time.time(), "checkpoint_error": checkpoint_error}
        write_atomically(Path(data_dir) / LEFT_NAME, json.dumps(body).encode())
    except OSError:  # the disk that refused the checkpoint may refuse this too: the exit
        pass  # code and the log still say it


def left_since(data_dir: str | os.PathLike, since: float) -> dict | None:
    """What `note_left` recorded at or after `since` (wall time), or None."""
    try:
        body = json.loads((Path(data_dir) / LEFT_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(body, dict) or not isinstance(body.get("at"), int | float):
        return None
    return body if body["at"] >= since else None


def holder_pid(data_dir: str | os.PathLike) -> int | None:
    """The pid written in `data_dir`'s lock file if that process is alive (the daemon
    holding it, or None). Reads only: it never takes the lock, so a daemon starting
    meanwhile cannot fail on it."""
    try:
        text = (Path(data_dir).expanduser() / LOCK_NAME).read_text(errors="replace").strip()
    except OSError:
        return None
    if not text.isdigit():
        return None
    return int(text) if alive(int(text)) else None


def alive(pid: int) -> bool:
    """Whether process `pid` runs (an exited one its parent has not reaped yet does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    fields = proc_stat(pid)  # Z is a zombie, X dead
    if fields is None:
        return True  # no /proc here (or it ended just now): kill(0) said it exists
    return fields[0] not in ("Z", "X")


def unusable(
    path: Path, exc: OSError, what: str = "data dir", flag: str = "--data-dir"
) -> DataDirError:
    """`exc` (raised while writing `path`) as one line: what is wrong and the fix."""
    reason = exc.strerror or str(exc)
    if exc.errno == errno.ENOSPC:
        fix = f"free some space, or pass a {flag} on another disk"
    elif exc.errno in (errno.EEXIST, errno.ENOTDIR):
        reason = "a file is in the way of a directory"
        fix = f"pass a {flag} whose directory exists or can be created"
    else:  # EACCES, EPERM, EROFS, ...
        fix = f"pass a {flag} this user can write (or fix its owner and permissions)"
    return DataDirError(f"{what} {path} is not usable ({reason}): {fix}")


def _holder_pid(fd: int, wait_s: float = 0.5) -> str:
    """The pid in a held lock file (the holder may be between its lock and its write)."""
    deadline = time.monotonic() + wait_s
    while True:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text or time.monotonic() >= deadline:
            return text or "unknown"
        time.sleep(0.01)  # polling interval of a deadline-bounded wait


def _close_in_child() -> None:
    for fd in list(_held):
        with contextlib.suppress(OSError):
            os.close(fd)  # the parent's descriptor still holds the lock
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)
