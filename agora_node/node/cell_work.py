"""What a context-parallel cell's leader asks of a helper, and the helper that does it
(node/cell.py drives cells; this module is the protocol and one member's compute).

A request is a fixed header (op, exchange id, weight version, member rank, cell size,
batch, flags: whether the weights and the document ids ride along, loss scale) and
float32/int32 sections whose sizes the header and the manifest fix exactly: anything
else is refused before any compute. `RESEND` asks again for the answer to a request whose stream broke on the way
back. Members compute their chunk on their worker thread, exchange K/V through the
cell link, and take gradients with `torch.autograd.grad`, so nothing lands on a weight
until the leader commits the whole micro-batch.
"""

from __future__ import annotations

import asyncio
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
from agora_node.protocol.names import cell_work_protocol
from agora_node.stages.context_parallel import CellContext, ChunkLayout
from agora_node.stages.data import TokenBatch, check_documents
from agora_node.stages.flat import host_flat
from agora_node.stages.kv_frames import FramedExchange, KVFrameError
from agora_node.stages.model import AttentionContext, lm_loss

log = logging.getLogger(__name__)

OP_FORWARD, OP_BACKWARD, OP_LAST = 1, 2, 3
RESEND = 0x80
"""Set on an op: "send me again the answer to that request" (its stream broke on the way
back; the work is not done twice). Header only."""
KEPT_ANSWERS = 8
_REQUEST = struct.Struct("<B16sQBBHBd")
"""op, exchange id, weight version, member rank, cell size, batch, flags, loss scale"""
WITH_WEIGHTS, WITH_DOCS = 1, 2
LOSS = struct.Struct("<d")
KEPT_VERSIONS = 4
"""Weight versions a helper holds (micro-batches in flight may run on older ones)."""
MAX_HELD = 16
"""Micro-batches a helper holds between forward and backward."""


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
    docs: Tensor | None = None
    """Forward: [batch, seq_len] document ids of the whole sequence (packed rows), or None."""


def f32(t: Tensor) -> bytes:
    return t.detach().to(torch.float32).contiguous().cpu().numpy().tobytes()


def _i32(t: Tensor) -> bytes:
    return t.to(torch.int32).contiguous().cpu().numpy().tobytes()


def encode_request(req: WorkRequest) -> bytes:
    flags = (WITH_WEIGHTS if req.weights is not None else 0) | (
        WITH_DOCS if req.docs is not None else 0
    )
    head = _REQUEST.pack(
        req.op, req.xid, req.version, req.rank, req.size, req.batch, flags, req.loss_scale
    )
    parts = [head] if req.weights is None else [head, f32(req.weights)]
    for t in req.tensors:
        parts.append(_i32(t) if not t.is_floating_point() else f32(t))
    if req.docs is not None:
        parts.append(_i32(req.docs))
    return b"".join(parts)


class Reader:
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
class Chunk:
    """A member's part of one micro-batch between its forward and its backward."""

    version: int
    params: dict[str, Tensor]
    x: Tensor | None
    out: Tensor
    """Boundary coefficients of the chunk's output, with the graph."""
    tokens: int
    """Tokens of the whole micro-batch (what the replica trained on)."""
    compute_s: float
    created: float = field(default_factory=time.monotonic)
    c_in: Tensor | None = None
    full_tokens: TokenBatch | None = None
    """The whole micro-batch's input (a leader keeps it to redo the micro-batch whole)."""


def framed(link: CellLink, xid: bytes) -> FramedExchange:
    """One micro-batch's checked K/V exchange; a refused frame counts in the link's refusals
    (the status page's `cell.refused`)."""
    return FramedExchange(link.exchange(xid), refused=link.refused)


def forward_chunk(
    worker: StageWorker,
    params: dict[str, Tensor],
    c_in: Tensor | None,
    inputs: Tensor,
    layout: ChunkLayout,
    exchange: FramedExchange,
    docs: Tensor | None = None,
) -> tuple[Tensor | None, Tensor]:
    """(input leaf or None, stage output) of one member's chunk, exchanging K/V; `docs`:
    the whole sequence's document ids (packed rows), or None."""
    inputs = inputs.to(worker.device)
    x = None
    if c_in is not None:
        x = worker.stage.decode_boundary(c_in.to(worker.device).float(), inputs)
        x = x.detach().requires_grad_(True)
    docs = None if docs is None else docs.to(worker.device)
    context = AttentionContext(doc_ids=docs, cell=CellContext(layout, exchange))
    with worker.compute.autocast():
        out = functional_call(worker.stage, params, (x, inputs, context))
    return x, out


def gradients(
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
    return host_flat(grads.values())


def unflat(flat: Tensor, like: dict[str, Tensor]) -> dict[str, Tensor]:
    out, offset = {}, 0
    for name, ref in like.items():
        out[name] = flat[offset : offset + ref.numel()].view_as(ref).to(ref.device, ref.dtype)
        offset += ref.numel()
    return out


def chunk_loss(logits: Tensor, targets: Tensor, total: int) -> Tensor:
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
        self._held: dict[bytes, Chunk] = {}
        self._answers: OrderedDict[tuple[bytes, int], asyncio.Future] = OrderedDict()
        """The last requests' answers, for a leader whose stream broke on the way back."""
        self._numel = sum(p.numel() for p in worker.current_version()[1].values())

    def max_request(self) -> int:
        width = max(self.worker.stage.boundary_width, self.worker.manifest.model.d_model)
        return 4 * self._numel + 4 * self.micro_batch * self.seq_len * (width + 3) + 4096

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
                req = await asyncio.to_thread(self._decode, request)  # checks every value
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
        op, xid, version, rank, size, batch, flags, scale = _REQUEST.unpack_from(data)
        members = self.link.members
        if size != len(members) or not 0 < rank < size or members[rank] != self.link.me:
            raise ValueError(f"member {rank} of {size} is not this node in its cell")
        if op not in (OP_FORWARD, OP_BACKWARD, OP_LAST) or not 0 < batch <= self.micro_batch:
            raise ValueError(f"op {op}, batch {batch}")
        if not (scale == scale and abs(scale) <= 1e6):  # NaN or absurd
            raise ValueError("loss scale")
        if flags & ~(WITH_WEIGHTS | WITH_DOCS) or (op == OP_BACKWARD and flags & WITH_DOCS):
            raise ValueError(f"flags {flags:#x}")
        stage = self.worker.stage
        n = ChunkLayout(self.seq_len, size).length(rank)
        read = Reader(data, _REQUEST.size)
        weights = read.take(self._numel, torch.float32) if flags & WITH_WEIGHTS else None
        docs = None
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
            if flags & WITH_DOCS:
                docs = read.take(batch * self.seq_len, torch.int32).view(batch, -1).long()
                check_documents(docs, batch, self.seq_len)
        read.done()
        return WorkRequest(op, xid, version, rank, size, batch, scale, weights, tensors, docs)

    # worker thread from here on
    def _compute(self, req: WorkRequest) -> bytes:
        w = self.worker
        if req.weights is not None:
            self._keep_version(req.version, req.weights)
        layout = ChunkLayout(self.seq_len, req.size)
        if req.op == OP_BACKWARD:
            chunk = self._held.pop(req.xid)  # KeyError: refused (expired or never seen)
            grad_in, grads = gradients(w, chunk.out, req.tensors[0], chunk.params, chunk.x)
            return _answer(grad_in, grads)
        params = self._versions[req.version]  # KeyError: the leader must send the weights
        c_in, ids, targets = req.tensors
        self.tokens += req.batch * self.seq_len
        exchange = framed(self.link, req.xid)
        started = time.perf_counter()
        own_in = None if w.stage.is_first else c_in
        x, out = forward_chunk(w, params, own_in, ids, layout, exchange, req.docs)
        if req.op == OP_LAST:
            total = req.batch * self.seq_len
            loss = chunk_loss(out, targets, total)
            grad_in, grads = gradients(w, loss * req.loss_scale, None, params, x)
            return LOSS.pack(float(loss.detach())) + _answer(grad_in, grads)
        c_out = w.stage.encode_boundary(out.float(), ids.to(w.device))
        self._expire()
        self._held[req.xid] = Chunk(
            req.version, params, x, c_out, ids.numel(), time.perf_counter() - started
        )
        return f32(c_out)

    def _keep_version(self, version: int, flat: Tensor) -> None:
        w = self.worker
        like = w.current_version()[1]
        params = {n: t.detach().requires_grad_(True) for n, t in unflat(flat, like).items()}
        self._versions[version] = params
        while len(self._versions) > KEPT_VERSIONS:
            self._versions.popitem(last=False)
        w.mirror(host_flat(params[n] for n in w._master_of))

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
    return (b"" if grad_in is None else f32(grad_in)) + f32(_flat(grads))
