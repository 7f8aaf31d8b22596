"""Canary micro-batches (the SCOUT idea): the same input through several replicas of a
stage, and who departs from the strict majority.

Replicas of a stage hold the same anchor after each outer round and drift apart only
by their own inner steps since, so their outputs for one input are close; a replica
that computes something else (wrong weights, garbage, a scaled output) is far from
all of them. `departing` is the pure decision; `Canaries` sends a pipeline's probes
(pipeline.py hands it every training micro-batch it sends) and flags the departing
answers' authors in the suspects ledger.

Probes of a stage before the last are forward-only requests (marked as probes: a replica
can tell them from training, and a liar can answer them honestly). A head's activations are
checked where they arrive: a replica of stage 1 has other heads recompute stage 0's output
for one micro-batch's tokens it trains on (`received`, probes of stage 0: the tokens, no
activations) and compares the head's activations with theirs; it refuses a head caught
departing (`Code.BANNED`). Probes of the last
stage are training requests like any other (`answered`): the same micro-batch, once its
replica answered, goes to more replicas under fresh ids, each trains on it and answers
its loss and its gradient, and the answers are compared with the replica's that trained
on it (`LOSS_TOLERANCE`, and `GRAD_TOLERANCE` by `grad_distance`; gradients of noise,
over several checks: `NoiseWatch`). A replica that lies on
the gradients or the loss it returns cannot tell which of its micro-batches are checked:
one in `canary_every` on average, drawn by a secret random choice (a fixed schedule let a
liar that counted its answers lie on all the others). The price: each checked micro-batch
is trained by the other replicas asked too (2 more at 3 to 5 replicas, half the stage and
one more beyond: 2 to 8 of every 64 micro-batches), which count it as trained.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from agora_node.comms import streams
from agora_node.comms.pipeline_wire import (
    ForwardHeader,
    ResponseHeader,
    Status,
    WireError,
    decode_response,
    encode_forward,
)
from agora_node.compression import CodecError
from agora_node.node.canary_rules import (
    GRAD_TOLERANCE,
    HEAD_STRIKES,
    HEAD_TOLERANCE,
    LOSS_TOLERANCE,
    MAX_WATCHED,
    NOISE_CHECKS,
    NOISE_COSINE,
    NoiseWatch,
    best_cosines,
    departing,
    distance,
    grad_distance,
)
from agora_node.node.config import PipelineConfig
from agora_node.node.suspects import Reason, Suspects
from agora_node.stages.data import TokenBatch

log = logging.getLogger(__name__)


_COUNTS = ("sent", "compared", "flagged", "too_many_replicas", "trained")

_SECRET = random.SystemRandom()
MAX_ASKED = 9
"""Replicas one probe asks at most: in a stage of more than 15 trusted replicas no probe
can reach a strict majority of them, and nobody is flagged by canaries."""


def _probe_header(header: ForwardHeader, *, stage: int) -> ForwardHeader:
    """A forward-only probe of `stage` with `header`'s input (marked: answered with the
    stage's output and nothing downstream)."""
    return ForwardHeader(
        **{
            **header.__dict__,
            "stage": stage,
            "mb_id": f"{header.mb_id[:64]}/canary",
            "train": False,
            "probe": True,
        }
    )


@dataclass(eq=False)
class Canaries:
    """One training micro-batch in `config.canary_every` a pipeline sends (`sent`: a
    forward-only probe of the next stage's replicas), has answered by the last stage
    (`answered`: copies trained by other replicas) or, at stage 1, receives from a head
    (`received`: other heads recompute its activations) is checked against trusted
    replicas, at least `config.canary_replicas`; who departs from a strict majority of the
    stage is flagged (`departing`)."""

    config: PipelineConfig
    suspects: Suspects
    replicas: Callable[[int], list[str]]
    """Replicas of a stage the pipeline may send to (not this node)."""
    ask: Callable[[str, bytes], Awaitable[bytes]]
    """One request to a peer, its bytes counted."""
    decode: Callable[[memoryview, tuple[int, int, int]], Awaitable[Tensor]]
    """A replica's output frame, decoded on the worker."""
    last_stage: int
    check_heads: bool = True
    """Whether this node, at stage 1, has heads' activations recomputed (`received`; not
    in context-parallel cells, whose heads split each sequence)."""
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTS, 0))
    noise: NoiseWatch = field(default_factory=NoiseWatch)
    strikes: dict[str, int] = field(default_factory=dict)
    """Heads whose activations departed in their last checks, how many in a row."""
    tasks: set[asyncio.Task] = field(default_factory=set)
    closed: bool = False
    """Set by `cancel` (a leave): no check starts after it."""

    def sent(self, header: ForwardHeader, tokens: TokenBatch, encoded: bytes) -> None:
        """A training micro-batch went out: probe with it when one is due (in a task). The
        last stage's are checked once answered (`answered`)."""
        if header.stage != self.last_stage and self._due():
            self._spawn(self._canary(header, tokens, encoded))

    def answered(
        self,
        header: ForwardHeader,
        tokens: TokenBatch,
        encoded: bytes,
        replica: str,
        answer: tuple[float, Tensor | None],
    ) -> None:
        """`replica` of the last stage trained on a micro-batch and answered `answer` (its
        loss and gradient): when a check is due, the same micro-batch goes to more replicas
        as training, and who departs from the majority is flagged (in a task)."""
        if header.stage == self.last_stage and answer[1] is not None and self._due():
            self._spawn(self._training_canary(header, tokens, encoded, replica, answer))

    def _due(self) -> bool:
        """One micro-batch in `canary_every`, drawn at random from a source no peer can
        predict (a count from the pipeline's start could be followed by a liar)."""
        every = self.config.canary_every
        return every > 0 and not self.closed and _SECRET.randrange(every) == 0

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _asked(self, trusted: int) -> int | None:
        """How many replicas of a stage of `trusted` ones one check must hear (a strict
        majority of them and one more, at least canary_replicas), or None: no check (fewer
        than 3, or more than MAX_ASKED needed: counted)."""
        size = min(max(self.config.canary_replicas, trusted // 2 + 2), trusted)
        if trusted < 3:
            return None
        if size > MAX_ASKED:  # counted: canaries are off for this stage
            self.counts["too_many_replicas"] += 1
            return None
        return size

    async def _training_canary(
        self,
        header: ForwardHeader,
        tokens: TokenBatch,
        encoded: bytes,
        replica: str,
        answer: tuple[float, Tensor | None],
    ) -> None:
        """The last stage's check (module docstring): copies of a trained micro-batch as
        training requests to more trusted replicas; losses and gradients compared."""
        trusted = [p for p in self.replicas(header.stage) if not self.suspects.is_banned(p)]
        if replica not in trusted:  # a banned replica it fell back to: nothing to vouch for
            return
        size = self._asked(len(trusted))
        if size is None:
            return
        others = random.sample([p for p in trusted if p != replica], size - 1)
        copies = {}
        for peer in others:  # each its own id, as any micro-batch (ids are never reused)
            mb_id = uuid.uuid4().hex[: max(16, min(len(header.mb_id), 32))]
            copy = ForwardHeader(**{**header.__dict__, "mb_id": mb_id})
            copies[peer] = (copy, encode_forward(copy, tokens.ids, encoded, tokens.docs))
        self.counts["sent"] += 1
        self.counts["trained"] += len(copies)
        replies = await asyncio.gather(*(self._trained(p, *copies[p]) for p in others))
        answers = {p: a for p, a in zip(others, replies, strict=True) if a is not None}
        answers[replica] = answer
        if len(answers) < 3:
            return
        self.counts["compared"] += 1
        losses = {p: torch.tensor([loss]) for p, (loss, _) in answers.items()}
        grads = {p: grad for p, (_, grad) in answers.items()}

        def judge() -> tuple[dict[str, str], dict[str, float]]:
            found = dict.fromkeys(departing(losses, LOSS_TOLERANCE, len(trusted)), "loss")
            for peer in departing(grads, GRAD_TOLERANCE, len(trusted), grad_distance):
                found[peer] = "gradient" if peer not in found else "loss and gradient"
            return found, best_cosines(grads, len(trusted) // 2 + 1)

        found, cosines = await asyncio.to_thread(judge)
        for peer, what in found.items():
            self.counts["flagged"] += 1
            evidence = (
                f"stage {header.stage}: its {what} for a micro-batch departs from the majority "
                f"of {len(answers)} replicas that trained on it"
            )
            self.suspects.flag(peer, Reason.CANARY, evidence)
            log.warning("canary: replica %s %s", peer[-8:], evidence)
        log.debug(
            "canary: best gradient cosines %s", {p[-8:]: round(c, 3) for p, c in cosines.items()}
        )
        for peer in self.noise.noisy({p: c for p, c in cosines.items() if p not in found}):
            self.counts["flagged"] += 1
            evidence = (
                f"stage {header.stage}: its gradients for its last {NOISE_CHECKS} checked "
                f"micro-batches were noise (best cosine with another replica's under "
                f"{NOISE_COSINE} on average)"
            )
            self.suspects.flag(peer, Reason.CANARY, evidence)
            log.warning("canary: replica %s %s", peer[-8:], evidence)

    async def _trained(
        self, peer: str, header: ForwardHeader, payload: bytes
    ) -> tuple[float, Tensor] | None:
        """A replica's loss and gradient for a copy it trained on, or None if it gave none
        (busy, gone)."""
        answered = await self._ok_reply(peer, payload)
        if answered is None:
            return None
        reply, out = answered
        return reply.loss_value(), await self._decoded(out, header)

    async def _ok_reply(
        self, peer: str, payload: bytes
    ) -> tuple[ResponseHeader, memoryview] | None:
        """A replica's OK answer to one request, or None if it gave none (busy, old, gone)."""
        try:
            reply, out = decode_response(await self.ask(peer, payload))
        except (streams.StreamError, WireError):
            return None
        return (reply, out) if reply.status == Status.OK.value else None

    async def _decoded(self, out: memoryview, header: ForwardHeader) -> Tensor:
        """A replica's frame of `header`'s shape; one that cannot be decoded, as NaN (far
        from everyone)."""
        shape = (header.batch, header.seq, header.width)
        try:
            return await self.decode(out, shape)
        except CodecError:
            return torch.full(shape, math.nan)

    def cancel(self) -> None:
        """A leave: checks under way stop, and no new one starts (micro-batches still in
        flight finish and would otherwise send copies to other replicas meanwhile)."""
        self.closed = True
        for task in list(self.tasks):
            task.cancel()

    def received(
        self, sender: str, header: ForwardHeader, tokens: TokenBatch, c_in: Tensor
    ) -> None:
        """`sender`, a head, sent this node (stage 1) a training micro-batch and its
        activations `c_in`: when a check is due, other heads compute stage 0's output for
        its tokens, and whether the sender's departs from theirs is judged (in a task).
        Nobody else could tell a head's activations from noise of a plausible norm."""
        if header.stage == 1 and self.check_heads and self._due():
            self._spawn(self._head_check(sender, header, tokens, c_in))

    async def _head_check(
        self, sender: str, header: ForwardHeader, tokens: TokenBatch, c_in: Tensor
    ) -> None:
        # Heads banned here for anything but a canary are checked, and asked, too: this node
        # bans heads only for their micro-batches, and a norm outlier's ban (early in a
        # run its norms grow fast: QA runs had two of three heads banned so) still takes
        # their other micro-batches, while a canary ban refuses them all.
        heads = self.replicas(0)
        if sender not in heads:
            return
        others = [p for p in heads if p != sender and self.suspects.reason_of(p) != Reason.CANARY]
        size = self._asked(len(others) + 1)
        if size is None:
            log.debug("canary: no check of head %s (%d other heads)", sender[-8:], len(others))
            return
        chosen = random.sample(others, size - 1)
        probe = _probe_header(header, stage=0)
        payload = encode_forward(probe, tokens.ids, b"", tokens.docs)
        await self._judge_probes(
            probe, payload, chosen, len(others) + 1, {sender: c_in}, grad_distance, HEAD_TOLERANCE
        )

    async def _canary(self, header: ForwardHeader, tokens: TokenBatch, encoded: bytes) -> None:
        """Probe several replicas of `header.stage` with one input; flag who departs."""
        trusted = self._trusted(header.stage)
        # Who departs is judged against a strict majority of the stage's trusted replicas,
        # not of the sample: two colluders of five, both in a sample of three, agreeing on
        # a made-up answer, were its majority, and got each honest replica banned in turn.
        # So a probe asks at least that majority and one more (at most MAX_ASKED).
        size = self._asked(len(trusted))
        if size is None:
            return
        chosen = random.sample(trusted, size)
        probe = _probe_header(header, stage=header.stage)
        payload = encode_forward(probe, tokens.ids, encoded, tokens.docs)
        await self._judge_probes(probe, payload, chosen, len(trusted))

    def _trusted(self, stage: int) -> list[str]:
        return [p for p in self.replicas(stage) if not self.suspects.is_banned(p)]

    async def _judge_probes(
        self,
        probe: ForwardHeader,
        payload: bytes,
        chosen: list[str],
        trusted: int,
        given: dict[str, Tensor] | None = None,
        far: Callable[[Tensor, Tensor], float] = distance,
        tolerance: float | None = None,
    ) -> None:
        """Ask `chosen` for their output on `probe`; with the outputs `given` (a head's
        activations as sent), flag who departs from a strict majority of `trusted` (by
        `far`, beyond `tolerance`: by default `config.canary_tolerance`)."""
        self.counts["sent"] += 1
        answers = await asyncio.gather(*(self._probe(p, probe, payload) for p in chosen))
        outputs = {p: a for p, a in zip(chosen, answers, strict=True) if a is not None}
        outputs |= given or {}
        if len(outputs) < 3:
            return
        self.counts["compared"] += 1
        tolerance = self.config.canary_tolerance if tolerance is None else tolerance
        if log.isEnabledFor(logging.DEBUG):
            peers = sorted(outputs)
            pairs = {
                f"{p[-4:]}-{q[-4:]}": (
                    round(distance(outputs[p], outputs[q]), 3),
                    round(grad_distance(outputs[p], outputs[q]), 3),
                )
                for i, p in enumerate(peers)
                for q in peers[i + 1 :]
            }
            log.debug("canary: stage %d outputs' distances %s", probe.stage, pairs)
        departed = await asyncio.to_thread(departing, outputs, tolerance, trusted, far)
        if given:  # a head's activations: only the sender is judged, on a second departure
            departed = [p for p in given if self._strike(p, p in departed)]
        for peer in departed:
            self.counts["flagged"] += 1
            evidence = f"stage {probe.stage}: output departs from the majority of {len(outputs)}"
            if given:
                evidence = (
                    f"stage {probe.stage}: the activations it sent departed twice in a row from "
                    f"those a majority of {len(outputs)} heads recomputed"
                )
            self.suspects.flag(peer, Reason.CANARY, evidence)
            log.warning("canary: replica %s %s", peer[-8:], evidence)

    def _strike(self, head: str, departed: bool) -> bool:
        """Whether `head` departed in its last HEAD_STRIKES checks in a row (then its count
        starts over); bounded: MAX_WATCHED heads."""
        count = self.strikes.pop(head, 0) + 1 if departed else 0
        if count >= HEAD_STRIKES:
            return True
        if count:
            self.strikes[head] = count
            while len(self.strikes) > MAX_WATCHED:
                del self.strikes[next(iter(self.strikes))]
        return False

    async def _probe(self, peer: str, header: ForwardHeader, payload: bytes) -> Tensor | None:
        """The replica's output for a canary, or None if it gave none (busy, old, gone).
        (Only stages before the last are probed this way: `_training_canary`.)"""
        answered = await self._ok_reply(peer, payload)
        if answered is None or not len(answered[1]):
            return None  # (empty: a peer without probes answered a validation forward)
        return await self._decoded(answered[1], header)
