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

In outer rounds a cell is one replica, its leader (node/service.py counts `routable`
peers): helpers take no rounds while they help, and a leader never waits for them. A
helper mirrors the weights it is sent into its own replica; if the leader vanishes it
trains on from them as a replica of its own, its outer anchor reset to them (or, where a
strict majority of its stage attests another anchor for that round, the stage's).

Failure: a helper that dies, stalls or refuses fails the leader's exchange at once
(`CellLink.abort`). The leader trains that micro-batch whole instead, recomputing from
the input it kept, and leaves the helper out until the cell is formed again. So a dead
helper costs time, never a micro-batch.

A helper trusts only its leader, and the leader checks what a helper sends: exact
lengths and finite values. A helper that lies about its gradients can bend its cell's
replica as any replica can bend its own; the outer steps' checks bound what reaches the
stage (docs/security.md).

The pipeline and the head run each micro-batch through `Compute`: on the cell this node
leads when it is ready, else on the worker alone (whole sequences).

Stage 0 forms cells too: the cell's leader is its head, sampling and injecting as one
head (node/head.py: a helper injects nothing while it helps, and sampling counts a cell
once), and the helpers embed and run their chunks of each sequence it injects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import torch

from agora_node.comms.cell_link import CellLink
from agora_node.node.cell_leader import CellFailed, CellLeader
from agora_node.node.cell_work import CellHelper
from agora_node.node.worker import StageWorker
from agora_node.protocol.names import cell_protocol, cell_work_protocol
from agora_node.stages.data import TokenBatch
from agora_node.stages.kv_frames import max_kv_frame_bytes

log = logging.getLogger(__name__)


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


def standing_replicas(peers: list[str], cp_degree: int) -> list[str]:
    """A stage's replicas as routing, outer rounds and stage 0's sampling count them:
    where cells form (cp_degree > 1) each cell is one replica, its leader."""
    return routable(peers, cp_degree) if cp_degree > 1 else list(peers)


def cell_of(me: str, peers: list[str], size: int) -> list[str]:
    """The cell `me` belongs to (itself alone when it is in none)."""
    for cell in cell_groups([*peers, me], size):
        if me in cell:
            return cell
    return [me]


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
        self.link = CellLink(
            p2p,
            run_id,
            members=[me],
            me=me,
            timeout_s=timeout_s,
            max_frame=max_kv_frame_bytes(m.model, m.inner.micro_batch),
        )
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
        """Every stage of a manifest with cp_degree > 1 forms cells."""
        return worker.manifest.model.cp_degree > 1

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


class Compute:
    """Where a stage's micro-batches run: this node's worker alone, or the cell it leads
    (the cell's leader when it is ready; the worker whole when the cell fails). A
    micro-batch's backward and discard go to the leader its forward went to."""

    def __init__(self, worker: StageWorker) -> None:
        self.worker = worker
        self.cells: Cells | None = None

    def leader(self) -> CellLeader | None:
        """The cell this node leads now (None: it computes alone)."""
        return self.cells.leader if self.cells is not None else None

    async def last(
        self, c_in: torch.Tensor | None, tokens: TokenBatch, loss_scale: float
    ) -> tuple[float, torch.Tensor | None]:
        leader = self.leader()
        if leader is not None and leader.ready:
            try:
                return await leader.last(c_in, tokens, loss_scale)
            except CellFailed as exc:
                log.info("%s; this micro-batch is trained whole", exc)
        return await self.worker.call(self.worker.forward_backward_last, c_in, tokens, loss_scale)

    async def forward(
        self,
        leader: CellLeader | None,
        mb_id: str,
        c_in: torch.Tensor | None,
        tokens: TokenBatch,
    ) -> torch.Tensor:
        if leader is not None and leader.ready:
            try:
                return await leader.forward(mb_id, c_in, tokens)
            except CellFailed as exc:
                log.info("%s; this micro-batch is trained whole", exc)
                leader.discard(mb_id)
        return await self.worker.call(self.worker.forward, mb_id, c_in, tokens)

    async def backward(
        self, leader: CellLeader | None, mb_id: str, grad_out: torch.Tensor
    ) -> torch.Tensor | None:
        if leader is not None and leader.holds(mb_id):
            try:
                if not leader.ready:  # a helper failed since this forward
                    raise CellFailed("the cell broke after this micro-batch's forward")
                return await leader.backward(mb_id, grad_out)
            except CellFailed as exc:
                log.info("%s; this micro-batch is recomputed whole", exc)
                await self.worker.call(leader.take_back, mb_id)
        return await self.worker.call(self.worker.backward, mb_id, grad_out)

    async def discard(self, leader: CellLeader | None, mb_id: str) -> None:
        if leader is not None:
            leader.discard(mb_id)
        await self.worker.call(self.worker.discard, mb_id)
