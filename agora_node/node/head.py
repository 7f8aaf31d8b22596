"""Stage 0's side of the data plane: which samples this head trains, injection, validation.

A head keeps up to `max_in_flight` micro-batches in the pipeline (`run`), each
one nested round trip through `Pipeline.send`; it owns its samples by
rendezvous hashing over the live heads (`Sampler`), and measures the whole
pipeline's validation loss on fixed windows (`evaluate`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from collections.abc import Callable

import torch

from agora_node.comms.pipeline_wire import ForwardHeader
from agora_node.compression import NonFiniteError
from agora_node.node.pipeline import Pipeline
from agora_node.node.worker import MicroBatchIdError
from agora_node.stages.data import TokenBatch, TokenWindows
from agora_node.stages.memory import heads_in_flight

log = logging.getLogger(__name__)

HELPER_RECHECK_S = 1.0
"""How often a head that helps a cell (and so injects nothing) looks whether it still does."""


class Head:
    """Injects micro-batches into `pipeline` (a stage-0 node's) and evaluates."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.manifest, self.worker, self.config = (
            pipeline.manifest,
            pipeline.worker,
            pipeline.config,
        )
        self.peer_id, self.stats, self.events = pipeline.peer_id, pipeline.stats, pipeline.events
        self.dropped_tokens = 0
        """Tokens of injected micro-batches that failed: they trained nothing."""

    @property
    def injected_tokens(self) -> int:
        return self.events.injected_tokens

    @property
    def trained_tokens(self) -> int:
        """Tokens toward a budget: those injected and not dropped (in flight or trained),
        plus those of the sequences this head helped its cell's leader split (it injects
        nothing while it helps). A dropped micro-batch's tokens are injected again, so
        runs on a budget compare at equal tokens trained however many failed. Not seen
        here: gradients a stage let go of after their micro-batch completed (those that had
        finished on the same weight copy as a later non-finite or out-of-memory backward,
        StageWorker._drop_grads), and a helper's micro-batches its leader dropped."""
        cells = self.pipeline.cells
        helped = cells.helper.tokens if cells is not None else 0
        return self.injected_tokens - self.dropped_tokens + helped

    async def run(self, sampler: Sampler, stop: asyncio.Event, max_tokens: int = 0) -> bool:
        """Keep up to max_in_flight micro-batches in the pipeline until `stop` is set
        (or, with max_tokens, until `trained_tokens` reaches it with none in flight: one that
        fails at the end is injected again; or until more tokens failed than the budget,
        said in a warning). True if it ended because the budget was trained."""
        limit, why = self.config.max_in_flight, "--max-in-flight"
        if not limit:
            limit = heads_in_flight(self.manifest.inner)
            why = "one inner step's worth"
            if self.manifest.inner.weight_prediction:
                why = "two inner steps' worth: the manifest predicts weights"
        log.info("keeping up to %d micro-batch(es) in flight (%s)", limit, why)
        tasks: set[asyncio.Task] = set()
        stopping = asyncio.ensure_future(stop.wait())
        try:
            return await self._inject(sampler, stop, max_tokens, limit, tasks, stopping)
        except BaseException:  # failed or cancelled: the micro-batches it started too
            for task in tasks:
                task.cancel()
            raise
        finally:
            stopping.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _inject(
        self,
        sampler: Sampler,
        stop: asyncio.Event,
        max_tokens: int,
        limit: int,
        tasks: set[asyncio.Task],
        stopping: asyncio.Future,
    ) -> bool:
        slots = asyncio.Semaphore(limit)
        tokens_per_mb = self.manifest.inner.micro_batch * self.manifest.model.seq_len
        while not stop.is_set():
            if max_tokens and self.dropped_tokens > max_tokens:
                log.warning(
                    "stopping short of the token budget: %d tokens failed, more than the "
                    "budget of %d (see the micro-batch failures above)",
                    self.dropped_tokens,
                    max_tokens,
                )
                return False
            if max_tokens and self.trained_tokens >= max_tokens:
                if not tasks:
                    return True  # the budget is trained
                # those in flight may still fail, and their tokens go back to the budget
                await asyncio.wait([*tasks, stopping], return_when=asyncio.FIRST_COMPLETED)
                continue
            if self._helping():  # its compute belongs to the cell's leader, who injects
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), HELPER_RECHECK_S)
                continue
            await slots.acquire()
            if stop.is_set():
                break
            self.events.count_injected(tokens_per_mb)
            # in a thread: with many heads listed (strangers' records too) a claim scans and
            # hashes for long; the heads are read here, on the loop
            batch = await asyncio.to_thread(
                sampler.claim, self.manifest.inner.micro_batch, sampler.heads()
            )
            task = asyncio.create_task(self._run_microbatch(batch))
            tasks.add(task)
            task.add_done_callback(lambda t: (tasks.discard(t), slots.release()))
        return False

    def _helping(self) -> bool:
        cells = self.pipeline.cells
        return cells is not None and cells.role == "helper"

    async def _run_microbatch(self, batch: TokenBatch) -> None:
        spec = self.manifest.inner
        scale = spec.micro_batch / spec.local_batch
        started = time.monotonic()
        try:
            if self.worker.stage.is_last:  # a one-stage run: everything is local
                loss, _ = await self.pipeline.compute.last(None, batch, scale)
            else:
                loss = await self._pipeline_microbatch(batch, scale)
        except torch.OutOfMemoryError:
            await self.pipeline.out_of_memory()
            loss = None
        except (NonFiniteError, MicroBatchIdError) as exc:  # said why, and who was flagged
            log.info("micro-batch failed: %s", exc)
            loss = None
        except Exception:
            log.exception("micro-batch failed")
            loss = None
        if loss is None:
            self.events.count_microbatch("dropped")
            self.dropped_tokens += batch.inputs.numel()
            return
        self.events.count_microbatch("ok", latency_s=time.monotonic() - started)
        self.events.count_completed(batch.inputs.numel())
        self.stats.losses.append(loss)

    async def _pipeline_microbatch(self, batch: TokenBatch, scale: float) -> float | None:
        mb_id = uuid.uuid4().hex[:16]
        compute = self.pipeline.compute
        leader = compute.leader()  # this head's cell splits the sequence when formed
        c = await compute.forward(leader, mb_id, None, batch)
        header = self._header(mb_id, batch, scale, train=True)
        try:
            reply = await self.pipeline.send(header, batch, c)
            if reply is None:
                await compute.discard(leader, mb_id)
                return None
            loss, grad = reply
            await compute.backward(leader, mb_id, grad)
        except BaseException:  # its forward overflowed (send encodes it first), cancelled
            await self.pipeline.forget(leader, mb_id)
            raise
        return loss

    def _header(self, mb_id: str, batch: TokenBatch, scale: float, *, train: bool) -> ForwardHeader:
        return ForwardHeader(
            run_id=self.manifest.run_id,
            mb_id=mb_id,
            stage=self.worker.index + 1,
            batch=len(batch),
            seq=self.manifest.model.seq_len,
            width=self.worker.stage.boundary_width,
            loss_scale=scale,
            train=train,
            origin=self.peer_id,
        )

    async def evaluate(self, windows: TokenWindows, sample_ids: list[int]) -> float | None:
        """Validation loss of the whole pipeline on fixed windows (forward only)."""
        total, count = 0.0, 0
        step = self.manifest.inner.micro_batch
        for i in range(0, len(sample_ids), step):
            batch = windows.batch(sample_ids[i : i + step])
            out = await self.worker.call(self.worker.forward_eval, None, batch)
            if self.worker.stage.is_last:
                loss = out
            else:
                reply = await self.pipeline.send(
                    self._header(f"eval-{i}", batch, 1.0, train=False), batch, out
                )
                if reply is None:
                    return None
                loss = reply[0]
            total += loss * len(batch)
            count += len(batch)
        self.stats.val_loss, self.stats.val_loss_at = total / count, time.time()
        return self.stats.val_loss


class Sampler:
    """Which training windows this head owns: rendezvous hashing over the live heads.

    Sample s belongs to the head h maximizing hash(epoch, s, h), so two live
    heads never train the same sample in an epoch, and when a head leaves only
    its samples move. Every head walks the same epoch order and skips the rest.
    """

    def __init__(self, windows: TokenWindows, peer_id: str, heads: Callable[[], list[str]]) -> None:
        self.windows, self.peer_id, self.heads = windows, peer_id, heads
        self.position = 0  # across epochs
        self._epoch, self._order = -1, None

    def _owner(self, epoch: int, sample: int, heads: list[str]) -> str:
        def score(h: str) -> bytes:
            return hashlib.blake2b(f"{epoch}/{sample}/{h}".encode(), digest_size=8).digest()

        return max(heads, key=score)

    def claim(self, count: int, heads: list[str] | None = None) -> TokenBatch:
        """The next `count` samples this head owns among `heads` (default: `self.heads()`)."""
        heads = sorted(set(self.heads() if heads is None else heads) | {self.peer_id})
        n = len(self.windows)
        ids: list[int] = []
        while len(ids) < count:
            epoch, offset = divmod(self.position, n)
            if epoch != self._epoch:
                self._order, self._epoch = self.windows.epoch_order(epoch), epoch
            sample = int(self._order[offset])
            self.position += 1
            if len(heads) == 1 or self._owner(epoch, sample, heads) == self.peer_id:
                ids.append(sample)
        return self.windows.batch(ids)
