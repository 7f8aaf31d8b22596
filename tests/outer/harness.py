"""Real hivemind peers on loopback, as separate processes: for integration tests and benches.

Test-only (not shipped): bench/collective.py imports it with the repository root on sys.path.

hivemind's DHT process and the libp2p daemon outlive a SIGKILL of their parent.
A peer is the node's own `Host` (whose reaper kills them when the peer dies); the
peer process starts in its own session (the harness kills the whole process
group) and asks the kernel to kill it when its parent dies (PR_SET_PDEATHSIG).

A peer talks to its parent with one JSON object per stdout line and reads
commands, one per stdin line.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agora_node.comms.reaper import is_reaper
from agora_node.protocol.identity import Identity

if TYPE_CHECKING:
    from agora_node.comms.host import Host

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Get SIGKILL when the parent (the test or bench driver) dies, however it dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


async def start_local_host(identity: Identity, initial_peers: list[str] | None = None) -> Host:
    """The node's Host (libp2p + DHT + reaper) on 127.0.0.1 with `identity` as its peer id."""
    from agora_node.comms.host import Host, HostConfig  # hivemind: only in peer processes

    key_path = Path(tempfile.mkdtemp(prefix="agora-peer-")) / "identity.key"
    key_path.write_bytes(identity.to_libp2p_bytes())
    return await Host.start(
        HostConfig(identity_path=str(key_path), initial_peers=tuple(initial_peers or ()))
    )


class FreezeAfterFirstPush:
    """Wraps a Transport: once a first part is delivered, the whole process freezes.

    The freeze blocks the event loop on purpose (time.sleep): handlers stop answering
    and the own span is never reduced, as in a process that hangs inside the mix and
    is then killed. Prints a `pushed` event first so the harness knows when to kill.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def push(self, peer: str, header: Any, payload: bytes) -> Any:
        reply = await self.inner.push(peer, header, payload)
        emit("pushed", round=header.round)
        time.sleep(3600)
        return reply

    async def fetch(self, peer: str, header: Any) -> Any:
        return await self.inner.fetch(peer, header)

    async def query(self, peer: str, header: Any) -> Any:
        return await self.inner.query(peer, header)

    async def check(self, peer: str, header: Any, nonce: bytes, members: bytes) -> Any:
        return await self.inner.check(peer, header, nonce, members)


class Equivocating:
    """Wraps a Transport: sends each span's owner a part 1.5x the one it sends the span's
    witness, both signed with `identity` (what a liar would do to have the honest owner
    and witness blamed for the failed check; proofs.py)."""

    def __init__(self, inner: Any, identity: Identity) -> None:
        self.inner, self.identity = inner, identity

    async def push(self, peer: str, header: Any, payload: bytes) -> Any:
        from dataclasses import replace

        from agora_node.comms.collective.payload import encode_result, plain_format
        from agora_node.comms.collective.proofs import digest, statement
        from agora_node.compression import decode_frame, dequantize

        if header.attempt != 0:
            return await self.inner.push(peer, header, payload)
        value = dequantize(decode_frame(payload, max_bytes=1 << 30))
        other = encode_result(1.5 * value, plain_format())
        said = statement(header.group_id, header.span, header.weight, digest(other))
        signed = replace(header, signature=self.identity.sign(said))
        return await self.inner.push(peer, signed, other)

    def __getattr__(self, name: str) -> Any:  # fetch, query, check: unchanged
        return getattr(self.inner, name)


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


class PeerProcess:
    """A child peer in its own process group, spoken to through JSON lines."""

    def __init__(self, argv: list[str], *, env: dict[str, str] | None = None) -> None:
        self.tmp = tempfile.mkdtemp(prefix="agora-peer-")
        """The peer's TMPDIR (its key, hivemind's sockets, multiprocessing's listeners):
        a SIGKILL leaves them, so `kill` removes the folder."""
        self.proc = subprocess.Popen(
            [sys.executable, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
            text=True,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": self.tmp, **(env or {})},
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                self.events.put(json.loads(line))
        self.events.put({"event": "exit"})

    def expect(self, event: str, timeout: float, **match: Any) -> dict[str, Any]:
        """The next event named `event` (with matching fields), else TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {event!r} {match} within {timeout}s")
            try:
                item = self.events.get(timeout=left)
            except queue.Empty:
                continue
            self.seen.append(item)
            if item.get("event") == event and all(item.get(k) == v for k, v in match.items()):
                return item
            if item.get("event") in ("exit", "error") and event not in ("exit", "error"):
                raise RuntimeError(f"peer ended while waiting for {event!r}: {item}")

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        """SIGKILL the peer's process group, then what it started in sessions of their own
        (its DHT process, p2pd, torch's shared-memory manager: found by their TMPDIR) but
        its reaper, which is left to remove p2pd's sockets and exit; then the TMPDIR."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        mine = f"TMPDIR={self.tmp}"
        for pid in pids_with_env(mine):
            if not is_reaper(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while pids_with_env(mine) and time.monotonic() < deadline:  # the reaper finishing
            time.sleep(0.05)
        shutil.rmtree(self.tmp, ignore_errors=True)


def pids_with_env(entry: str) -> list[int]:
    """Processes whose environment holds `entry` ("NAME=value")."""
    wanted, found = entry.encode(), []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError):
            if wanted in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
    return found
