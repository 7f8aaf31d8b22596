"""The data plane of one node: serve micro-batches for its stage, send them to the next.

A micro-batch is one nested round trip: stage 0 sends it to a stage-1 replica,
which forwards it, sends it on, waits for the answer, runs backward and answers
with the gradient w.r.t. what it received; the last stage computes the loss and
answers at once. Each hop keeps its autograd graph (or input) until its
downstream answers, so a downstream replica that vanishes costs a retry on
another replica, not the micro-batch. A micro-batch that cannot complete within
its deadline is dropped and counted, never stuck.

Compute (codec, forward, backward) runs in the stage worker's thread; the
handlers here only validate headers, route and wait. Stage 0's injection and
validation are in head.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Callable

import torch

from agora_node.comms import streams
from agora_node.comms.guard import TokenBucket
from agora_node.comms.pipeline_wire import (
    MAX_HEADER,
    Code,
    ForwardHeader,
    ResponseHeader,
    Status,
    WireError,
    decode_documents,
    decode_forward,
    decode_response,
    decode_tokens,
    encode_forward,
    encode_response,
    error_response,
)
from agora_node.comms.routing import FailureKind, Router, RouterConfig
from agora_node.compression import ActivationCodec, CodecError, NonFiniteError
from agora_node.node.canary import Canaries
from agora_node.node.cell import Cells, Compute, standing_replicas
from agora_node.node.cell_leader import CellLeader
from agora_node.node.config import PipelineConfig
from agora_node.node.gone import GoneWatch
from agora_node.node.metrics import Metrics
from agora_node.node.suspects import NormWatch, Reason, Suspects
from agora_node.node.worker import MicroBatchIdError, StageWorker, WorkerClosed
from agora_node.protocol.manifest import Manifest
from agora_node.protocol.names import forward_protocol
from agora_node.stages.data import TokenBatch

log = logging.getLogger(__name__)


class PipelineStats:
    """Losses, and the event sink (`events`, the node's Metrics) the pipeline reports to;
    the counts are read from the sink, which counts each event once."""

    def __init__(self, events: Metrics | None = None) -> None:
        self.events = events if events is not None else Metrics()
        self.losses: deque[float] = deque(maxlen=50)
        self.val_loss: float | None = None
        self.val_loss_at: float | None = None
        """When this node last measured `val_loss` (unix time): heads take turns."""

    @property
    def results(self) -> Counter[str]:
        """Micro-batches by outcome: ok / dropped / rejected."""
        return Counter(self.events.microbatch_counts())

    @property
    def rejected_codes(self) -> dict[str, int]:
        return self.events.rejected_codes()


MAX_REJECTIONS = 2
"""Replicas that must reject a micro-batch before its sender drops it (`Pipeline.send`)."""

_UNCOUNTED = frozenset({Code.OVERLOADED, Code.LEAVING, Code.NOT_READY, Code.WRONG_STAGE})
"""Refusals that say nothing about the micro-batch: answered busy, not counted."""
_BUSY = _UNCOUNTED | {Code.UNKNOWN_SENDER}
"""Answered busy, so an honest sender tries another replica: a sender whose fresh record
this node has not read yet is refused by it for one refresh interval at most."""


class ProbeBudget:
    """Probes of stage 0 each sender may make a head answer: `burst` at once, then one
    every `every_s` (a `TokenBucket` per sender; `max_senders` remembered, the least
    recently seen forgotten first). Honest replicas of stage 1 probe one micro-batch in 64
    they train on, a few heads each: one every few seconds at most on a CPU swarm."""

    def __init__(self, burst: int = 4, every_s: float = 1.0, max_senders: int = 1024) -> None:
        self.burst, self.every_s, self.max_senders = burst, every_s, max_senders
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def take(self, sender: str, now: float) -> bool:
        bucket = self._buckets.pop(sender, None) or TokenBucket(1 / self.every_s, self.burst, now)
        self._buckets[sender] = bucket
        while len(self._buckets) > self.max_senders:
            self._buckets.popitem(last=False)
        return bucket.take(now)


class Pipeline:
    """Serves `worker`'s stage (the node routes its forward protocol to `handle`) and sends
    over `p2p`; `peers_of(stage)` names live replicas of a stage.

    Every event (micro-batch outcome and latency, payload bytes, injected and
    completed tokens) goes to `stats.events`, the node's one sink behind both the
    status JSON and /metrics.
    """

    def __init__(
        self,
        manifest: Manifest,
        worker: StageWorker,
        p2p,  # noqa: ANN001 - hivemind P2P
        peer_id: str,
        peers_of: Callable[[int], list[str]],
        config: PipelineConfig,
        stats: PipelineStats | None = None,
        suspects: Suspects | None = None,
        rtt_of: Callable[[str], float | None] | None = None,
        may_send: Callable[[str, int], bool] | None = None,
    ) -> None:
        self.manifest, self.worker, self.p2p, self.peer_id = manifest, worker, p2p, peer_id
        self.peers_of, self.config = peers_of, config
        self.may_send = may_send
        """Whether a peer may send this stage requests: it has a record at the stage
        given (the one before this node's; the next one for a head's probes: the daemon's
        RecentPeers); None, anyone (unit tests of the handler)."""
        self.codec = ActivationCodec(mode=config.activation_codec)
        self.stats = stats if stats is not None else PipelineStats()
        """Shared by the node's successive pipelines, so totals survive a stage switch."""
        self.events = self.stats.events
        self.accepting = True
        self.active_requests = 0
        m = manifest
        boundary = (m.inner.micro_batch, m.model.seq_len, worker.stage.boundary_width)
        self.max_reply = MAX_HEADER + 8 + ActivationCodec.max_frame(boundary)
        """The largest valid answer to a forward request: its header and a float32 frame of
        a whole micro-batch's boundary (a gradient, a canary's output), instead of the 64 MiB
        a stream's frame may hold: what a replica can make this node buffer per request."""
        self._router = Router(
            RouterConfig(tokens_per_item=m.inner.micro_batch * m.model.seq_len), rtt_of=rtt_of
        )
        self._idle = asyncio.Event()
        self._idle.set()
        self.suspects = suspects if suspects is not None else Suspects(me=peer_id)
        """Peers caught sending non-finite or outlier values: routed around while banned."""
        self._activation_norms = NormWatch()
        self.last_request_at = time.monotonic()
        """When a request last came in (from the start: the status tells how long upstream
        has been silent, snapshot.node_waiting_on)."""
        self.refused_by: tuple[float, int, str] | None = None
        """The next stage's last refusal of a micro-batch (monotonic time, stage, its
        words), until a micro-batch goes through: the status says what holds training."""
        self._gradient_norms = NormWatch()
        self._probe_budget = ProbeBudget()
        """A head's: what each peer of stage 1 may have it compute for canaries."""
        self.canaries = Canaries(
            config,
            self.suspects,
            replicas=lambda stage: [p for p in self._replicas(stage) if p != peer_id],
            ask=self._ask,
            decode=lambda out, shape: worker.call(self.codec.decode, out, shape),
            last_stage=m.num_stages - 1,
            check_heads=m.model.cp_degree == 1,
        )
        """Forward-only probes of the next stage's replicas (canary.py)."""
        self.waits = GoneWatch()
        """Requests out to each peer, given up when membership declares it dead or gone."""
        self.compute = Compute(worker)
        """Runs micro-batches on this node's worker, or the cell it leads (node/cell.py)."""

    @property
    def cells(self) -> Cells | None:
        """This stage's context-parallel cell, when the manifest has them."""
        return self.compute.cells

    @cells.setter
    def cells(self, cells: Cells | None) -> None:
        self.compute.cells = cells

    @property
    def stage(self) -> int:
        return self.worker.index

    @property
    def is_head(self) -> bool:
        return self.worker.stage.is_first

    # ---- serving ------------------------------------------------------------------------
    async def handle(self, remote: str, data: bytes):  # noqa: ANN202 - async generator
        self._count_bytes(remote, received=len(data))
        self.last_request_at = time.monotonic()
        self.active_requests += 1
        self._idle.clear()
        try:
            answer = await self._answer(remote, data)
        except WorkerClosed:  # a second stop signal closed the node under a request
            answer = error_response(Status.BUSY, Code.LEAVING, "this node is closing")
        finally:
            self.active_requests -= 1
            if self.active_requests == 0:
                self._idle.set()
        self._count_bytes(remote, sent=len(answer))
        yield answer

    async def _answer(self, remote: str, data: bytes) -> bytes:
        started = time.monotonic()
        try:
            header, tokens, c_in = await self._admit(remote, data)
            if header.train and not await self._plausible(c_in, self._activation_norms, remote):
                self.suspects.flag(remote, Reason.PIPELINE_OUTLIER, "activations: norm outlier")
                raise WireError(Code.BAD_PAYLOAD, "activation norm far from the recent ones")
            if header.train and self.stage == 1:  # a head's activations are checked now and then
                self.canaries.received(remote, header, tokens, c_in)
        except WireError as exc:
            if exc.code == Code.NON_FINITE:
                self.suspects.flag(remote, Reason.NONFINITE, "sent non-finite activations")
            busy = exc.code in _BUSY
            if exc.code not in _UNCOUNTED:
                self.events.count_microbatch("rejected", code=exc.code.value)
                # strangers cause unknown_sender by the thousand, a banned liar banned by
                # the thousand: counted, logged at debug
                quiet = exc.code in (Code.UNKNOWN_SENDER, Code.BANNED)
                level = logging.DEBUG if quiet else logging.INFO
                log.log(level, "rejected micro-batch from %s: %s (%s)", remote[-8:], exc.code, exc)
            return error_response(Status.BUSY if busy else Status.REJECTED, exc.code, str(exc))
        try:
            if header.probe:
                return await self._answer_probe(tokens, c_in)
            if not header.train:
                return await self._answer_eval(header, tokens, c_in)
            return await self._answer_train(remote, header, tokens, c_in, started)
        except NonFiniteError as exc:
            # finite but huge input can overflow inside this stage: answer, never raise
            self.events.count_microbatch("rejected", code=Code.NON_FINITE.value)
            log.info("micro-batch from %s overflowed this stage: %s", remote[-8:], exc)
            return error_response(Status.REJECTED, Code.NON_FINITE, str(exc))
        except torch.OutOfMemoryError:
            await self.out_of_memory()
            return error_response(Status.BUSY, Code.OVERLOADED, "out of device memory")
        except MicroBatchIdError as exc:
            # its forward is no longer held here (expired, dropped by a state load): this
            # hop failed, and another replica may not
            self.events.count_microbatch("dropped")
            log.info("micro-batch from %s failed here: %s", remote[-8:], exc)
            return error_response(Status.FAILED, Code.INTERNAL, str(exc))

    async def out_of_memory(self) -> None:
        """A micro-batch ran this node's device out of memory: counted, logged, fewer
        graphs kept from now on; the sender is answered busy and tries another replica."""
        self.events.count_microbatch("rejected", code="out_of_memory")
        await self.worker.call(self.worker.out_of_memory)
        log.warning(
            "out of device memory on a micro-batch (%d so far): now keeping at most %d "
            "graph(s) open, the rest recomputed at backward",
            self.worker.stats.out_of_memory,
            self.worker.max_graphs,
        )

    async def _answer_train(
        self,
        remote: str,
        header: ForwardHeader,
        tokens: TokenBatch,
        c_in: torch.Tensor,
        started: float,
    ) -> bytes:
        if self.worker.stage.is_last:
            loss, grad = await self.compute.last(c_in, tokens, header.loss_scale)
            answer = await self._ok(loss, grad)  # raises NonFiniteError before counting "ok"
            self.events.count_microbatch("ok", latency_s=time.monotonic() - started)
            return answer
        mb_id = uuid.uuid4().hex  # this hop's own: see _downstream
        leader = self.compute.leader()
        c_out = await self.compute.forward(leader, mb_id, c_in, tokens)
        try:
            reply = await self.send(self._downstream(header, mb_id), tokens, c_out)
        except BaseException:  # its forward overflowed here (send encodes it), or cancelled
            await self.forget(leader, mb_id)
            raise
        if reply is None:
            await self.compute.discard(leader, mb_id)
            self.events.count_microbatch("dropped")
            return error_response(
                Status.FAILED, Code.DOWNSTREAM, f"no stage {self.stage + 1} replica answered"
            )
        loss, grad_out = reply
        try:
            grad_in = await self.compute.backward(leader, mb_id, grad_out)
        except NonFiniteError as exc:  # the backward overflowed: not the upstream's doing
            await self.forget(leader, mb_id)
            self.events.count_microbatch("dropped")
            log.info("micro-batch from %s dropped: %s", remote[-8:], exc)
            return error_response(Status.FAILED, Code.DOWNSTREAM, "its backward overflowed here")
        except BaseException:  # cancelled (the guard's deadline, a leave) before it ran
            await self.forget(leader, mb_id)
            raise
        answer = await self._ok(loss, grad_in)  # raises NonFiniteError before counting "ok"
        self.events.count_microbatch("ok", latency_s=time.monotonic() - started)
        return answer

    async def forget(self, leader: CellLeader | None, mb_id: str) -> None:
        """Drop what this node holds of micro-batch `mb_id` (its graph), whatever ended it;
        a worker already closed (shutting down) has nothing to drop, and the error that
        ended the micro-batch is the one to report."""
        with contextlib.suppress(Exception):
            await self.compute.discard(leader, mb_id)

    def _downstream(self, header: ForwardHeader, mb_id: str) -> ForwardHeader:
        """`header` for the next stage, under `mb_id`, an id of this hop's own. The id an
        upstream chose names the micro-batch among that upstream's only: passed on (or
        used as the worker's key), two upstreams' ids, or one upstream's reused, met at one
        worker, and the second forward replaced the first one's graph."""
        return ForwardHeader(**{**header.__dict__, "stage": self.stage + 1, "mb_id": mb_id})

    async def _admit(
        self, remote: str, data: bytes
    ) -> tuple[ForwardHeader, TokenBatch, torch.Tensor | None]:
        header, raw_tokens, raw_docs, payload = decode_forward(data)
        m = self.manifest
        if header.run_id != m.run_id:
            raise WireError(
                Code.UNKNOWN_RUN, f"this node serves run {m.run_id}, not {header.run_id!r}"
            )
        # nobody sends stage 0 micro-batches: only probes, from stage 1 (Canaries.received)
        head_probe = self.is_head and header.probe and not header.train and header.stage == 0
        if header.stage != self.stage or (self.is_head and not head_probe):
            raise WireError(
                Code.WRONG_STAGE, f"this node serves stage {self.stage}, not {header.stage}"
            )
        sender_stage = self.stage + 1 if head_probe else self.stage - 1
        if self.may_send is not None and not self.may_send(remote, sender_stage):
            raise WireError(
                Code.UNKNOWN_SENDER, f"{remote[-8:]} has no record at stage {sender_stage}"
            )
        if self.suspects.reason_of(remote) == Reason.CANARY:  # caught lying by this node
            raise WireError(Code.BANNED, f"{remote[-8:]} is banned here (canary)")
        if head_probe and not self._probe_budget.take(remote, time.monotonic()):
            raise WireError(Code.OVERLOADED, "over this sender's budget of probes of stage 0")
        if not self.accepting:
            raise WireError(Code.LEAVING, "this node is leaving")
        if self.worker.in_flight + self.active_requests > self.config.max_queue:
            raise WireError(Code.OVERLOADED, "queue is full")
        if header.train and header.loss_scale > m.inner.micro_batch / m.inner.local_batch:
            raise WireError(  # a head's is exactly this: more would outweigh its peers
                Code.BAD_HEADER,
                f"loss_scale {header.loss_scale} > {m.inner.micro_batch}/{m.inner.local_batch}",
            )
        width = self.worker.stage.boundary_width
        # a training micro-batch is a whole one: a short one counts as one of the step's
        # micro-batches at a full one's loss_scale, its few rows weighed as many
        fewest = m.inner.micro_batch if header.train else 1
        if not (
            fewest <= header.batch <= m.inner.micro_batch
            and header.seq == m.model.seq_len
            and header.width == width
        ):
            rows = m.inner.micro_batch if header.train else f"1..{m.inner.micro_batch}"
            raise WireError(
                Code.BAD_SHAPE,
                f"shape [{header.batch}, {header.seq}, {header.width}] is not "
                f"[{rows}, {m.model.seq_len}, {width}]",
            )
        ids = decode_tokens(raw_tokens, header.batch, header.seq, m.model.vocab_size)
        tokens = TokenBatch(ids, decode_documents(raw_docs, header.batch, header.seq))
        if head_probe:  # its input is the tokens
            if len(payload):
                raise WireError(Code.BAD_PAYLOAD, "a probe of stage 0 carries no activations")
            return header, tokens, None
        shape = (header.batch, header.seq, width)
        try:
            c_in = await self.worker.call(self._decode, payload, shape)
        except CodecError as exc:
            code = Code.NON_FINITE if isinstance(exc, NonFiniteError) else Code.BAD_PAYLOAD
            raise WireError(code, str(exc)) from None
        return header, tokens, c_in

    def _decode(self, payload: memoryview, shape: tuple[int, int, int]) -> torch.Tensor:
        # frames are self-describing: a float16 one decodes, and then fails in the stage's
        # float32 matmuls outside any handler's except
        return self.codec.decode(payload, shape, expected_dtype=torch.float32)

    async def _answer_eval(
        self, header: ForwardHeader, tokens: TokenBatch, c_in: torch.Tensor
    ) -> bytes:
        out = await self.worker.call(self.worker.forward_eval, c_in, tokens)
        if self.worker.stage.is_last:
            return encode_response(ResponseHeader(status=Status.OK.value, loss=out))
        reply = await self.send(self._downstream(header, uuid.uuid4().hex), tokens, out)
        if reply is None:
            return error_response(
                Status.FAILED, Code.DOWNSTREAM, "validation forward failed downstream"
            )
        return encode_response(ResponseHeader(status=Status.OK.value, loss=reply[0]))

    async def _answer_probe(self, tokens: TokenBatch, c_in: torch.Tensor | None) -> bytes:
        """A canary: this stage's output for the input (at stage 0, the tokens), nothing
        downstream (canary.py)."""
        out = await self.worker.call(self.worker.forward_eval, c_in, tokens)
        if self.worker.stage.is_last:
            return encode_response(ResponseHeader(status=Status.OK.value, loss=out))
        payload = await self.worker.call(self.codec.encode, out)
        return encode_response(ResponseHeader(status=Status.OK.value), payload)

    async def _ok(self, loss: float, grad: torch.Tensor | None) -> bytes:
        self.stats.losses.append(loss)
        payload = b"" if grad is None else await self.worker.call(self.codec.encode, grad)
        return encode_response(ResponseHeader(status=Status.OK.value, loss=loss), payload)

    async def _plausible(self, values: torch.Tensor, watch: NormWatch, sender: str) -> bool:
        """Is this tensor's norm, from `sender`, within `watch`'s bound of the recent ones
        (suspects.py)? When the watch finds its own norms were stale, the senders it had
        refused are pardoned.
        `values` is a freshly decoded input, not a weight: its norm is taken off the event
        loop but not on the worker thread, where it would queue behind (and reorder) the
        forwards, backwards and steps, adding staleness (measured: the gap to the reference
        trainer in tests/integration/test_pipeline.py grew from ~1% to 2-3%)."""
        norm = await asyncio.to_thread(lambda: float(torch.linalg.vector_norm(values.float())))
        if watch.outlier(norm, sender):
            return False
        if watch.rebased:
            self.suspects.pardon(watch.rebased, Reason.PIPELINE_OUTLIER)
            log.info("norm watch re-based: %d senders moved together", len(watch.rebased))
        return True

    def update_view(self, records: list) -> None:
        """Announced throughput, queue and state of peers, for routing."""
        self._router.update_announced(records)

    # ---- sending ------------------------------------------------------------------------
    async def send(
        self, header: ForwardHeader, tokens: TokenBatch, c: torch.Tensor
    ) -> tuple[float, torch.Tensor | None] | None:
        """Deliver to a replica of `header.stage`, retrying others; (loss, grad) or None if it can't."""
        encoded = await self.worker.call(self.codec.encode, c)
        payload = encode_forward(header, tokens.ids, encoded, tokens.docs)
        if header.train:
            self.canaries.sent(header, tokens, encoded)
        deadline = time.monotonic() + self.config.deadline_s
        tried: set[str] = set()
        rejected_by: set[str] = set()
        """One replica's REJECTED does not drop a micro-batch (a stranger could say it of
        every one); MAX_REJECTIONS replicas' does: an honest sender's is not malformed."""
        while time.monotonic() < deadline:
            candidates = [p for p in self._replicas(header.stage) if p != self.peer_id]
            trusted = [p for p in candidates if not self.suspects.is_banned(p)]
            # banned replicas only when the stage has nobody else (their replies are checked)
            peer = self._router.choose(
                trusted or candidates, time.monotonic(), exclude=tried | rejected_by
            )
            if peer is None:
                if not self.accepting:  # leaving: finish what can finish, don't wait for new peers
                    return None
                if rejected_by and set(candidates) <= rejected_by:
                    return None  # nobody left but those who rejected it
                tried.clear()  # everyone failed once or nobody is there: wait for the swarm to change
                await asyncio.sleep(0.25)
                continue
            result = await self._try_peer(peer, header, payload)
            if isinstance(result, tuple):
                if header.train:  # the last stage's answers are checked now and then
                    self.canaries.answered(header, tokens, encoded, peer, result)
                return result
            if result == "rejected":
                rejected_by.add(peer)
                if len(rejected_by) >= MAX_REJECTIONS:
                    return None
            else:
                tried.add(peer)
        return None

    def _replicas(self, stage: int) -> list[str]:
        """Who takes micro-batches for `stage`: its live replicas, each cell's leader only."""
        return standing_replicas(self.peers_of(stage), self.manifest.model.cp_degree)

    async def _request(self, peer: str, payload: bytes) -> bytes:
        """One forward request to `peer`, its answer within a hop's timeout and
        `max_reply` bytes."""
        return await streams.request(
            self.p2p,
            peer,
            forward_protocol(self.manifest.run_id),
            payload,
            timeout=self.config.hop_timeout_s,
            max_response=self.max_reply,
        )

    def peer_gone(self, peer: str) -> None:
        """Membership declared `peer` dead or gone: its requests end now as failures and
        their micro-batches are retried on another replica (gone.py)."""
        self.waits.gone(peer)

    async def _try_peer(self, peer: str, header: ForwardHeader, payload: bytes):  # noqa: ANN202
        now = time.monotonic()
        self._router.on_sent(peer, now)
        self._count_bytes(peer, sent=len(payload))
        try:
            data = await self.waits.call(peer, self._request(peer, payload))
        except streams.StreamError as exc:
            silent = isinstance(exc, streams.SilentPeerError)
            kind = FailureKind.TIMEOUT if silent else FailureKind.ERROR
            self._hop_failed(peer, kind)
            log.info("stage %d replica %s failed: %s", header.stage, peer[-8:], exc)
            return None
        self._count_bytes(peer, received=len(data))
        try:
            reply, grad_payload = decode_response(data)
        except WireError as exc:
            return self._refuse(peer, Reason.MALFORMED, f"reply: {exc}")
        if reply.status == Status.OK.value:
            latency = time.monotonic() - now
            self._router.on_success(peer, latency, time.monotonic())
            grad = None
            loss = reply.loss_value()
            if not (math.isfinite(loss) and loss >= 0):  # a cross-entropy, training or not
                return self._refuse(peer, Reason.NONFINITE, f"loss {loss}")
            if header.train:
                grad = await self._decode_grad(peer, grad_payload, header)
                if grad is None:
                    return None
                if not await self._plausible(grad, self._gradient_norms, peer):
                    return self._refuse(peer, Reason.PIPELINE_OUTLIER, "gradient: norm outlier")
            self.refused_by = None
            return (loss, grad)
        if reply.status == Status.REJECTED.value:
            self._hop_failed(peer, FailureKind.REJECTED)
            said = reply.message[: streams.PEER_TEXT_CHARS]
            log.warning(  # the peer's own words: cut short, quoted
                "stage %d replica %s rejected our micro-batch: %r", header.stage, peer[-8:], said
            )
            self.refused_by = (time.monotonic(), header.stage, said)
            return "rejected"
        kind = FailureKind.BUSY if reply.status == Status.BUSY.value else FailureKind.ERROR
        self._hop_failed(peer, kind)
        return None

    def _hop_failed(self, peer: str, kind: FailureKind, counted_as: str | None = None) -> None:
        """A request to `peer` (next stage) failed: the router avoids it a while; counted."""
        self._router.on_failure(peer, time.monotonic(), kind)
        self.events.count_hop_failure(counted_as or kind.value)

    async def _decode_grad(
        self, peer: str, payload: memoryview, header: ForwardHeader
    ) -> torch.Tensor | None:
        shape = (header.batch, header.seq, header.width)
        try:
            return await self.worker.call(self._decode, payload, shape)
        except CodecError as exc:
            self._hop_failed(peer, FailureKind.ERROR, counted_as="refused")
            log.warning("bad gradient from %s: %s", peer[-8:], exc)
            if isinstance(exc, NonFiniteError):
                self.suspects.flag(peer, Reason.NONFINITE, "returned a non-finite gradient")
            return None

    def _refuse(self, peer: str, reason: Reason, evidence: str) -> None:
        """A reply that must not be used: ban its sender, try another replica."""
        self._hop_failed(peer, FailureKind.ERROR, counted_as="refused")
        self.suspects.flag(peer, reason, evidence)
        log.warning("refused the reply of %s: %s", peer[-8:], evidence)

    async def _ask(self, peer: str, payload: bytes) -> bytes:
        """`_request`, its bytes counted."""
        data = await self._request(peer, payload)
        self._count_bytes(peer, sent=len(payload), received=len(data))
        return data

    def _count_bytes(self, peer: str, *, sent: int = 0, received: int = 0) -> None:
        self.events.add_bytes(peer, sent=sent, received=received)

    async def drain(self, timeout: float) -> bool:
        """Stop accepting new micro-batches and wait for the ones being served."""
        self.accepting = False
        self.canaries.cancel()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False
