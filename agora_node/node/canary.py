"""Canary micro-batches (the SCOUT idea): the same input through several replicas of a
stage, and who departs from the strict majority.

Replicas of a stage hold the same anchor after each outer round and drift apart only
by their own inner steps since, so their outputs for one input are close; a replica
that computes something else (wrong weights, garbage, a scaled output) is far from
all of them. `departing` is the pure decision; `Canaries` sends a pipeline's probes
(pipeline.py hands it every training micro-batch it sends) and flags the departing
answers' authors in the suspects ledger.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from agora_node.comms import streams
from agora_node.comms.pipeline_wire import (
    ForwardHeader,
    Status,
    WireError,
    decode_response,
    encode_forward,
)
from agora_node.compression import CodecError
from agora_node.node.config import PipelineConfig
from agora_node.node.suspects import Reason, Suspects
from agora_node.stages.data import TokenBatch

log = logging.getLogger(__name__)


def distance(a: Tensor, b: Tensor) -> float:
    """||a - b|| relative to the larger of the two norms (inf if either is not finite)."""
    a, b = a.float().reshape(-1), b.float().reshape(-1)
    if a.shape != b.shape or not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return math.inf
    scale = max(float(a.norm()), float(b.norm()), 1e-12)
    return float((a - b).norm()) / scale


def departing(outputs: dict[str, Tensor], tolerance: float, of: int | None = None) -> list[str]:
    """The answers' authors to flag: those farther than `tolerance` from every member of
    some strict majority that agree among themselves: a strict majority of `of` (the
    stage's replicas that were asked from) if given, else of the answers.

    Needs 3 answers or more (with two, neither outvotes the other). If no strict
    majority agrees (all far apart), nobody is flagged: there is nothing to depart from."""
    peers = sorted(outputs)
    n = len(peers)
    if n < 3:
        return []
    close = {
        p: {q for q in peers if q != p and distance(outputs[p], outputs[q]) <= tolerance}
        for p in peers
    }
    need = max(n, of or 0) // 2 + 1  # a strict majority, counting the peer itself
    majority = {p for p in peers if len(close[p]) + 1 >= need}
    if not majority:
        return []
    return [p for p in peers if p not in majority and not close[p] & majority]


_COUNTS = ("sent", "compared", "flagged", "too_many_replicas")

MAX_ASKED = 9
"""Replicas one probe asks at most: in a stage of more than 15 trusted replicas no probe
can reach a strict majority of them, and nobody is flagged by canaries."""


@dataclass(eq=False)
class Canaries:
    """Every `config.canary_every`-th training micro-batch a pipeline sends, the same input
    also goes, as a forward-only probe, to `config.canary_replicas` trusted replicas of
    the next stage; who departs from the strict majority is flagged (`departing`)."""

    config: PipelineConfig
    suspects: Suspects
    replicas: Callable[[int], list[str]]
    """Replicas of a stage the pipeline may send to (not this node)."""
    ask: Callable[[str, bytes], Awaitable[bytes]]
    """One request to a peer, its bytes counted."""
    decode: Callable[[memoryview, tuple[int, int, int]], Awaitable[Tensor]]
    """A replica's output frame, decoded on the worker."""
    last_stage: int
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTS, 0))
    tasks: set[asyncio.Task] = field(default_factory=set)
    _sent_for_training: int = 0

    def sent(self, header: ForwardHeader, tokens: TokenBatch, encoded: bytes) -> None:
        """A training micro-batch went out: probe with it when one is due (in a task)."""
        every = self.config.canary_every
        self._sent_for_training += 1
        if every > 0 and self._sent_for_training % every == 0:
            task = asyncio.create_task(self._canary(header, tokens, encoded))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def cancel(self) -> None:
        for task in list(self.tasks):
            task.cancel()

    async def _canary(self, header: ForwardHeader, tokens: TokenBatch, encoded: bytes) -> None:
        """Probe several replicas of `header.stage` with one input; flag who departs."""
        trusted = [p for p in self.replicas(header.stage) if not self.suspects.is_banned(p)]
        # Who departs is judged against a strict majority of the stage's trusted replicas,
        # not of the sample: two colluders of five, both in a sample of three, agreeing on
        # a made-up answer, were its majority, and got each honest replica banned in turn.
        # So a probe asks at least that majority and one more (at most MAX_ASKED).
        size = max(self.config.canary_replicas, len(trusted) // 2 + 2)
        if len(trusted) < 3:
            return
        if min(size, len(trusted)) > MAX_ASKED:  # counted: canaries are off for this stage
            self.counts["too_many_replicas"] += 1
            return
        chosen = random.sample(trusted, min(size, len(trusted)))
        probe = ForwardHeader(
            **{
                **header.__dict__,
                "mb_id": f"{header.mb_id[:64]}/canary",
                "train": False,
                "probe": True,
            }
        )
        payload = encode_forward(probe, tokens.ids, encoded, tokens.docs)
        self.counts["sent"] += 1
        answers = await asyncio.gather(*(self._probe(p, probe, payload) for p in chosen))
        outputs = {p: a for p, a in zip(chosen, answers, strict=True) if a is not None}
        if len(outputs) < 3:
            return
        self.counts["compared"] += 1
        tolerance = self.config.canary_tolerance
        for peer in await asyncio.to_thread(departing, outputs, tolerance, len(trusted)):
            self.counts["flagged"] += 1
            evidence = f"stage {header.stage}: output departs from the majority of {len(outputs)}"
            self.suspects.flag(peer, Reason.CANARY, evidence)
            log.warning("canary: replica %s %s", peer[-8:], evidence)

    async def _probe(self, peer: str, header: ForwardHeader, payload: bytes) -> Tensor | None:
        """The replica's output for a canary, or None if it gave none (busy, old, gone)."""
        try:
            reply, out = decode_response(await self.ask(peer, payload))
        except (streams.StreamError, WireError):
            return None
        if reply.status != Status.OK.value:
            return None
        if header.stage == self.last_stage:  # the last stage answers its loss
            return torch.tensor([reply.loss_value()])
        if not len(out):
            return None  # a peer without probes answered a validation forward
        try:
            return await self.decode(out, (header.batch, header.seq, header.width))
        except CodecError:
            return torch.tensor([math.nan])  # garbage: far from everyone
