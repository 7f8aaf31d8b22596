"""A context-parallel cell's leader: it drives one micro-batch through its helpers
(node/cell.py says how cells form and what they are; node/cell_work.py is the protocol
and a member's compute).

For each micro-batch the leader sends each helper its chunk (with the weights of the
micro-batch's version when the helper lacks them), runs its own chunk on its worker
thread, and the members exchange K/V layer by layer. The helpers' gradients are summed
with its own into its inner step only when every member succeeded; on any failure every
member's wait ends at once (`CellLink.tell_abort`) and the caller trains the micro-batch
whole (`CellFailed`). One cell micro-batch runs at a time per node (`turn`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import math
import time

import torch
from torch import Tensor

from agora_node.comms import streams
from agora_node.comms.cell_link import CellLink, CellTimeout
from agora_node.node.cell_work import (
    LOSS,
    OP_BACKWARD,
    OP_FORWARD,
    OP_LAST,
    RESEND,
    Chunk,
    Reader,
    WorkRequest,
    chunk_loss,
    encode_request,
    forward_chunk,
    framed,
    gradients,
    unflat,
)
from agora_node.node.worker import StageWorker
from agora_node.protocol.names import cell_work_protocol
from agora_node.stages.context_parallel import ChunkLayout
from agora_node.stages.data import TokenBatch
from agora_node.stages.flat import host_flat
from agora_node.stages.kv_frames import KVFrameError

log = logging.getLogger(__name__)


class CellFailed(ConnectionError):
    """This micro-batch cannot be computed by the cell (a member failed or refused)."""


_CELL_ERRORS = (TimeoutError, CellTimeout, streams.StreamError, KVFrameError, ValueError)

"""What a member's failure looks like from the leader (refusals, timeouts, broken or
malformed answers, refused frames)."""


HELPER_NORM_RATIO = 10.0
"""A helper's gradients (of the weights, and of the stage's input) may be at most this many
times the norm of the leader's own chunk's: the chunks are slices of one micro-batch, and
a helper sending huge but finite values would otherwise make the leader's optimizer skip
its steps (a non-finite norm) or steer them (clipping keeps the direction)."""


def _norm(tensors) -> float:  # noqa: ANN001
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def _plausible(results: list) -> None:
    """(Thread) refuse the micro-batch's gradients when a helper's are out of proportion to
    the leader's own chunk's (HELPER_NORM_RATIO): a ValueError, so the cell fails it and
    the leader trains it whole."""
    own_in, own_grads = results[0][0], results[0][1]
    own = _norm(own_grads.values())
    own_in_norm = _norm([own_in]) if own_in is not None else 0.0
    for rank, (grad_in, flat, _, _) in enumerate(results[1:], 1):
        if _norm([flat]) > HELPER_NORM_RATIO * own + 1e-12:
            raise ValueError(f"helper {rank}'s weight gradient is far above the leader's own")
        has_input = grad_in is not None and own_in is not None and grad_in.numel() > 0
        if has_input and _norm([grad_in]) > HELPER_NORM_RATIO * own_in_norm + 1e-12:
            raise ValueError(f"helper {rank}'s input gradient is far above the leader's own")


def _flatten(params: dict[str, Tensor]) -> Tensor:
    """All of a version's weights, float32, in named_parameters order (what a helper gets)."""
    return host_flat(params.values())


def exchange_id(mb_id: str) -> bytes:
    """16 bytes naming one micro-batch's exchanges on every member."""
    return hashlib.sha256(mb_id.encode()).digest()[:16]


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
        self._held: dict[str, Chunk] = {}
        self._broken: set[str] = set()
        self.broken_at = 0.0
        self.answers_resent = 0

    @property
    def ready(self) -> bool:
        return len(self.members) > 1 and not self._broken

    def holds(self, mb_id: str) -> bool:
        return mb_id in self._held

    async def forward(self, mb_id: str, c_in: Tensor | None, tokens: TokenBatch) -> Tensor:
        """The whole micro-batch's boundary output, computed by the cell."""
        async with self._lock:
            self._check_ready()
            version, params = await self.worker.call(self.worker.current_version)
            xid = exchange_id(mb_id)
            layout = ChunkLayout(self.seq_len, len(self.members))
            requests = await self._chunk_requests(
                OP_FORWARD, xid, version, params, layout, c_in, tokens
            )
            own = self.worker.call(
                self._own_forward, mb_id, xid, version, params, layout, c_in, tokens
            )
            parts = await self._together(xid, own, requests, self._parse_out(layout, tokens))
            self.tokens += tokens.inputs.numel()
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
                    xid, own, requests, self._parse_grads(layout, len(grad_out)), _plausible
                )
            except CellFailed:
                self._held[mb_id] = chunk  # the pipeline hands it back to the worker
                raise
            return await self._commit(chunk, layout, results)

    async def last(
        self, c_in: Tensor, tokens: TokenBatch, loss_scale: float
    ) -> tuple[float, Tensor | None]:
        """The last stage's loss and input gradient, computed by the cell."""
        async with self._lock:
            self._check_ready()
            version, params = await self.worker.call(self.worker.current_version)
            xid = exchange_id(f"last/{id(tokens)}/{time.monotonic_ns()}")
            layout = ChunkLayout(self.seq_len, len(self.members))
            requests = await self._chunk_requests(
                OP_LAST, xid, version, params, layout, c_in, tokens, loss_scale
            )
            own = self.worker.call(
                self._own_last, xid, version, params, layout, c_in, tokens, loss_scale
            )
            results = await self._together(
                xid,
                own,
                requests,
                self._parse_grads(layout, len(tokens), with_loss=True),
                _plausible,
            )
            chunk = results[0][2]
            loss = sum(r[3] for r in results)
            self.tokens += tokens.inputs.numel()
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
    async def _chunk_requests(self, op, xid, version, params, layout, c_in, tokens, scale=1.0):  # noqa: ANN001, ANN202
        reqs = []
        inputs, targets = tokens.inputs, tokens.targets
        flat = None
        if any(self._shipped.get(p) != version for p in self.members[1:]):
            # the version's copies are never written in place: read off the event loop, once
            flat = await asyncio.to_thread(_flatten, params)
        for r, peer in enumerate(self.members):
            if not r:
                continue
            weights = flat if self._shipped.get(peer) != version else None
            chunk_in = layout.take(c_in, r) if c_in is not None else torch.empty(0)
            chunk_targets = (
                layout.take(targets, r) if op == OP_LAST else torch.empty(0, dtype=torch.long)
            )
            req = WorkRequest(op, xid, version, r, layout.size, len(tokens), scale, weights,
                              (chunk_in, layout.take(inputs, r), chunk_targets),
                              docs=tokens.docs)  # fmt: skip
            reqs.append((peer, req))
        return reqs

    async def _together(self, xid: bytes, own, requests, parse, check=None) -> list:  # noqa: ANN001
        """Run the own part and every helper's at once; all their results, in rank order,
        or CellFailed (and every member's waiting ends) as soon as one fails, or `check`
        (on a thread, given the results) raises."""
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
            results = [own_task.result(), *(a.result() for a in asks)]
            if check is not None:
                await asyncio.to_thread(check, results)
            for peer, req in requests:
                if req.weights is not None:
                    self._shipped[peer] = req.version
            return results
        except BaseException as exc:
            # whatever ended it (a member, this stage's own input, a cancelled request), no
            # member may go on waiting for the others' frames
            for task in asks:
                task.cancel()
            await self.link.tell_abort([peer for peer, _ in requests], xid)
            with contextlib.suppress(BaseException):
                await own_task  # its exchange was aborted: it ends now
            if not isinstance(exc, _CELL_ERRORS):
                raise
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
            payload = await asyncio.to_thread(encode_request, req)
            data = await streams.request(self.p2p, peer, name, payload, timeout=timeout)
        except streams.RefusedError:
            raise
        except streams.StreamError:  # broken on the way: the answer may be waiting there
            again = dataclasses.replace(req, op=req.op | RESEND, weights=None, tensors=())
            data = await streams.request(
                self.p2p, peer, name, encode_request(again), timeout=timeout
            )
            self.answers_resent += 1
        return await asyncio.to_thread(parse, req.rank, data)  # checks every value

    def _parse_out(self, layout: ChunkLayout, tokens: TokenBatch):  # noqa: ANN202
        width = self.worker.stage.boundary_width
        b = len(tokens)

        def parse(rank: int, data: bytes) -> Tensor:
            read = Reader(data, 0)
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
            loss = LOSS.unpack_from(data)[0] if with_loss else 0.0
            read = Reader(data, LOSS.size if with_loss else 0)
            n = layout.length(rank)
            grad_in = read.take(batch * n * width, torch.float32).view(batch, n, width)
            grads = read.take(numel, torch.float32)
            read.done()
            if not 0.0 <= loss <= 1e4:  # a share of a cross-entropy (NaN fails too)
                raise ValueError("a helper's loss is not a plausible number")
            return grad_in, grads, None, loss

        return parse

    # worker thread
    def _own_forward(self, mb_id, xid, version, params, layout, c_in, tokens) -> Tensor:  # noqa: ANN001
        w, started = self.worker, time.perf_counter()
        inputs = layout.take(tokens.inputs, 0)
        exchange = framed(self.link, xid)
        own_in = None if c_in is None else layout.take(c_in, 0)
        x, out = forward_chunk(w, params, own_in, inputs, layout, exchange, tokens.docs)
        c_out = w.stage.encode_boundary(out.float(), inputs.to(w.device))
        self._held[mb_id] = Chunk(
            version, params, x, c_out, tokens.inputs.numel(), time.perf_counter() - started,
            c_in=c_in, full_tokens=tokens,
        )  # fmt: skip
        return c_out.detach().cpu()

    def _own_backward(self, chunk: Chunk, grad: Tensor):  # noqa: ANN202
        started = time.perf_counter()
        grad_in, grads = gradients(
            self.worker, chunk.out, grad.to(chunk.out.device), chunk.params, chunk.x
        )
        chunk.compute_s += time.perf_counter() - started
        return grad_in, grads, chunk, 0.0

    def _own_last(self, xid, version, params, layout, c_in, tokens, scale):  # noqa: ANN001, ANN202
        w, started = self.worker, time.perf_counter()
        inputs, targets = layout.take(tokens.inputs, 0), layout.take(tokens.targets, 0)
        exchange = framed(self.link, xid)
        x, logits = forward_chunk(
            w, params, layout.take(c_in, 0), inputs, layout, exchange, tokens.docs
        )
        loss = chunk_loss(logits, targets, tokens.inputs.numel())
        grad_in, grads = gradients(w, loss * scale, None, params, x)
        chunk = Chunk(
            version,
            params,
            x,
            logits,
            tokens.inputs.numel(),
            time.perf_counter() - started,
        )
        return grad_in, grads, chunk, float(loss.detach())

    async def _commit(self, chunk: Chunk, layout: ChunkLayout, results: list) -> Tensor | None:
        """Every member succeeded: the summed gradients land on the leader's replica."""
        await self.worker.call(self._sum_and_accumulate, chunk, results)
        self.completed += 1
        grad_parts = [results[0][0], *(r[0] for r in results[1:])]
        if grad_parts[0] is None:
            return None
        return layout.assemble([g.cpu() for g in grad_parts])

    def _sum_and_accumulate(self, chunk: Chunk, results: list) -> None:
        """(Worker thread) the members' gradients, summed, land on the replica."""
        own_grads = results[0][1]
        total = dict(own_grads)
        for _, flat, _, _ in results[1:]:
            for name, g in unflat(flat, own_grads).items():
                total[name] = total[name] + g
        self.worker.accumulate(chunk.version, chunk.params, total, chunk.tokens, chunk.compute_s)
