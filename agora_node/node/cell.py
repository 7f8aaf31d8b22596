"""Context-parallel cells in the daemon: c replicas of a stage act as one replica that
splits each sequence (manifest `cp_degree` c > 1; the method is stages/context_parallel.py).

Forming, without a coordinator: a stage's live replicas, sorted by peer id, in
consecutive groups of c (`cell_groups`). The first of a group leads, the others help;
fewer than c left over train whole sequences alone. Every node computes the same groups
from the directory, so upstream stages route only to leaders (`routable`). Views that
disagree for a refresh cost a refused request, and the leader trains that micro-batch
whole.

A leader owns the replica: weights, inner optimizer, outer rounds. For a micro-batch it
sends each helper the helper's chunk of the input (with the weights of the version the
micro-batch runs on, when the helper does not hold them yet), runs its own chunk on its
worker thread, and the members exchange K/V frames layer by layer (comms/cell_link.py).
A helper answers with its chunk's output, and at backward with its chunk's input
gradient and its parameter gradients. The leader sums them with its own: that sum is
the gradient one peer computes alone, so the leader's inner step is the replica's step.
The leader runs one cell micro-batch at a time, so every member runs the exchanges in
one order.

A helper mirrors the weights it is sent into its own replica. So its outer rounds carry
the cell's weights (it trains no tokens of its own, so its share of a mix is nil), and if
the leader vanishes it goes on from them as a replica of its own.

Failure: a helper that dies, stalls or refuses fails the leader's exchange at once
(`CellLink.abort`). The leader trains that micro-batch whole instead, recomputing from
the input it kept, and leaves the helper out until the cell is formed again. So a dead
helper costs time, never a micro-batch.

A helper trusts only its leader, and the leader checks what a helper sends: exact
lengths and finite values. A helper that lies about its gradients can bend its cell's
replica as any replica can bend its own; the outer steps' checks bound what reaches the
stage (docs/security.md).

Stage 0 does not form cells: its head injects whole sequences.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import struct
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.func import functional_call

from agora_node.comms import streams
from agora_node.comms.cell_link import CellLink, CellTimeout
from agora_node.comms.guard import Guard, Limits
from agora_node.node.worker import StageWorker
from agora_node.protocol.names import cell_protocol, cell_work_protocol
from agora_node.stages.context_parallel import CellContext, ChunkLayout
from agora_node.stages.kv_frames import FramedExchange, KVFrameError
from agora_node.stages.model import AttentionContext, lm_loss

log = logging.getLogger(__name__)

OP_FORWARD, OP_BACKWARD, OP_LAST = 1, 2, 3
RESEND = 0x80
"""Set on an op: "send me again the answer to that request" (its stream broke on the way
back; the work is not done twice). Header only."""
KEPT_ANSWERS = 8
_REQUEST = struct.Struct("<B16sQBBHBd")
"""op, exchange id, weight version, member rank, cell size, batch, weights attached, loss scale"""
_LOSS = struct.Struct("<d")
KEPT_VERSIONS = 4
"""Weight versions a helper holds (micro-batches in flight may run on older ones)."""
MAX_HELD = 16
"""Micro-batches a helper holds between forward and backward."""


class CellFailed(ConnectionError):
    """This micro-batch cannot be computed by the cell (a member failed or refused)."""


# ---- forming cells (pure) --------------------------------------------------------------


def cell_groups(peers: list[str], size: int) -> list[list[str]]:
    """The stage's cells: peers sorted, consecutive groups of `size`; the rest alone."""
    ordered = sorted(set(peers))
    if size < 2:
        return [[p] for p in ordered]
    full = len(ordered) - len(ordered) % size
    cells = [ordered[i : i + size] for i in range(0, full, size)]
    return cells + [[p] for p in ordered[full:]]


def routable(peers: list[str], size: int) -> list[str]:
    """The replicas upstream stages send micro-batches to: each cell's leader."""
    return [cell[0] for cell in cell_groups(peers, size)]


def cell_of(me: str, peers: list[str], size: int) -> list[str]:
    """The cell `me` belongs to (itself alone when it is in none)."""
    for cell in cell_groups([*peers, me], size):
        if me in cell:
            return cell
    return [me]


def exchange_id(mb_id: str) -> bytes:
    """16 bytes naming one micro-batch's exchanges on every member."""
    return hashlib.sha256(mb_id.encode()).digest()[:16]


# ---- the wire between a leader and its helpers -----------------------------------------


@dataclass(frozen=True)
class WorkRequest:
    op: int
    xid: bytes
    version: int
    rank: int
    size: int
    batch: int
    loss_scale: float
    weights: Tensor | None
    """All of the stage's weights of `version` (float32, named_parameters order), or None."""
    tensors: tuple[Tensor, ...]
    """Forward: (input chunk or empty, input token ids, target ids or empty); backward:
    (gradient w.r.t. the chunk's output,)."""


def _f32(t: Tensor) -> bytes:
    return t.detach().to(torch.float32).contiguous().cpu().numpy().tobytes()


def _i32(t: Tensor) -> bytes:
    return t.to(torch.int32).contiguous().cpu().numpy().tobytes()


def encode_request(req: WorkRequest) -> bytes:
    head = _REQUEST.pack(
        req.op, req.xid, req.version, req.rank, req.size, req.batch,
        req.weights is not None, req.loss_scale,
    )  # fmt: skip
    parts = [head] if req.weights is None else [head, _f32(req.weights)]
    for t in req.tensors:
        parts.append(_i32(t) if not t.is_floating_point() else _f32(t))
    return b"".join(parts)


class _Reader:
    """Takes exactly-sized float32 / int32 sections off a message; refuses the rest."""

    def __init__(self, data: bytes, offset: int) -> None:
        self.data, self.offset = memoryview(data), offset

    def take(self, count: int, dtype: torch.dtype) -> Tensor:
        nbytes = 4 * count
        if self.offset + nbytes > len(self.data):
            raise ValueError("message shorter than its header says")
        raw = bytearray(self.data[self.offset : self.offset + nbytes])
        self.offset += nbytes
        t = torch.frombuffer(raw, dtype=dtype) if count else torch.empty(0, dtype=dtype)
        if dtype == torch.float32 and not bool(torch.isfinite(t).all()):
            raise ValueError("non-finite values")
        return t

    def done(self) -> None:
        if self.offset != len(self.data):
            raise ValueError(f"{len(self.data) - self.offset} bytes past the message's end")


# ---- compute of one member's chunk (worker thread) -------------------------------------


@dataclass
class _Chunk:
    """A member's part of one micro-batch between its forward and its backward."""

    version: int
    params: dict[str, Tensor]
    exchange: FramedExchange
    x: Tensor | None
    out: Tensor
    """Boundary coefficients of the chunk's output, with the graph."""
    tokens: int
    """Tokens of the whole micro-batch (what the replica trained on)."""
    compute_s: float
    created: float = field(default_factory=time.monotonic)
    c_in: Tensor | None = None
    full_tokens: Tensor | None = None
    """The whole micro-batch's input (a leader keeps it to redo the micro-batch whole)."""


def _context(layout: ChunkLayout, exchange: FramedExchange) -> AttentionContext:
    return AttentionContext(cell=CellContext(layout, exchange))


def _forward_chunk(
    worker: StageWorker,
    params: dict[str, Tensor],
    c_in: Tensor | None,
    inputs: Tensor,
    layout: ChunkLayout,
    exchange: FramedExchange,
) -> tuple[Tensor | None, Tensor]:
    """(input leaf or None, stage output) of one member's chunk, exchanging K/V."""
    inputs = inputs.to(worker.device)
    x = None
    if c_in is not None:
        x = worker.stage.decode_boundary(c_in.to(worker.device).float(), inputs)
        x = x.detach().requires_grad_(True)
    with worker.compute.autocast():
        out = functional_call(worker.stage, params, (x, inputs, _context(layout, exchange)))
    return x, out


def _gradients(
    worker: StageWorker,
    root: Tensor,
    grad: Tensor | None,
    params: dict[str, Tensor],
    x: Tensor | None,
) -> tuple[Tensor | None, dict[str, Tensor]]:
    """(dL/dc of the chunk's input, dL/dparams of the trainable weights), accumulated
    nowhere: a cell commits a micro-batch's gradients only once every member succeeded."""
    names = list(worker._master_of)
    leaves = [params[n] for n in names] + ([x] if x is not None else [])
    got = torch.autograd.grad(root, leaves, grad_outputs=grad, allow_unused=True)
    grads = {
        n: (g if g is not None else torch.zeros_like(params[n])).detach()
        for n, g in zip(names, got, strict=False)
    }
    grad_in = None if x is None else worker.boundary_grad(got[len(names)])
    return grad_in, grads


def _flat(grads: dict[str, Tensor]) -> Tensor:
    return torch.cat([g.reshape(-1).float().cpu() for g in grads.values()])


def _unflat(flat: Tensor, like: dict[str, Tensor]) -> dict[str, Tensor]:
    out, offset = {}, 0
    for name, ref in like.items():
        out[name] = flat[offset : offset + ref.numel()].view_as(ref).to(ref.device, ref.dtype)
        offset += ref.numel()
    return out


def _chunk_loss(logits: Tensor, targets: Tensor, total: int) -> Tensor:
    """This chunk's share of the micro-batch's mean loss (the shares sum to the mean)."""
    return lm_loss(logits, targets.to(logits.device)) * (targets.numel() / total)


# ---- a helper ----------------------------------------------------------------------------


class CellHelper:
    """Serves the cell-work protocol: computes its chunk for its leader only."""

    def __init__(self, worker: StageWorker, link: CellLink, seq_len: int, micro_batch: int):
        self.worker, self.link = worker, link
        self.seq_len, self.micro_batch = seq_len, micro_batch
        self.leader: str | None = None
        self.refused: Counter = Counter()
        self.chunks = 0
        self.tokens = 0
        """Tokens of the micro-batches this node computed a chunk of (forwards)."""
        self._versions: OrderedDict[int, dict[str, Tensor]] = OrderedDict()
        self._held: dict[bytes, _Chunk] = {}
        self._answers: OrderedDict[tuple[bytes, int], asyncio.Future] = OrderedDict()
        """The last requests' answers, for a leader whose stream broke on the way back."""
        self._numel = sum(p.numel() for p in worker.current_version()[1].values())

    def max_request(self) -> int:
        width = max(self.worker.stage.boundary_width, self.worker.manifest.model.d_model)
        return 4 * self._numel + 4 * self.micro_batch * self.seq_len * (width + 2) + 4096

    async def start(self, p2p, run_id: str) -> None:  # noqa: ANN001 - hivemind P2P
        limits = Limits(
            max_streams=8, max_streams_per_peer=4, rate_per_s=200.0, burst=400.0,
            read_deadline_s=self.link.timeout_s, deadline_s=4 * self.link.timeout_s,
        )  # fmt: skip
        name = cell_work_protocol(run_id)
        await streams.serve(
            p2p,
            name,
            self._handle,
            max_request=self.max_request(),
            guard=Guard(name, limits),
            refuse=self._refuse,
        )

    def _refuse(self, remote: str) -> str | None:
        if remote == self.leader:
            return None
        self.refused["not_leader"] += 1
        return "not this node's cell leader"

    async def _handle(self, remote: str, request: bytes):  # noqa: ANN202 - async generator
        try:
            if len(request) >= 1 and request[0] & RESEND:
                answer = self._answers[self._resend_key(request)]
            else:
                req = self._decode(request)
                answer = asyncio.ensure_future(self.worker.call(self._compute, req))
                answer.add_done_callback(_retrieved)
                self._answers[(req.xid, req.op)] = answer
                while len(self._answers) > KEPT_ANSWERS:
                    self._answers.popitem(last=False)
        except (ValueError, KeyError) as exc:
            self.refused["bad_request"] += 1
            raise streams.StreamError(f"cell work refused: {exc!r}") from None
        try:
            data = await asyncio.shield(answer)
        except (CellTimeout, KVFrameError, KeyError) as exc:
            self.refused["failed"] += 1
            raise streams.StreamError(f"cell work failed: {exc!r}") from None
        if not request[0] & RESEND:
            self.chunks += 1
        yield data

    def _resend_key(self, data: bytes) -> tuple[bytes, int]:
        if len(data) != _REQUEST.size:
            raise ValueError("a resend is a header only")
        op, xid, *_ = _REQUEST.unpack_from(data)
        return xid, op & ~RESEND

    def _decode(self, data: bytes) -> WorkRequest:
        if len(data) < _REQUEST.size:
            raise ValueError("no header")
        op, xid, version, rank, size, batch, with_weights, scale = _REQUEST.unpack_from(data)
        members = self.link.members
        if size != len(members) or not 0 < rank < size or members[rank] != self.link.me:
            raise ValueError(f"member {rank} of {size} is not this node in its cell")
        if op not in (OP_FORWARD, OP_BACKWARD, OP_LAST) or not 0 < batch <= self.micro_batch:
            raise ValueError(f"op {op}, batch {batch}")
        if not (scale == scale and abs(scale) <= 1e6):  # NaN or absurd
            raise ValueError("loss scale")
        stage = self.worker.stage
        n = ChunkLayout(self.seq_len, size).length(rank)
        read = _Reader(data, _REQUEST.size)
        weights = read.take(self._numel, torch.float32) if with_weights else None
        if op == OP_BACKWARD:
            out_width = (
                self.worker.manifest.model.d_model if stage.is_last else stage.boundary_width
            )
            tensors: tuple[Tensor, ...] = (read.take(batch * n * out_width, torch.float32),)
            tensors = (tensors[0].view(batch, n, out_width),)
        else:
            width = 0 if stage.is_first else stage.boundary_width
            c_in = read.take(batch * n * width, torch.float32).view(batch, n, width)
            ids = read.take(batch * n, torch.int32).view(batch, n)
            targets = read.take(batch * n if op == OP_LAST else 0, torch.int32)
            vocab = self.worker.manifest.model.vocab_size
            for t in (ids, targets):
                if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
                    raise ValueError("token id outside the vocabulary")
            tensors = (
                c_in,
                ids.long(),
                targets.view(batch, -1).long() if targets.numel() else targets,
            )
        read.done()
        return WorkRequest(op, xid, version, rank, size, batch, scale, weights, tensors)

    # worker thread from here on
    def _compute(self, req: WorkRequest) -> bytes:
        w = self.worker
        if req.weights is not None:
            self._keep_version(req.version, req.weights)
        layout = ChunkLayout(self.seq_len, req.size)
        if req.op == OP_BACKWARD:
            chunk = self._held.pop(req.xid)  # KeyError: refused (expired or never seen)
            grad_in, grads = _gradients(w, chunk.out, req.tensors[0], chunk.params, chunk.x)
            return _answer(grad_in, grads)
        params = self._versions[req.version]  # KeyError: the leader must send the weights
        c_in, ids, targets = req.tensors
        self.tokens += req.batch * self.seq_len
        exchange = FramedExchange(self.link.exchange(req.xid))
        started = time.perf_counter()
        x, out = _forward_chunk(
            w, params, None if w.stage.is_first else c_in, ids, layout, exchange
        )
        if req.op == OP_LAST:
            total = req.batch * self.seq_len
            loss = _chunk_loss(out, targets, total)
            grad_in, grads = _gradients(w, loss * req.loss_scale, None, params, x)
            return _LOSS.pack(float(loss.detach())) + _answer(grad_in, grads)
        c_out = w.stage.encode_boundary(out.float(), ids.to(w.device))
        self._expire()
        self._held[req.xid] = _Chunk(
            req.version, params, exchange, x, c_out, ids.numel(), time.perf_counter() - started
        )
        return _f32(c_out)

    def _keep_version(self, version: int, flat: Tensor) -> None:
        w = self.worker
        like = w.current_version()[1]
        params = {n: t.detach().requires_grad_(True) for n, t in _unflat(flat, like).items()}
        self._versions[version] = params
        while len(self._versions) > KEPT_VERSIONS:
            self._versions.popitem(last=False)
        w.mirror(torch.cat([params[n].detach().reshape(-1).cpu() for n in w._master_of]))

    def _expire(self) -> None:
        now = time.monotonic()
        for xid in [k for k, c in self._held.items() if now - c.created > self.link.timeout_s * 4]:
            del self._held[xid]
        while len(self._held) >= MAX_HELD:
            del self._held[next(iter(self._held))]


def _retrieved(future: asyncio.Future) -> None:
    """An answer nobody waits for any more (its leader gave up): its error is not news."""
    if not future.cancelled():
        future.exception()


def _answer(grad_in: Tensor | None, grads: dict[str, Tensor]) -> bytes:
    return (b"" if grad_in is None else _f32(grad_in)) + _f32(_flat(grads))


# ---- a leader -----------------------------------------------------------------------------


class CellLeader:
    """Drives a cell's micro-batches from its leader; see the module docstring."""

    def __init__(
        self,
        worker: StageWorker,
        link: CellLink,
        p2p,  # noqa: ANN001 - hivemind P2P
        run_id: str,
        seq_len: int,
        turn: asyncio.Lock | None = None,
    ) -> None:
        self.worker, self.link, self.p2p, self.run_id = worker, link, p2p, run_id
        self.seq_len = seq_len
        self.members = list(link.members)
        self.failed = 0
        self.completed = 0
        self.tokens = 0
        """Tokens of the micro-batches this cell computed (K/V bytes per token divide by it)."""
        self._lock = turn or asyncio.Lock()
        """One cell micro-batch at a time from this node: shared by the leaders it forms one
        after another, whose micro-batches may still be finishing."""
        self._shipped: dict[str, int] = {}
        """The weight version each helper holds."""
        self._held: dict[str, _Chunk] = {}
        self._broken: set[str] = set()
        self.broken_at = 0.0
        self.answers_resent = 0

    @property
    def ready(self) -> bool:
        return len(self.members) > 1 and not self._broken

    def holds(self, mb_id: str) -> bool:
        return mb_id in self._held

    async def forward(self, mb_id: str, c_in: Tensor | None, tokens: Tensor) -> Tensor:
        """The whole micro-batch's boundary output, computed by the cell."""
        async with self._lock:
            self._check_ready()
            version, params = await self.worker.call(self.worker.current_version)
            xid = exchange_id(mb_id)
            layout = ChunkLayout(self.seq_len, len(self.members))
            requests = self._chunk_requests(OP_FORWARD, xid, version, params, layout, c_in, tokens)
            own = self.worker.call(
                self._own_forward, mb_id, xid, version, params, layout, c_in, tokens
            )
            parts = await self._together(xid, own, requests, self._parse_out(layout, tokens))
            self.tokens += tokens[:, :-1].numel()
            return layout.assemble(parts)

    async def backward(self, mb_id: str, grad_out: Tensor) -> Tensor | None:
        async with self._lock:
            self._check_ready()
            chunk = self._held.pop(mb_id)
            xid = exchange_id(mb_id)
            layout = ChunkLayout(self.seq_len, len(self.members))
            requests = [
                (peer, WorkRequest(OP_BACKWARD, xid, chunk.version, r, layout.size,
                                   len(grad_out), 1.0, None, (layout.take(grad_out, r),)))
                for r, peer in enumerate(self.members) if r
            ]  # fmt: skip
            own = self.worker.call(self._own_backward, chunk, layout.take(grad_out, 0))
            try:
                results = await self._together(
                    xid, own, requests, self._parse_grads(layout, len(grad_out))
                )
            except CellFailed:
                self._held[mb_id] = chunk  # the pipeline hands it back to the worker
                raise
            return await self._commit(chunk, layout, results)

    async def last(
        self, c_in: Tensor, tokens: Tensor, loss_scale: float
    ) -> tuple[float, Tensor | None]:
        """The last stage's loss and input gradient, computed by the cell."""
        async with self._lock:
            self._check_ready()
            version, params = await self.worker.call(self.worker.current_version)
            xid = exchange_id(f"last/{id(tokens)}/{time.monotonic_ns()}")
            layout = ChunkLayout(self.seq_len, len(self.members))
            requests = self._chunk_requests(
                OP_LAST, xid, version, params, layout, c_in, tokens, loss_scale
            )
            own = self.worker.call(
                self._own_last, xid, version, params, layout, c_in, tokens, loss_scale
            )
            results = await self._together(
                xid, own, requests, self._parse_grads(layout, len(tokens), with_loss=True)
            )
            chunk = results[0][2]
            loss = sum(r[3] for r in results)
            self.tokens += tokens[:, :-1].numel()
            return loss, await self._commit(chunk, layout, results)

    def discard(self, mb_id: str) -> None:
        self._held.pop(mb_id, None)

    def _check_ready(self) -> None:
        """The cell broke while this micro-batch waited for its turn: it goes whole."""
        if not self.ready:
            self.failed += 1
            raise CellFailed("the cell broke while this micro-batch waited for its turn")

    def take_back(self, mb_id: str) -> None:
        """The cell failed this micro-batch after its forward: hand it to the worker to
        recompute whole at backward, on the weights its forward used."""
        chunk = self._held.pop(mb_id)
        self.worker.keep_for_recompute(
            mb_id, chunk.version, chunk.params, chunk.c_in, chunk.full_tokens
        )

    # ---- the parts ----------------------------------------------------------------------
    def _chunk_requests(self, op, xid, version, params, layout, c_in, tokens, scale=1.0):  # noqa: ANN001, ANN202
        reqs = []
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        for r, peer in enumerate(self.members):
            if not r:
                continue
            ship = self._shipped.get(peer) != version
            weights = (
                torch.cat([p.detach().reshape(-1).float().cpu() for p in params.values()])
                if ship
                else None
            )
            chunk_in = layout.take(c_in, r) if c_in is not None else torch.empty(0)
            chunk_targets = (
                layout.take(targets, r) if op == OP_LAST else torch.empty(0, dtype=torch.long)
            )
            req = WorkRequest(op, xid, version, r, layout.size, len(tokens), scale, weights,
                              (chunk_in, layout.take(inputs, r), chunk_targets))  # fmt: skip
            reqs.append((peer, req))
        return reqs

    async def _together(self, xid: bytes, own, requests, parse) -> list:  # noqa: ANN001
        """Run the own part and every helper's at once; all their results, in rank order,
        or CellFailed (and every member's waiting ends) as soon as one fails."""
        own_task = asyncio.ensure_future(own)
        asks = [asyncio.ensure_future(self._ask(peer, req, parse)) for peer, req in requests]
        pending = {own_task, *asks}
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                if any(t.exception() is not None for t in done):
                    break
            failed = [t for t in (own_task, *asks) if t.done() and t.exception() is not None]
            if failed:
                raise failed[0].exception()
            for peer, req in requests:
                if req.weights is not None:
                    self._shipped[peer] = req.version
            return [own_task.result(), *(a.result() for a in asks)]
        except (TimeoutError, CellTimeout, streams.StreamError, KVFrameError, ValueError) as exc:
            for task in asks:
                task.cancel()
            await self.link.tell_abort([peer for peer, _ in requests], xid)
            with contextlib.suppress(BaseException):
                await own_task  # its exchange was aborted: it ends now
            for peer, _ in requests:
                self._shipped.pop(peer, None)
                self._broken.add(peer)
            self.broken_at = time.monotonic()
            self.failed += 1
            raise CellFailed(f"cell of {len(self.members)} failed: {exc}") from exc
        finally:
            for task in asks:
                task.cancel()

    async def _ask(self, peer: str, req: WorkRequest, parse):  # noqa: ANN001, ANN202
        name = cell_work_protocol(self.run_id)
        timeout = self.link.timeout_s
        try:
            data = await streams.request(self.p2p, peer, name, encode_request(req), timeout=timeout)
        except streams.RefusedError:
            raise
        except streams.StreamError:  # broken on the way: the answer may be waiting there
            again = dataclasses.replace(req, op=req.op | RESEND, weights=None, tensors=())
            data = await streams.request(
                self.p2p, peer, name, encode_request(again), timeout=timeout
            )
            self.answers_resent += 1
        return parse(req.rank, data)

    def _parse_out(self, layout: ChunkLayout, tokens: Tensor):  # noqa: ANN202
        width = self.worker.stage.boundary_width
        b = len(tokens)

        def parse(rank: int, data: bytes) -> Tensor:
            read = _Reader(data, 0)
            n = layout.length(rank)
            out = read.take(b * n * width, torch.float32).view(b, n, width)
            read.done()
            return out

        return parse

    def _parse_grads(self, layout: ChunkLayout, batch: int, with_loss: bool = False):  # noqa: ANN202
        stage = self.worker.stage
        width = 0 if stage.is_first else stage.boundary_width
        numel = self.worker.trainable_numel()

        def parse(rank: int, data: bytes):  # noqa: ANN202
            loss = _LOSS.unpack_from(data)[0] if with_loss else 0.0
            read = _Reader(data, _LOSS.size if with_loss else 0)
            n = layout.length(rank)
            grad_in = read.take(batch * n * width, torch.float32).view(batch, n, width)
            grads = read.take(numel, torch.float32)
            read.done()
            if loss != loss or abs(loss) > 1e4:
                raise ValueError("a helper's loss is not a plausible number")
            return grad_in, grads, None, loss

        return parse

    # worker thread
    def _own_forward(self, mb_id, xid, version, params, layout, c_in, tokens) -> Tensor:  # noqa: ANN001
        w, started = self.worker, time.perf_counter()
        inputs = layout.take(tokens[:, :-1], 0)
        exchange = FramedExchange(self.link.exchange(xid))
        x, out = _forward_chunk(
            w, params, None if c_in is None else layout.take(c_in, 0), inputs, layout, exchange
        )
        c_out = w.stage.encode_boundary(out.float(), inputs.to(w.device))
        self._held[mb_id] = _Chunk(
            version, params, exchange, x, c_out, tokens[:, :-1].numel(), time.perf_counter() - started,
            c_in=c_in, full_tokens=tokens,
        )  # fmt: skip
        return c_out.detach().cpu()

    def _own_backward(self, chunk: _Chunk, grad: Tensor):  # noqa: ANN202
        started = time.perf_counter()
        grad_in, grads = _gradients(
            self.worker, chunk.out, grad.to(chunk.out.device), chunk.params, chunk.x
        )
        chunk.compute_s += time.perf_counter() - started
        return grad_in, grads, chunk, 0.0

    def _own_last(self, xid, version, params, layout, c_in, tokens, scale):  # noqa: ANN001, ANN202
        w, started = self.worker, time.perf_counter()
        inputs, targets = layout.take(tokens[:, :-1], 0), layout.take(tokens[:, 1:], 0)
        exchange = FramedExchange(self.link.exchange(xid))
        x, logits = _forward_chunk(w, params, layout.take(c_in, 0), inputs, layout, exchange)
        loss = _chunk_loss(logits, targets, tokens[:, :-1].numel())
        grad_in, grads = _gradients(w, loss * scale, None, params, x)
        chunk = _Chunk(
            version,
            params,
            exchange,
            x,
            logits,
            tokens[:, :-1].numel(),
            time.perf_counter() - started,
        )
        return grad_in, grads, chunk, float(loss.detach())

    async def _commit(self, chunk: _Chunk, layout: ChunkLayout, results: list) -> Tensor | None:
        """Every member succeeded: the summed gradients land on the leader's replica."""
        own_grads = results[0][1]
        total = dict(own_grads)
        for _, flat, _, _ in results[1:]:
            for name, g in _unflat(flat, own_grads).items():
                total[name] = total[name] + g
        await self.worker.call(
            self.worker.accumulate,
            chunk.version,
            chunk.params,
            total,
            chunk.tokens,
            chunk.compute_s,
        )
        self.completed += 1
        grad_parts = [results[0][0], *(r[0] for r in results[1:])]
        if grad_parts[0] is None:
            return None
        return layout.assemble([g.cpu() for g in grad_parts])

    def kv_bytes(self) -> int:
        return self.link.bytes_sent


# ---- a stage service's part in cells -------------------------------------------------------

REFORM_AFTER_S = (5.0, 60.0)
"""A cell whose helper failed trains whole sequences; it is formed again after the first
of these (a helper that was only slow, or a frame lost), doubling with each failure in a
row up to the second, if the directory still puts the same peers in it."""


class Cells:
    """This node's cell for its stage: the K/V link, the helper side, and the leader side
    when it leads. `regroup` follows the directory; the pipeline asks `leader`."""

    def __init__(self, worker: StageWorker, p2p, me: str, run_id: str, timeout_s: float):  # noqa: ANN001
        m = worker.manifest
        self.size, self.seq_len = m.model.cp_degree, m.model.seq_len
        self.worker, self.p2p, self.me, self.run_id = worker, p2p, me, run_id
        self.link = CellLink(p2p, run_id, members=[me], me=me, timeout_s=timeout_s)
        self.helper = CellHelper(worker, self.link, m.model.seq_len, m.inner.micro_batch)
        self.leader: CellLeader | None = None
        self.members = [me]
        self._failures_in_row = 0
        self._turn = asyncio.Lock()
        self.answers_resent = 0
        self.failed = 0
        self.completed = 0
        self.tokens = 0

    @staticmethod
    def wanted(worker: StageWorker) -> bool:
        """Cells serve stages past the head of a manifest with cp_degree > 1."""
        return worker.manifest.model.cp_degree > 1 and not worker.stage.is_first

    async def start(self) -> None:
        await self.link.start()
        await self.helper.start(self.p2p, self.run_id)

    async def close(self) -> None:
        """Stop serving the cell protocols (another stage's service may serve them next)."""
        for name in (cell_protocol(self.run_id), cell_work_protocol(self.run_id)):
            with contextlib.suppress(Exception):
                await self.p2p.remove_binary_stream_handler(name)

    def regroup(self, peers: list[str]) -> None:
        """Take this node's place among the stage's live replicas `peers`."""
        members = cell_of(self.me, peers, self.size)
        leader = self.leader
        if members == self.members and (leader is None or leader.ready):
            if leader is not None and leader.completed:
                self._failures_in_row = 0
            return
        if members == self.members:  # the same cell, broken: again after a backoff
            first, most = REFORM_AFTER_S
            wait = min(most, first * 2**self._failures_in_row)
            if time.monotonic() - leader.broken_at < wait:
                return
            self._failures_in_row += 1
        else:
            self._failures_in_row = 0
        if leader is not None:
            self.failed += leader.failed
            self.completed += leader.completed
            self.tokens += leader.tokens
            self.answers_resent += leader.answers_resent
        self.members = members
        self.link.set_members(members)
        leads = members[0] == self.me and len(members) > 1
        self.leader = (
            CellLeader(self.worker, self.link, self.p2p, self.run_id, self.seq_len, self._turn)
            if leads
            else None
        )
        self.helper.leader = members[0] if len(members) > 1 and not leads else None
        if len(members) == 1:
            log.info("cell: this node trains whole sequences (no cell of %d to join)", self.size)
        else:
            log.info(
                "cell: %s of %s", "leader" if leads else "helper",
                ", ".join(p[-8:] for p in members),
            )  # fmt: skip

    @property
    def role(self) -> str:
        if len(self.members) == 1:
            return "alone"
        return "leader" if self.members[0] == self.me else "helper"

    def status(self) -> dict:
        leader = self.leader
        tokens = self.tokens + (leader.tokens if leader else 0) + self.helper.tokens
        return {
            "size": self.size,
            "role": self.role,
            "members": list(self.members),
            "ready": bool(leader and leader.ready) if self.role == "leader" else None,
            "microbatches": self.completed + (leader.completed if leader else 0),
            "failed": self.failed + (leader.failed if leader else 0),
            "helped": self.helper.chunks,
            "kv_bytes_sent": self.link.bytes_sent,
            "kv_bytes_per_token": round(self.link.bytes_sent / tokens, 2) if tokens else None,
            "exchange_wait_s": round(self.link.wait_s, 3),
            "refused": dict(self.link.refused + self.helper.refused),
            "frames_resent": self.link.retried,
            "answers_resent": self.answers_resent + (leader.answers_resent if leader else 0),
        }
