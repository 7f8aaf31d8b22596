"""K/V frames between the members of a context-parallel cell, over libp2p streams.

A cell's members run attention layer by layer in lock step: at each exchange every
member pushes its frame to every other member and waits for theirs
(stages/context_parallel.py checks the frames; this module only moves them). The
waiting happens on the stage's compute thread, never on the event loop: `post`
hands the pushes to the loop and returns, so the member computes what needs no
other member's frame while they travel; `wait` then blocks its own thread until the
frames it needs have arrived or the deadline passes (`CellTimeout`: the micro-batch
fails, as any other dropped micro-batch does).

A pushed frame carries the micro-batch's id and a sequence number (one per exchange,
in the order every member runs them), so frames of different micro-batches or layers
never mix. The receiving side accepts frames only from the cell's members (a stranger
is refused before its request is read, and counted), holds at most `max_inbox`
frames and `max_inbox_bytes` until the compute thread takes them, each member at most
its equal share of both (one member pushing frames nobody asks for fills only its own
share), and drops frames nobody took within the deadline.
"""

from __future__ import annotations

import asyncio
import struct
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import torch
from hivemind.p2p import P2P

from agora_node.comms import streams
from agora_node.comms.guard import Guard, Limits
from agora_node.protocol.names import cell_protocol

_HEADER = struct.Struct("<16sI")  # micro-batch id, exchange sequence number
ABORT = 0xFFFFFFFF
"""The sequence number of a push that carries no frame: "this micro-batch failed, stop
waiting for it" (a member's compute thread is freed at once, not at the deadline)."""
MAX_FRAME = 64 << 20
MIN_FRAMES_EACH = 16


class CellTimeout(ConnectionError):
    """A cell member's frame did not arrive in time (dead, partitioned or too slow)."""


@dataclass(eq=False)
class CellLink:
    """This node's end of the links to the other members of its cell."""

    p2p: P2P
    run_id: str
    members: Sequence[str]
    """Peer ids of the cell in rank order (this node among them)."""
    me: str
    timeout_s: float = 30.0
    max_frame: int = MAX_FRAME
    """The largest frame a push may carry (the manifest's bound, stages/kv_frames.py): a
    push is read whole before the inbox looks at it, 16 at a time from each member."""
    max_inbox: int = 256
    max_inbox_bytes: int = 1 << 30
    refused: Counter = field(default_factory=Counter)
    bytes_sent: int = 0
    retried: int = 0
    """Pushes sent again after their stream broke."""
    wait_s: float = 0.0
    """Seconds the compute thread waited for other members' frames."""

    def __post_init__(self) -> None:
        self.set_members(self.members)
        self._inbox: dict[tuple[str, bytes, int], tuple[bytes, float]] = {}
        self._aborted: dict[bytes, float] = {}
        self._arrived = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None

    def set_members(self, members: Sequence[str]) -> None:
        """The cell changed (a regroup): exchanges begun before keep the members they began
        with; frames from peers no longer members are refused from now on."""
        if self.me not in members:
            raise ValueError("this node is not a member of the cell")
        self.members = list(members)
        self.rank = self.members.index(self.me)

    def abort(self, mb_id: bytes) -> None:
        """Fail this micro-batch's exchanges now (a member's part of it failed): the compute
        thread waiting on them raises CellTimeout at once instead of at the deadline."""
        with self._arrived:
            now = time.monotonic()
            for key in [k for k, at in self._aborted.items() if now - at > self.timeout_s]:
                del self._aborted[key]
            self._aborted[mb_id] = now
            self._arrived.notify_all()

    async def tell_abort(self, peers: Sequence[str], mb_id: bytes) -> None:
        """Abort this micro-batch here and at `peers` (best effort, a few seconds at most)."""
        self.abort(mb_id)
        payload = _HEADER.pack(mb_id, ABORT)
        name = cell_protocol(self.run_id)
        await asyncio.gather(
            *(streams.request(self.p2p, p, name, payload, timeout=3.0) for p in peers),
            return_exceptions=True,
        )

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.current_thread()
        limits = Limits(
            max_streams=16 * len(self.members),
            max_streams_per_peer=16,
            rate_per_s=1000.0,  # one push per layer and direction of every micro-batch
            burst=2000.0,
            read_deadline_s=self.timeout_s,
        )
        guard = Guard(cell_protocol(self.run_id), limits)
        await streams.serve(
            self.p2p,
            cell_protocol(self.run_id),
            self._handle,
            max_request=min(self.max_frame, MAX_FRAME) + _HEADER.size,
            guard=guard,
            refuse=self._refuse,
        )

    def _refuse(self, remote: str) -> str | None:
        if remote in self.members and remote != self.me:
            return None
        self.refused["not_member"] += 1
        return "not a member of this cell"

    async def _handle(self, remote: str, request: bytes) -> AsyncIterator[bytes]:
        if len(request) < _HEADER.size:
            self.refused["malformed"] += 1
            raise streams.StreamError("cell frame without its header")
        mb_id, seq = _HEADER.unpack_from(request)
        if seq == ABORT:
            self.abort(mb_id)
            yield b"ok"
            return
        now = time.monotonic()
        frame = request[_HEADER.size :]
        with self._arrived:
            self._expire(now)
            if not self._has_room(remote, len(frame)):
                self.refused["full"] += 1
                raise streams.StreamError("cell inbox full")
            self._inbox[(remote, mb_id, seq)] = (frame, now)
            self._arrived.notify_all()
        yield b"ok"

    def _has_room(self, remote: str, nbytes: int) -> bool:
        """Whether `remote`'s frames, with this one, stay within its share of the inbox."""
        others = max(1, len(self.members) - 1)
        held = [len(f) for (peer, _, _), (f, _) in self._inbox.items() if peer == remote]
        # at least 16 frames each (a few layers ahead, several micro-batches): the bytes
        # bound what they hold; in a large cell the frames are as small as its chunks
        return (
            len(held) < max(MIN_FRAMES_EACH, self.max_inbox // others)
            and sum(held) + nbytes <= self.max_inbox_bytes // others
        )

    def _expire(self, now: float) -> None:
        for key in [k for k, (_, at) in self._inbox.items() if now - at > self.timeout_s]:
            del self._inbox[key]
            self.refused["expired"] += 1

    async def _push(self, peer: str, mb_id: bytes, seq: int, frame: bytes) -> None:
        """Deliver one frame; once more if the stream broke (a frame that did arrive the
        first time is only stored again under the same key)."""
        payload = _HEADER.pack(mb_id, seq) + frame
        for attempt in range(2):
            try:
                await streams.request(
                    self.p2p, peer, cell_protocol(self.run_id), payload, timeout=self.timeout_s
                )
                break
            except streams.RefusedError:
                raise
            except streams.StreamError:
                if attempt:
                    raise
                self.retried += 1
        self.bytes_sent += len(payload)

    def _take(self, peer: str, mb_id: bytes, seq: int, deadline: float) -> bytes:
        key = (peer, mb_id, seq)
        started = time.monotonic()
        try:
            with self._arrived:
                while key not in self._inbox:
                    if mb_id in self._aborted:
                        raise CellTimeout("the micro-batch failed at another cell member")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise CellTimeout(
                            f"cell member {peer[-8:]} sent nothing for exchange {seq} "
                            f"within {self.timeout_s:.0f}s"
                        )
                    self._arrived.wait(left)
                return self._inbox.pop(key)[0]
        finally:
            self.wait_s += time.monotonic() - started

    def exchange(self, mb_id: bytes) -> MicrobatchExchange:
        """The exchange of one micro-batch (an `Exchange` of stages/context_parallel.py)."""
        if len(mb_id) != 16:
            raise ValueError("micro-batch ids are 16 bytes")
        return MicrobatchExchange(self, mb_id, list(self.members), self.rank)


@dataclass(eq=False)
class MicrobatchExchange:
    link: CellLink
    mb_id: bytes
    members: list[str]
    """The cell as it was when this micro-batch began (a regroup does not change it)."""
    rank: int
    seq: int = 0

    @property
    def size(self) -> int:
        return len(self.members)

    def all_to_all(self, sends: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.post(sends).wait()

    def post(self, sends: list[torch.Tensor]) -> PostedPushes:
        """Start pushing sends[j] to member j (on the event loop) and return at once."""
        link = self.link
        if link._loop is None:
            raise RuntimeError("CellLink.start() first")
        if threading.current_thread() is link._loop_thread:
            raise RuntimeError("cell exchanges block: call them from the compute thread")
        self.seq += 1
        pushes = [
            asyncio.run_coroutine_threadsafe(
                link._push(peer, self.mb_id, self.seq, sends[j].numpy().tobytes()), link._loop
            )
            for j, peer in enumerate(self.members)
            if j != self.rank
        ]
        return PostedPushes(self, self.seq, sends, pushes, time.monotonic() + link.timeout_s)


@dataclass(eq=False)
class PostedPushes:
    exchange: MicrobatchExchange
    seq: int
    sends: list[torch.Tensor]
    pushes: list
    deadline: float

    def wait(self) -> list[torch.Tensor]:
        """What each member sent for this exchange; its own pushes delivered too."""
        x, link = self.exchange, self.exchange.link
        try:
            got = []
            for j, peer in enumerate(x.members):
                if j == x.rank:
                    got.append(self.sends[j])
                else:
                    got.append(_as_tensor(link._take(peer, x.mb_id, self.seq, self.deadline)))
            for push in self.pushes:
                push.result(max(0.0, self.deadline - time.monotonic()))
        except TimeoutError as exc:
            raise CellTimeout(f"a push to a cell member took over {link.timeout_s:.0f}s") from exc
        except streams.StreamError as exc:
            raise CellTimeout(f"a push to a cell member failed: {exc}") from exc
        finally:
            for push in self.pushes:
                push.cancel()
        return got


def _as_tensor(frame: bytes) -> torch.Tensor:
    if not frame:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(frame), dtype=torch.uint8)
