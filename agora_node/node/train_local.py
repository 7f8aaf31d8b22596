"""The single-process reference trainer: every stage chained in one process.

This is the baseline every swarm benchmark divides by, and the quality bar the
swarm must match. It uses the same stage modules, data windows, micro-batching
and inner optimizer as the daemons; only the network is missing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from agora_node.compression import (
    ActivationCodec,
    ActivationMode,
    GradientSender,
    GradRounding,
    through_wire,
)
from agora_node.node.checkpoint import load_latest_checkpoint, save_checkpoint
from agora_node.protocol.manifest import Manifest
from agora_node.stages.data import TokenBatch, TokenWindows
from agora_node.stages.device import CPU, Compute
from agora_node.stages.model import AttentionContext, Stage, build_stages, lm_loss
from agora_node.stages.optim import InnerOptimizer

log = logging.getLogger(__name__)
REFERENCE_STAGE = -1  # checkpoints of the whole chained model


@dataclass(kw_only=True)
class LocalTrainConfig:
    steps: int = 200
    """Inner optimizer steps to run (in total, counting resumed steps)."""
    eval_every: int = 50
    eval_samples: int = 32
    """Validation windows per evaluation (a fixed, evenly spaced subset)."""
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 100
    max_seconds: float | None = None
    """Stop early after this much wall time (benchmarks)."""
    compute: Compute = CPU
    """Device and autocast, as a daemon's worker uses them (stages/device.py)."""
    wire: ActivationMode | None = None
    """Pass every stage boundary through this activation codec both ways (the activations
    forward, their gradients backward), as a swarm's wire does; None: boundaries exact."""
    wire_grad: GradRounding = "nearest"
    """How the gradients are rounded on that wire (compression.GradientSender)."""


@dataclass
class TrainResult:
    steps: int
    tokens: int
    seconds: float
    """Time spent in training steps only (not evaluation or checkpoints)."""
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    train_losses: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def chain_forward(
    stages: list[Stage],
    batch: TokenBatch,
    compute: Compute = CPU,
    wire: ActivationCodec | None = None,
    grads: list[GradientSender] | None = None,
) -> torch.Tensor:
    """Logits of the whole model on the batch's inputs, running the stages in order.

    With `wire`, what crosses each boundary (the sender's `encode_boundary` of its output)
    goes through that codec forward and its gradient through it backward (through
    `grads[i]` at boundary i, when given)."""
    context = None if batch.docs is None else AttentionContext(doc_ids=batch.docs)
    h, sender = None, None
    with compute.autocast():
        for i, stage in enumerate(stages):
            if wire is not None and sender is not None:
                grad = None if grads is None else grads[i - 1]
                c = through_wire(sender.encode_boundary(h, batch.inputs), wire, grad)
                h = stage.decode_boundary(c, batch.inputs)
            h, sender = stage(h, batch.inputs, context), stage
    return h


@torch.no_grad()
def evaluate(
    stages: list[Stage],
    windows: TokenWindows,
    sample_ids: list[int],
    micro_batch: int,
    compute: Compute = CPU,
    wire: ActivationCodec | None = None,
) -> float:
    total, count = 0.0, 0
    for i in range(0, len(sample_ids), micro_batch):
        batch = windows.batch(sample_ids[i : i + micro_batch]).to(compute.device)
        loss = lm_loss(chain_forward(stages, batch, compute, wire), batch.targets)
        total += float(loss) * len(batch)
        count += len(batch)
    return total / count


def ids_in_order(windows: TokenWindows, cursor: int, count: int) -> list[int]:
    """The `count` training windows after the first `cursor` of the reference trainer's
    order (each epoch's own shuffle, one epoch after the other)."""
    ids = []
    for position in range(cursor, cursor + count):
        epoch, offset = divmod(position, len(windows))
        ids.append(int(windows.epoch_order(epoch)[offset]))
    return ids


class LocalTrainer:
    """Owns the chained model, its optimizer and the data order."""

    def __init__(self, manifest: Manifest, config: LocalTrainConfig) -> None:
        self.manifest, self.config = manifest, config
        torch.manual_seed(manifest.run.seed)
        self.compute = config.compute
        self.wire = None if config.wire is None else ActivationCodec(mode=config.wire)
        self.grads = None
        if self.wire is not None:  # one per boundary: a feedback residual is the boundary's
            count = manifest.num_stages - 1
            self.grads = [GradientSender(self.wire, config.wire_grad) for _ in range(count)]
        self.stages = [stage.to(self.compute.device) for stage in build_stages(manifest)]
        self.model = nn.ModuleList(self.stages)
        self.optimizer = InnerOptimizer(
            self.model,
            manifest.inner,
            self.compute.optimizer_states,
            self.compute.optimizer_step,
        )
        if self.compute.optimizer_step == "in-backward":
            for p in self.optimizer.params:
                p.register_post_accumulate_grad_hook(self._step_param)
        self.train = TokenWindows(manifest, "train")
        self.val = TokenWindows(manifest, "val")
        self.val_ids = self.val.fixed_subset(config.eval_samples)
        self.cursor = 0  # samples consumed, across epochs

    def next_batch_ids(self, count: int) -> list[int]:
        ids = ids_in_order(self.train, self.cursor, count)
        self.cursor += count
        return ids

    def train_step(self) -> float:
        spec = self.manifest.inner
        ids = self.next_batch_ids(spec.local_batch)
        n_micro = spec.local_batch // spec.micro_batch
        total = 0.0
        for i in range(n_micro):
            batch = self.train.batch(ids[i * spec.micro_batch : (i + 1) * spec.micro_batch])
            batch = batch.to(self.compute.device)
            total += self.backward_micro_batch(batch, n_micro) / n_micro
        self.optimizer.step()  # in-backward: the parameters stepped during the backward
        self.optimizer.zero_grad()
        return total

    def _step_param(self, param: torch.Tensor) -> None:
        self.optimizer.step_param(param, param.grad)

    def backward_micro_batch(self, batch: TokenBatch, n_micro: int) -> float:
        """Forward and backward of one micro-batch (its gradient divided by n_micro); its loss."""
        logits = chain_forward(self.stages, batch, self.compute, self.wire, self.grads)
        loss = lm_loss(logits, batch.targets)
        (loss / n_micro).backward()
        return loss.item()

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "cursor": self.cursor,
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.cursor = int(state["cursor"])

    def save(self) -> None:
        if self.config.checkpoint_dir is not None:
            info = save_checkpoint(
                self.config.checkpoint_dir,
                run_id=self.manifest.run_id,
                stage=REFERENCE_STAGE,
                step=self.optimizer.steps,
                state=self.state_dict(),
            )
            log.info("checkpoint saved: %s", info.path)

    def resume(self) -> int:
        if self.config.checkpoint_dir is None:
            return 0
        found = load_latest_checkpoint(
            self.config.checkpoint_dir, run_id=self.manifest.run_id, stage=REFERENCE_STAGE
        )
        if found is None:
            return 0
        info, state = found
        self.load_state_dict(state)
        log.info("resumed from %s (step %d)", info.path, info.step)
        return info.step

    def evaluate(self) -> float:
        self.model.eval()
        try:
            return evaluate(
                self.stages,
                self.val,
                self.val_ids,
                self.manifest.inner.micro_batch,
                self.compute,
                self.wire,
            )
        finally:
            self.model.train()

    def run(self, report: Callable[[str], None] = print) -> TrainResult:
        cfg = self.config
        tokens_per_step = self.manifest.inner.local_batch * self.manifest.model.seq_len
        start_step = self.resume()
        result = TrainResult(steps=0, tokens=0, seconds=0.0)
        val = self.evaluate()
        result.val_losses.append((start_step, val))
        report(f"step {start_step:5d} | val_loss {val:.4f}")
        started = time.perf_counter()
        for step in range(start_step + 1, cfg.steps + 1):
            step_started = time.perf_counter()
            loss = self.train_step()
            result.seconds += time.perf_counter() - step_started
            elapsed = time.perf_counter() - started
            result.steps += 1
            result.tokens += tokens_per_step
            result.train_losses.append(loss)
            report(
                f"step {step:5d} | loss {loss:.4f} | {result.tokens_per_s:8.0f} tok/s "
                f"| lr {self.optimizer.lr_scale() * self.manifest.inner.lr:.2e} | {elapsed:6.1f}s"
            )
            out_of_time = cfg.max_seconds is not None and result.seconds >= cfg.max_seconds
            if step % cfg.eval_every == 0 or step == cfg.steps or out_of_time:
                val = self.evaluate()
                result.val_losses.append((step, val))
                report(f"step {step:5d} | val_loss {val:.4f}")
            if step % cfg.checkpoint_every == 0 or step == cfg.steps or out_of_time:
                self.save()
            if out_of_time:
                break
        return result
