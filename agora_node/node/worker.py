"""The stage worker: the one place where this node's torch compute happens.

All compute runs on a single dedicated thread, so the event loop that serves
RPCs never blocks on a matrix multiply, and no two torch calls race on weights.

Weight versions (node/versions.py): forwards run on version copies of the weights, so
an inner step can land between a micro-batch's forward and its backward (PipeDream-2BW
stashing), optionally extrapolated to where the weights will be when the gradient lands
(weight prediction).

What backward needs: the autograd graph of each in-flight micro-batch while at
most `max_graphs` are open; beyond that only the stage input is kept and the
forward is recomputed on the same version copy at backward time.

Device (stages/device.py): the stage, its versions and optimizer state live on the
worker's device; every method takes and returns host tensors, so the wire never sees
a device, and the forward runs under the worker's autocast (bf16 or none). Boundary
coefficients and gradients cross in float32.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.func import functional_call

from agora_node.compression import NonFiniteError
from agora_node.node.rates import WorkerStats
from agora_node.node.thread_name import name_os_thread
from agora_node.node.versions import WeightVersions
from agora_node.protocol.manifest import Manifest
from agora_node.stages.data import TokenBatch
from agora_node.stages.device import CPU, Compute
from agora_node.stages.flat import host_flat, write_flat
from agora_node.stages.model import AttentionContext, Stage, lm_loss
from agora_node.stages.optim import InnerOptimizer, lag_beta1

log = logging.getLogger(__name__)


MAX_GRAPHS = 16
"""Autograd graphs of in-flight micro-batches a worker keeps at most (fewer where its
device's memory says so: memory.graph_budget); past them it recomputes."""


PENDING_TTL_S = 300.0
"""Seconds a forward waits for its gradient before it is forgotten: above the longest a
micro-batch may honestly take from here (the pipeline's `deadline_s`, 120 s, plus its last
try, up to twice `hop_timeout_s`: the guard's 240 s). At 120 s a slow but honest one was
forgotten after the stages below had stepped on it, and its upstream's retry trained
them on it twice."""


class WorkerClosed(RuntimeError):
    """A call on a worker that was closed (the node is closing): nothing more runs on it."""


class MicroBatchIdError(Exception):
    """A micro-batch id this worker cannot take: answered as that request's failure (the
    pipeline's FAILED), never a traceback."""


class DuplicateMicroBatchError(MicroBatchIdError):
    """A forward under an id whose forward is still held: overwriting it ran the first
    backward on the second's graph, and the second's found nothing."""


class UnknownMicroBatchError(MicroBatchIdError):
    """A backward for an id this worker holds no forward of (expired, dropped by a state
    load, discarded, or never forwarded here)."""


@dataclass
class _Pending:
    version: int
    params: dict[str, Tensor]
    tokens: TokenBatch
    x_in: Tensor | None
    """Leaf input (requires grad) for stages > 0; None at stage 0."""
    out: Tensor | None
    """Boundary output with its graph, or None when only the input was kept."""
    compute_s: float = 0.0
    """Seconds the forward took; the backward adds its own."""
    created: float = field(default_factory=time.monotonic)


class StageWorker:
    def __init__(
        self,
        manifest: Manifest,
        index: int,
        *,
        max_graphs: int = MAX_GRAPHS,
        pending_ttl_s: float = PENDING_TTL_S,
        compute: Compute = CPU,
        predict_weights: bool = False,
        lag_momentum: bool = False,
    ) -> None:
        self.manifest, self.index, self.compute = manifest, index, compute
        self.lag_momentum = lag_momentum
        self.device = compute.device
        self.stage = Stage(manifest, index).to(self.device)
        self._master_of = {name: p for name, p in self.stage.named_parameters() if p.requires_grad}
        self.masters = list(self._master_of.values())
        """The trainable parameters the optimizer steps, taken before any forward: while a
        forward runs, functional_call swaps version copies into the module, so reading
        `stage.parameters()` from another thread then would return those copies."""
        self.optimizer = self._fresh_optimizer()  # refuses in-backward for accumulating runs
        self.micro_per_step = manifest.inner.local_batch // manifest.inner.micro_batch
        self.in_backward = compute.optimizer_step == "in-backward"
        self.max_graphs, self.pending_ttl_s = max_graphs, pending_ttl_s
        self.stats = WorkerStats()
        self.calls_open = 0
        """Calls running or queued on the worker thread (node/waits.py samples it)."""
        self._executor = ThreadPoolExecutor(
            1,
            thread_name_prefix=f"stage{index}",
            initializer=name_os_thread,  # agora-stageN in top -H and for bench/swarm.py
            initargs=(f"agora-stage{index}",),
        )
        self._pending: dict[str, _Pending] = {}
        self._finished_since_step = 0
        self.hold_steps = False
        """While an outer step reads and rewrites the weights (`frozen`), inner steps wait."""
        self._lock = threading.Lock()  # guards state snapshots taken from the worker thread
        self._thread: threading.Thread | None = None
        self._threaded = False
        self.closed = False
        """Set by `close`: calls from then on raise WorkerClosed."""
        self._executor.submit(self._remember_thread).result()
        self.versions = WeightVersions(
            self.stage,
            self._master_of,
            predict=predict_weights,
            on_grad=self._step_in_backward if self.in_backward else None,
        )

    # ---- plumbing ------------------------------------------------------------------
    async def call(self, fn, *args: Any) -> Any:  # noqa: ANN001
        """Run fn(*args) on the worker thread (WorkerClosed once `close` began)."""
        if self.closed:
            raise WorkerClosed("the stage worker is closed: the node is closing")
        self._threaded = True
        self.calls_open += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        except RuntimeError:  # the executor shut down between the check and the submit
            if self.closed:
                raise WorkerClosed("the stage worker is closed: the node is closing") from None
            raise
        except asyncio.CancelledError:  # `close` cancelled the queued call, not its caller
            task = asyncio.current_task()
            if self.closed and task is not None and not task.cancelling():
                raise WorkerClosed("the stage worker is closed: the node is closing") from None
            raise
        finally:
            self.calls_open -= 1

    def close(self) -> None:
        self.closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)

    @property
    def version(self) -> int:
        return self.versions.number

    @property
    def lag(self) -> float:
        return self.versions.lag

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def _step_in_backward(self, name: str):  # noqa: ANN202
        """The hook that steps master `name` as soon as a backward has accumulated the
        gradient of its version copy, and frees that gradient (optimizer in backward).
        Every micro-batch is a step there (micro_per_step 1); `_finish` ends it. While an
        outer step holds inner steps, the gradient stays on the copy for the step after."""

        def hook(copy: Tensor) -> None:
            if self.hold_steps or copy.grad is None:
                return
            with self._lock:
                self.optimizer.step_param(self._master_of[name], copy.grad)
            copy.grad = None

        return hook

    def _forward(self, params: dict[str, Tensor], x: Tensor | None, tokens: TokenBatch) -> Tensor:
        context = None if tokens.docs is None else AttentionContext(doc_ids=tokens.docs)
        with self.compute.autocast():
            return functional_call(self.stage, params, (x, tokens.inputs, context))

    def _inputs(
        self, c_in: Tensor | None, tokens: Tensor | TokenBatch, leaf: bool = True
    ) -> tuple[Tensor | None, TokenBatch]:
        """Host tensors from the wire -> (decoded stage input or None, the token rows and
        their documents), on the device; the input is a leaf that collects dL/dx unless
        `leaf` is False. Bare token ids are rows of one document each."""
        tokens = TokenBatch.of(tokens).to(self.device)
        if c_in is None:
            return None, tokens
        x = self.stage.decode_boundary(c_in.to(self.device).float(), tokens.inputs)
        return (x.detach().requires_grad_(True) if leaf else x), tokens

    def _encode(self, out: Tensor, inputs: Tensor) -> Tensor:
        """Stage output -> float32 boundary coefficients (outside autocast)."""
        return self.stage.encode_boundary(out.float(), inputs)

    def _busy(self, started: float) -> float:
        """Count compute since `started` (perf_counter) as busy; the seconds spent."""
        self.compute.synchronize()  # a GPU's queued kernels are part of the time
        spent = time.perf_counter() - started
        self.stats.compute_s += spent
        self.stats.busy.add(spent)
        return spent

    def _completed(self, tokens: int, compute_s: float) -> None:
        """A micro-batch's backward ended: its tokens, once, over its forward + backward time."""
        self.stats.microbatches += 1
        self.stats.completed.add(tokens, compute_s)

    # ---- compute (worker thread only) ------------------------------------------------
    def forward(self, mb_id: str, c_in: Tensor | None, tokens: Tensor | TokenBatch) -> Tensor:
        """Forward of a micro-batch that will come back with a gradient; returns boundary coefficients."""
        started = time.perf_counter()
        self._expire()
        if mb_id in self._pending:
            raise DuplicateMicroBatchError(f"micro-batch {mb_id!r} is already in flight here")
        params = self.versions.current
        x_in, tokens = self._inputs(c_in, tokens)
        keep_graph = len(self._pending) < self.max_graphs
        with torch.set_grad_enabled(keep_graph):
            c_out = self._encode(self._forward(params, x_in, tokens), tokens.inputs)
        self._pending[mb_id] = _Pending(
            self.version,
            params,
            tokens,
            x_in,
            c_out if keep_graph else None,
            compute_s=self._busy(started),
        )
        return c_out.detach().cpu()

    def backward(self, mb_id: str, grad_c_out: Tensor) -> Tensor | None:
        """Backward of a forwarded micro-batch; returns the gradient w.r.t. its input coefficients."""
        started = time.perf_counter()
        p = self._pending.pop(mb_id, None)
        if p is None:
            raise UnknownMicroBatchError(f"no forward of micro-batch {mb_id!r} is held here")
        out = p.out
        if out is None:  # graph was not kept: recompute on the same weight version
            self.stats.recomputed += 1
            out = self._encode(self._forward(p.params, p.x_in, p.tokens), p.tokens.inputs)
        with self._whole_backward(p.version, p.params):
            out.backward(grad_c_out.to(self.device, out.dtype))
        grad_in = self._input_grad(p.x_in)
        self._check_finite(p.version, p.params, grad_in)
        self._finish(p.version, p.params, p.tokens.inputs.numel())
        self._completed(p.tokens.inputs.numel(), p.compute_s + self._busy(started))
        return grad_in

    def forward_backward_last(
        self, c_in: Tensor | None, tokens: Tensor | TokenBatch, loss_scale: float
    ) -> tuple[float, Tensor | None]:
        """The last stage: loss and gradient in one go (nothing kept)."""
        started = time.perf_counter()
        params = self.versions.current
        x_in, tokens = self._inputs(c_in, tokens)
        inputs = tokens.inputs
        loss = lm_loss(self._forward(params, x_in, tokens), tokens.targets)
        with self._whole_backward(self.version, params):
            (loss * loss_scale).backward()
        grad_in, loss = self._input_grad(x_in), float(loss.detach())
        self._check_finite(self.version, params, grad_in, loss)
        self._finish(self.version, params, inputs.numel())
        self._completed(inputs.numel(), self._busy(started))
        return loss, grad_in

    @contextlib.contextmanager
    def _whole_backward(self, version: int, params: dict[str, Tensor]) -> Iterator[None]:
        """A backward that runs out of device memory part way has left part of its
        gradient on the version copy, mixed into those of micro-batches that finished on it
        since the last step: that copy's gradients are dropped, so no step applies a partial
        one (the finished ones are lost with it and the step waits for as many others; an
        out-of-memory is rare and halves the graphs kept). With the optimizer step in backward, the parameters already stepped
        stay stepped."""
        try:
            yield
        except torch.OutOfMemoryError:
            dropped = self._drop_grads(version, params)
            log.warning(
                "a backward ran out of device memory part way: the gradients on weight "
                "version %d are dropped (%d micro-batch(es) finished on it since the step)",
                version,
                dropped,
            )
            raise

    def _drop_grads(self, version: int, params: dict[str, Tensor]) -> int:
        """Drop the gradients on copy `params` of `version`; the micro-batches that had
        finished on it since the step no longer count toward the next one (returned)."""
        dropped, tokens = self.versions.drop(version, params)
        self._finished_since_step = max(0, self._finished_since_step - dropped)
        self.stats.trained_tokens -= tokens
        return dropped

    def _check_finite(
        self,
        version: int,
        params: dict[str, Tensor],
        grad_in: Tensor | None,
        loss: float = 0.0,
    ) -> None:
        """After a backward, before it counts: a neighbour's finite but extreme input or
        gradient can overflow here, and a non-finite gradient on the copy made the optimizer
        skip the whole step, with every micro-batch in it. So the copy's gradients are
        dropped as after an out-of-memory (the micro-batches finished on that version since
        the step are lost with them, as before; the step goes on) and NonFiniteError ends
        this micro-batch. Nobody is flagged for it: the overflow may come from this stage's
        own weights, or from a gradient two hops away, as much as from the neighbour (a
        flag on the downstream replica banned honest ones). One norm over the copy's
        gradients is the check the optimizer's step would make. With the step in backward
        the hooks consumed them already: only the input gradient and the loss are checked,
        and the optimizer skips what is not finite itself."""
        grads = [p.grad for p in params.values() if p.grad is not None]
        finite = math.isfinite(loss) and (grad_in is None or bool(torch.isfinite(grad_in).all()))
        if finite and grads:
            finite = math.isfinite(float(torch.nn.utils.get_total_norm(grads)))
        if not finite:
            dropped = self._drop_grads(version, params)
            raise NonFiniteError(
                f"the backward left non-finite gradients on weight version {version} "
                f"(dropped, with {dropped} micro-batch(es) finished on it since the step)"
            )

    def _input_grad(self, x_in: Tensor | None) -> Tensor | None:
        return None if x_in is None else self.boundary_grad(x_in.grad)

    def boundary_grad(self, grad_x: Tensor) -> Tensor:
        """dL/dc for the upstream stage from dL/dx of this stage's input: the k-dim
        projection dL/dx U (or dL/dx when dense), on the host."""
        return (grad_x @ self.stage.basis if self.stage.subspace else grad_x).cpu()

    @torch.no_grad()
    def forward_eval(self, c_in: Tensor | None, tokens: Tensor | TokenBatch) -> Tensor | float:
        """Forward only (validation): boundary coefficients, or the loss at the last stage."""
        started = time.perf_counter()
        x_in, tokens = self._inputs(c_in, tokens, leaf=False)
        # the master weights, not a predicted copy (they are the same without prediction)
        params = (
            dict(self.stage.named_parameters()) if self.versions.predict else self.versions.current
        )
        out = self._forward(params, x_in, tokens)
        result = (
            float(lm_loss(out, tokens.targets))
            if self.stage.is_last
            else self._encode(out, tokens.inputs).cpu()
        )
        self._busy(started)  # busy, but no training tokens: not in the compute rate
        return result

    # ---- a context-parallel cell's leader (node/cell_leader.py; worker thread only) -----
    def current_version(self) -> tuple[int, dict[str, Tensor]]:
        """The version new forwards run on, and its weight copies (never written in place)."""
        return self.version, self.versions.current

    def accumulate(
        self,
        version: int,
        params: dict[str, Tensor],
        grads: dict[str, Tensor],
        tokens: int,
        compute_s: float,
    ) -> None:
        """Gradients computed outside this worker's own backward (a cell's members, summed)
        land on `params` as its backward would have put them; the micro-batch finishes."""
        for name, grad in grads.items():
            copy = params[name]
            if self.in_backward and not self.hold_steps:
                with self._lock:
                    self.optimizer.step_param(self._master_of[name], grad)
            else:
                copy.grad = grad.clone() if copy.grad is None else copy.grad.add_(grad)
        self._check_finite(version, params, None)  # a cell's sums are checked as a backward's
        self._finish(version, params, tokens)
        self._completed(tokens, compute_s)

    def keep_for_recompute(
        self, mb_id: str, version: int, params: dict[str, Tensor], c_in: Tensor | None,
        tokens: TokenBatch,
    ) -> None:  # fmt: skip
        """Hold a micro-batch whose forward ran elsewhere (a cell that broke) so that
        `backward` recomputes it whole on the same weight version."""
        x_in, tokens = self._inputs(c_in, tokens)
        self._pending[mb_id] = _Pending(version, params, tokens, x_in, None)

    @torch.no_grad()
    def mirror(self, flat: Tensor) -> None:
        """Weights := a cell leader's (trainable, flat float32): a helper's replica follows
        the cell it computes for, and goes on from them if the leader vanishes."""
        self._check_thread()
        with self._lock:
            self._write_masters(flat)
            self.versions.publish(self.version + 1)

    def _write_masters(self, flat: Tensor) -> None:
        """The trainable weights := `flat` (their values in order); caller holds the lock."""
        write_flat(self.masters, flat)

    def discard(self, mb_id: str) -> None:
        self._pending.pop(mb_id, None)

    def out_of_memory(self) -> None:
        """An allocation on the device failed: keep half as many graphs open from now on
        (the rest are recomputed at backward) and hand the allocator's cache back."""
        self.stats.out_of_memory += 1
        self.max_graphs //= 2
        self.compute.release_memory()

    def _expire(self) -> None:
        deadline = time.monotonic() - self.pending_ttl_s
        for mb_id in [k for k, p in self._pending.items() if p.created < deadline]:
            del self._pending[mb_id]
            self.stats.expired += 1

    def _finish(self, version: int, params: dict[str, Tensor], tokens: int) -> None:
        self.versions.finished(version, params, tokens)
        if version != self.version:
            self.stats.stale_grads += 1
        self._finished_since_step += 1
        self.stats.trained_tokens += tokens
        if self._finished_since_step >= self.micro_per_step and not self.hold_steps:
            self._step()

    # ---- the outer step's access to the weights --------------------------------------
    @contextlib.asynccontextmanager
    async def frozen(self) -> AsyncIterator[WorkerWeights]:
        """Hold inner steps while an outer step reads and replaces the weights.

        Forwards and backwards go on (gradients keep accumulating and land in the
        first step after); the weights are read and written on the worker thread only.
        """
        await self.call(self._hold)
        weights = WorkerWeights(self)
        try:
            yield weights
        finally:
            await self.call(self._release, weights.replaced)

    def _hold(self) -> None:
        self.hold_steps = True

    def _release(self, weights_changed: bool) -> None:
        """Resume stepping; publish the outer step's weights to new forwards."""
        self.hold_steps = False
        if weights_changed:
            self.versions.publish(self.version + 1)
        if self._finished_since_step >= self.micro_per_step:
            self._step()

    def _check_thread(self) -> None:
        """Once the worker is driven through `call`, parameters are written on its thread only.

        (Used synchronously, as unit tests and the local trainer do, the caller's
        thread is the only one.)"""
        if self._threaded and threading.current_thread() is not self._thread:
            raise RuntimeError("stage parameters may be written on the worker thread only")

    def _remember_thread(self) -> None:
        self._thread = threading.current_thread()

    def _step(self) -> None:
        """Sum finished gradients of every live version into the master weights and step."""
        self.versions.gather(dict(self.stage.named_parameters()))
        self._check_thread()
        with self._lock:
            before = self.versions.before_step()
            if self.lag_momentum:
                self.optimizer.set_beta1(lag_beta1(self.manifest.inner.beta1, self.lag))
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.versions.publish(self.version + 1, moved_from=before)
        self._finished_since_step = 0
        self.stats.steps += 1

    # ---- state: call these through `call` so they serialize with compute -------------
    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "model": {k: v.detach().cpu().clone() for k, v in self.stage.state_dict().items()},
                "optimizer": _to_host(self.optimizer.state_dict()),
                "version": self.version,
                "tokens": self.stats.tokens,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_thread()
        with self._lock:
            self.stage.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self._pending.clear()
            self.stats.trained_tokens -= self.versions.drop_grads()
            self.versions.publish(int(state.get("version", 0)))

    def _fresh_optimizer(self) -> InnerOptimizer:
        return InnerOptimizer(
            self.stage,
            self.manifest.inner,
            self.compute.optimizer_states,
            self.compute.optimizer_step,
        )

    def trainable_numel(self) -> int:
        """Values in the outer anchor of this stage (its trainable parameters, flat)."""
        return sum(p.numel() for p in self.masters)

    @torch.no_grad()
    def adopt_anchor(self, flat: Tensor) -> None:
        """Weights := an attested outer anchor (flat float32, checked by the caller), with a
        fresh inner optimizer: a stranger's moments cannot be attested (docs/security.md).
        Gradients not yet stepped are dropped; micro-batches in flight (a running replica
        resyncing) finish on the weights their forward used and land in the next step."""
        self._check_thread()
        params = self.masters
        if flat.numel() != sum(p.numel() for p in params):
            raise ValueError(
                f"anchor has {flat.numel()} values, this stage {self.trainable_numel()}"
            )
        with self._lock:
            self._write_masters(flat)
            for p in params:
                p.grad = None
            self.optimizer = self._fresh_optimizer()
            self.stats.trained_tokens -= self.versions.drop_grads()
            self._finished_since_step = 0
            self.versions.publish(self.version + 1)

    def parameter_checksum(self) -> str:
        """sha256 over the weights (names and bytes): equal iff two replicas hold the same weights."""
        digest = hashlib.sha256()
        with self._lock:
            for name, tensor in sorted(self.stage.state_dict().items()):
                digest.update(name.encode())
                digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        return digest.hexdigest()


class WorkerWeights:
    """The trainable weights of a frozen worker as one flat float32 vector (outer.Weights),
    read and written on the worker's thread."""

    def __init__(self, worker: StageWorker) -> None:
        self.worker, self.replaced = worker, False
        self._params = worker.masters  # never stage.parameters() here: see StageWorker.masters

    async def read(self) -> Tensor:
        return await self.worker.call(self._flat)

    async def write(self, flat: Tensor) -> None:
        await self.worker.call(self._load, flat)
        self.replaced = True

    def _flat(self) -> Tensor:
        return host_flat(self._params)

    @torch.no_grad()
    def _load(self, flat: Tensor) -> None:
        self.worker._check_thread()
        with self.worker._lock:
            self.worker._write_masters(flat)


def _to_host(state: Any) -> Any:
    """An optimizer state dict with every tensor on the host (a no-op on the CPU)."""
    if isinstance(state, Tensor):
        return state.cpu()
    if isinstance(state, dict):
        return {k: _to_host(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to_host(v) for v in state)
    return state
