"""Context parallelism: bytes, time and memory per peer of a cell, and what compression costs.

    python bench/context_parallel.py --json [--manifest long] [--seq-lens 512,1024,2048]
        [--steps 100] [--eval-every 10] [--eval-samples 8] [--threads 2] [--reps 3]
        [--kv-rank R] [--kv-subspaces N] [--kv-tokens on|off] [--kv-compress all|remote]
        [--cp-degree C] [--latency-ms 20] [--only-overlap]

A cell's members run as threads of this process (`LocalCell`), so K/V frames are real
bytes (encoded, sent, checked, decoded) but cross no network.

Per sequence length (the manifest with model.seq_len replaced), on one middle stage:
- `kv_bytes_per_token_layer`: K/V frame bytes one member sends per token it holds, per
  layer, forward (dense bf16: 2 d values; compressed: r bf16 coefficients, a byte of
  choice and, with `kv_tokens`, the token's id) and backward (fp32 gradients of what was received); headers included.
- `ms_per_microbatch`: forward + backward of one micro-batch for c = 1, 2, 4, alternated
  (c1 c2 c4 c1 c2 c4 ...) `--reps` times on the same threads; medians.
- `saved_bytes`: activation bytes one member keeps for backward (torch's saved tensors,
  parameters excluded), with the manifest's estimate beside it.

Overlap (at the longest length): a cell of 2 whose frames arrive `--latency-ms` after
they were posted; member 0's time per micro-batch when it attends to its own keys while
the others' K/V sources (and, in backward, the gradients for theirs) travel, against
waiting first, alternated; `--only-overlap` measures this alone.

Quality (at the manifest's own seq_len): the model with dense K/V (exchanged in bf16)
and with the manifest's mixture of subspaces, each trained as a cell of c = cp_degree
members on the same data order for `--steps` steps, alternating a step of each; the
validation loss is computed by the cell too. `quality.tail_rel_drop_dense` says whether the dense curve
had flattened (how much it still fell over the last quarter, relative to its final loss).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from common import log_stderr, set_threads

from agora_node.node.train_local import LocalTrainConfig, LocalTrainer
from agora_node.protocol.manifest import Manifest
from agora_node.stages.context_parallel import CellContext, ChunkLayout, LocalCell
from agora_node.stages.data import TokenBatch
from agora_node.stages.kv_frames import FramedExchange
from agora_node.stages.manifest_files import check_data_available, load_manifest
from agora_node.stages.memory import stage_memory_bytes
from agora_node.stages.model import AttentionContext, Stage


def with_model(manifest: Manifest, **fields: Any) -> Manifest:
    return dataclasses.replace(manifest, model=dataclasses.replace(manifest.model, **fields))


class Cell:
    """c members sharing one set of weights: their gradients sum into the same .grad."""

    def __init__(
        self,
        size: int,
        seq_len: int,
        dense_dtype: torch.dtype,
        latency_s: float = 0.0,
        overlap: bool = True,
    ) -> None:
        self.size, self.layout = size, ChunkLayout(seq_len, size)
        self.local = LocalCell(size, latency_s=latency_s)
        self.exchanges = [FramedExchange(self.local.member(r)) for r in range(size)]
        self.dense_dtype, self.overlap = dense_dtype, overlap
        self.pool = ThreadPoolExecutor(size)

    def context(self, rank: int, docs: torch.Tensor | None = None) -> AttentionContext:
        cell = CellContext(
            self.layout, self.exchanges[rank], dense_dtype=self.dense_dtype, overlap=self.overlap
        )
        return AttentionContext(doc_ids=docs, cell=cell)

    def wait_s(self) -> float:
        """Seconds member 0 has waited for the others' frames, all exchanges so far."""
        return self.exchanges[0].inner.wait_s

    def run(self, fn) -> list:  # noqa: ANN001
        return list(self.pool.map(fn, range(self.size)))

    def bytes_sent(self) -> int:
        return sum(e.frame_bytes_sent for e in self.exchanges)


def cell_loss(
    stages: list[Stage], cell: Cell, batch: TokenBatch, train: bool, n_micro: int = 1
) -> float:
    """Mean token loss of `batch` computed by the cell; with `train`, backward as well
    (the gradient divided by n_micro, as the reference trainer's)."""
    inputs, targets = batch.inputs, batch.targets

    def member(rank: int) -> float:
        ctx = cell.context(rank, batch.docs)
        tokens = cell.layout.take(inputs, rank)
        with torch.set_grad_enabled(train):
            h = None
            for stage in stages:
                h = stage(h, tokens, ctx)
            loss = (
                torch.nn.functional.cross_entropy(
                    h.flatten(0, 1).float(),
                    cell.layout.take(targets, rank).flatten(),
                    reduction="sum",
                )
                / targets.numel()
            )
            if train:
                (loss / n_micro).backward()
        return loss.item()

    return sum(cell.run(member))


class CellTrainer(LocalTrainer):
    """The reference trainer's model, data order and optimizer, stepped by a cell."""

    def __init__(self, manifest: Manifest, config: LocalTrainConfig, cell: Cell) -> None:
        super().__init__(manifest, config)
        self.cell = cell

    def backward_micro_batch(self, batch: TokenBatch, n_micro: int) -> float:
        return cell_loss(self.stages, self.cell, batch, train=True, n_micro=n_micro)

    def evaluate(self) -> float:
        micro = self.manifest.inner.micro_batch
        losses = []
        for i in range(0, len(self.val_ids), micro):
            batch = self.val.batch(self.val_ids[i : i + micro])
            losses.append(cell_loss(self.stages, self.cell, batch, train=False) * len(batch))
        return sum(losses) / len(self.val_ids)


def saved_bytes(stage: Stage, cell: Cell | None, x: torch.Tensor, tokens: torch.Tensor) -> int:
    """Activation bytes member 0 keeps for backward (parameters and buffers excluded)."""
    owned = {t.untyped_storage().data_ptr() for t in [*stage.parameters(), *stage.buffers()]}

    def measure(rank: int) -> int:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = t.untyped_storage().data_ptr()
            if key not in owned:
                seen[key] = t.untyped_storage().nbytes()
            return t

        ctx = cell.context(rank) if cell else None
        take = (lambda t: cell.layout.take(t, rank)) if cell else (lambda t: t)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            stage(take(x), take(tokens), ctx)
        return sum(seen.values())

    return cell.run(measure)[0] if cell else measure(0)


def timed_microbatch(stage: Stage, cell: Cell | None, x: torch.Tensor, tokens: torch.Tensor):
    """Seconds for forward and backward of one micro-batch (each member its chunk)."""
    started = time.perf_counter()

    def member(rank: int) -> None:
        ctx = cell.context(rank) if cell else None
        take = (lambda t: cell.layout.take(t, rank)) if cell else (lambda t: t)
        stage(take(x).requires_grad_(), take(tokens), ctx).square().mean().backward()

    if cell:
        cell.run(member)
    else:
        member(0)
    stage.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def per_length(base: Manifest, seq_len: int, reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {"seq_len": seq_len}
    wire = {}
    for name, kv_rank, dtype in (("dense", 0, torch.bfloat16), ("compressed", None, None)):
        rank = base.model.kv_rank if kv_rank is None else kv_rank
        manifest = with_model(
            base, seq_len=seq_len, kv_rank=rank, kv_tokens=bool(rank) and base.model.kv_tokens
        )
        stage = Stage(manifest, 1)
        batch = manifest.inner.micro_batch
        x = torch.randn(batch, seq_len, manifest.model.d_model)
        tokens = torch.randint(0, manifest.model.vocab_size, (batch, seq_len))
        layers = len(manifest.stage_layers(1))
        cell = Cell(2, seq_len, dtype or torch.float32)
        forward_bytes = _forward_bytes(stage, cell, x, tokens)
        before = cell.bytes_sent()
        timed_microbatch(stage, cell, x, tokens)  # forward and backward frames
        backward_bytes = cell.bytes_sent() - before - forward_bytes
        held = batch * seq_len  # tokens held by the members together; each sends its own once
        wire[name] = {
            "forward": round(forward_bytes / held / layers, 2),
            "backward": round(backward_bytes / held / layers, 2),
        }
        if name == "compressed":
            times: dict[int, list[float]] = {1: [], 2: [], 4: []}
            cells = {c: Cell(c, seq_len, torch.float32) if c > 1 else None for c in times}
            for _ in range(reps):
                for c in times:
                    times[c].append(timed_microbatch(stage, cells[c], x, tokens))
            out["ms_per_microbatch"] = {
                f"c{c}": round(1000 * statistics.median(v), 1) for c, v in times.items()
            }
            out["saved_bytes"] = {f"c{c}": saved_bytes(stage, cells[c], x, tokens) for c in times}
            out["estimated_bytes"] = {
                f"c{c}": stage_memory_bytes(manifest, 1, cp_degree=c)["activation_bytes"]
                for c in times
            }
    dense_bf16 = 2 * base.model.d_model
    out["kv_bytes_per_token_layer"] = wire
    out["compressed_over_dense_bf16"] = round(wire["compressed"]["forward"] / dense_bf16, 4)
    return out


def _forward_bytes(stage: Stage, cell: Cell, x: torch.Tensor, tokens: torch.Tensor) -> int:
    """Frame bytes the members send for one forward alone (no backward frames)."""
    before = cell.bytes_sent()

    def member(rank: int) -> None:
        with torch.no_grad():
            stage(cell.layout.take(x, rank), cell.layout.take(tokens, rank), cell.context(rank))

    cell.run(member)
    return cell.bytes_sent() - before


def overlap(base: Manifest, seq_len: int, latency_ms: float, reps: int) -> dict[str, Any]:
    """A cell of 2 whose frames arrive `latency_ms` after they were posted (an emulated
    link): member 0's time per micro-batch (forward + backward, stage 1) and its time
    waiting on the exchange, when it attends to its own keys while the others' travel
    and when it waits first; alternated `reps` times, medians."""
    manifest = with_model(base, seq_len=seq_len)
    stage = Stage(manifest, 1)
    batch = manifest.inner.micro_batch
    x = torch.randn(batch, seq_len, manifest.model.d_model)
    tokens = torch.randint(0, manifest.model.vocab_size, (batch, seq_len))
    cells = {
        mode: Cell(2, seq_len, torch.float32, latency_ms / 1000, overlap=mode == "overlap")
        for mode in ("overlap", "wait_first")
    }
    times: dict[str, list[float]] = {mode: [] for mode in cells}
    waits: dict[str, list[float]] = {mode: [] for mode in cells}
    for cell in cells.values():  # a first micro-batch each, not timed
        timed_microbatch(stage, cell, x, tokens)
    for _ in range(reps):
        for mode, cell in cells.items():
            before = cell.wait_s()
            times[mode].append(timed_microbatch(stage, cell, x, tokens))
            waits[mode].append(cell.wait_s() - before)
    layers = len(manifest.stage_layers(1))
    ms = {mode: round(1000 * statistics.median(v), 1) for mode, v in times.items()}
    return {
        "seq_len": seq_len,
        "latency_ms": latency_ms,
        "exchanges_per_microbatch": 2 * layers,
        "ms_per_microbatch": ms,
        "wait_ms_per_microbatch": {
            mode: round(1000 * statistics.median(v), 1) for mode, v in waits.items()
        },
        "hidden_ms": round(ms["wait_first"] - ms["overlap"], 1),
        "reps": reps,
    }


def tail_rel_drop(curve: list[tuple[int, float]]) -> float:
    total, final = curve[-1]
    start = next(loss for tokens, loss in curve if tokens >= 0.75 * total)
    return (start - final) / final


def quality(base: Manifest, steps: int, eval_every: int, eval_samples: int) -> dict[str, Any]:
    c = max(2, base.model.cp_degree)
    variants = {
        "dense_cp": CellTrainer(
            with_model(base, kv_rank=0, kv_tokens=False),
            LocalTrainConfig(steps=steps, eval_samples=eval_samples),
            Cell(c, base.model.seq_len, torch.bfloat16),
        ),
        "compressed_cp": CellTrainer(
            base,
            LocalTrainConfig(steps=steps, eval_samples=eval_samples),
            Cell(c, base.model.seq_len, torch.float32),
        ),
    }
    tokens_per_step = base.inner.local_batch * base.model.seq_len
    curves = {name: [(0, t.evaluate())] for name, t in variants.items()}
    seconds = {name: 0.0 for name in variants}
    for step in range(1, steps + 1):
        for name, trainer in variants.items():  # A B A B on the same threads
            started = time.perf_counter()
            loss = trainer.train_step()
            seconds[name] += time.perf_counter() - started
            if step % eval_every == 0 or step == steps:
                curves[name].append((step * tokens_per_step, trainer.evaluate()))
                log_stderr(
                    f"{name:14s} step {step:4d} | loss {loss:.4f} | val {curves[name][-1][1]:.4f}"
                )
    out = {
        "cell": c,
        "tokens": steps * tokens_per_step,
        "val_loss": {name: round(curve[-1][1], 4) for name, curve in curves.items()},
        "val_curve": {name: [(t, round(v, 4)) for t, v in curve] for name, curve in curves.items()},
        "tail_rel_drop_dense": round(tail_rel_drop(curves["dense_cp"]), 4),
        "train_seconds": {name: round(s, 1) for name, s in seconds.items()},
    }
    dense, comp = out["val_loss"]["dense_cp"], out["val_loss"]["compressed_cp"]
    out["gap"] = round((comp - dense) / dense, 4)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--manifest", default="long", help="builtin name or TOML path (default long)")
    p.add_argument("--seq-lens", default="512,1024,2048", help="comma list for bytes/time/memory")
    p.add_argument("--steps", type=int, default=100, help="training steps per variant")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-samples", type=int, default=8)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--reps", type=int, default=3, help="timed micro-batches per c")
    p.add_argument(
        "--kv-rank", type=int, default=0, help="override the manifest's kv_rank (0: keep it)"
    )
    p.add_argument(
        "--kv-subspaces", type=int, default=0, help="override the manifest's kv_subspaces"
    )
    p.add_argument(
        "--kv-tokens",
        choices=("on", "off"),
        help="override the manifest's kv_tokens (the mixture's token table)",
    )
    p.add_argument(
        "--kv-compress",
        choices=("all", "remote"),
        help="override the manifest's kv_compress (remote: a member's own K/V stay dense)",
    )
    p.add_argument(
        "--cp-degree",
        type=int,
        default=0,
        help="cell size for the quality run (default: the manifest's cp_degree, at least 2)",
    )
    p.add_argument(
        "--latency-ms",
        type=float,
        default=20.0,
        help="emulated one-way delay of a K/V frame for the overlap measurement (default 20)",
    )
    p.add_argument(
        "--only-overlap",
        action="store_true",
        help="measure the overlap only (no bytes/time/memory per length, no training)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    set_threads(args.threads)
    base = load_manifest(args.manifest)
    if args.kv_rank:
        base = with_model(base, kv_rank=args.kv_rank)
    if args.kv_subspaces:
        base = with_model(base, kv_subspaces=args.kv_subspaces)
    if args.kv_tokens:
        base = with_model(base, kv_tokens=args.kv_tokens == "on")
    if args.kv_compress:
        base = with_model(base, kv_compress=args.kv_compress)
    if args.cp_degree:
        base = with_model(base, cp_degree=args.cp_degree)
    check_data_available(base)
    if not base.model.kv_rank:
        raise SystemExit(f"manifest {args.manifest} has kv_rank 0: nothing to compare")
    longest_len = max(int(n) for n in args.seq_lens.split(","))
    hiding = overlap(base, longest_len, args.latency_ms, args.reps)
    if args.only_overlap:
        return {"manifest": args.manifest, "threads": args.threads, "overlap": hiding}
    lengths = [per_length(base, int(n), args.reps) for n in args.seq_lens.split(",")]
    longest = max(lengths, key=lambda r: r["seq_len"])
    trained = quality(base, args.steps, args.eval_every, args.eval_samples)
    return {
        "manifest": args.manifest,
        "kv_rank": base.model.kv_rank,
        "kv_subspaces": base.model.kv_subspaces,
        "kv_tokens": base.model.kv_tokens,
        "kv_compress": base.model.kv_compress,
        "threads": args.threads,
        "kv_bytes_per_token": {
            "dense": longest["kv_bytes_per_token_layer"]["dense"]["forward"],
            "compressed": longest["kv_bytes_per_token_layer"]["compressed"]["forward"],
            "unit": "bytes a member sends per token it holds per layer, forward",
        },
        "val_loss": trained["val_loss"],
        "peak_mem_bytes": {
            "c1": longest["saved_bytes"]["c1"],
            "c2": longest["saved_bytes"]["c2"],
            "seq_len": longest["seq_len"],
            "what": "activation bytes one peer keeps for backward, one micro-batch, stage 1",
        },
        "tokens": trained["tokens"],
        "per_seq_len": lengths,
        "overlap": hiding,
        "quality": trained,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
