"""What the subspace costs in quality and saves on the wire: dense versus k-dim boundaries.

    python bench/subspace_quality.py --manifest bench --json \
        [--tokens N] [--eval-every STEPS] [--variants dense,8,16:int8,32:int4,32:int4:stochastic] [--threads 1]

Each variant is the manifest with model.subspace_rank replaced (0 = dense), trained by
LocalTrainer on the same data order for the same token budget (rounded up to whole steps).
A variant `k:mode` trains with the wire in the loop: every boundary goes through the
activation codec `mode` forward and its gradient through it backward, as in a swarm (also
when validating); a plain `k` keeps the boundaries exact. `k:mode:rounding` also says how
the int modes round the gradients (`nearest`, the default; `stochastic`; `feedback`:
compression.GradientSender). `wire_bytes_per_token` is then
what that mode carries per token and boundary, forward (with the token id) plus backward,
and `x_fewer_than_dense_bf16` the dense bf16 figure over it.
Reported per variant: the validation-loss curve [(tokens, loss)], the final loss and its ratio
to dense, and the bytes per token one stage boundary carries each way, measured by encoding
the trained model's real boundary activation (forward) and the gradient sent back upstream
(backward) of one validation micro-batch with ActivationCodec. Forward also carries the token
ids (the receiver needs them to rebuild x = T[tok] + c U^T, the last stage for its targets);
backward does not. `tail_rel_drop` is how much the validation loss still fell over the last
quarter of the budget, relative to the final loss: near 0 means the curve has flattened.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch
from common import drive, log_stderr, peak_rss_mb, set_threads

from agora_node.compression import ActivationCodec
from agora_node.compression.activations import GRAD_ROUNDINGS
from agora_node.node.train_local import LocalTrainConfig, LocalTrainer
from agora_node.protocol.manifest import Manifest, ManifestError
from agora_node.stages.manifest_files import check_data_available, load_manifest
from agora_node.stages.model import lm_loss

WIRE_MODES = ("bf16", "int8", "int4")
INT_MODES = ("int8", "int4")
DEFAULT_VARIANTS = "dense,8,16,32,64"
DEFAULT_TOKENS = 98_304
WITHIN = 0.02  # "as good as dense": final validation loss at most 2% above dense


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--manifest", default="bench", help="builtin name or TOML path (default bench)")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="training tokens per variant")
    p.add_argument(
        "--eval-every", type=int, default=0, help="validate every N steps (default: 8 points)"
    )
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma list of 'dense' and k")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="variants trained at once, each in a process of its own with --threads threads",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p.parse_args(argv)


@dataclasses.dataclass(frozen=True)
class Variant:
    rank: int
    """0: dense."""
    wire: str | None = None
    """The activation codec in the loop; None: exact boundaries."""
    grad: str = "nearest"
    """How that codec rounds the gradients (compression.GradientSender)."""

    @property
    def name(self) -> str:
        base = "dense" if self.rank == 0 else str(self.rank)
        if self.wire is None:
            return base
        return f"{base}:{self.wire}" + ("" if self.grad == "nearest" else f":{self.grad}")


def parse_variants(text: str, d_model: int) -> list[Variant]:
    """'dense,8,16:int8,16:int4:stochastic' -> dense, k=8 exact, k=16 through int8 on the
    wire, k=16 through int4 with its gradients rounded at random."""
    variants = []
    for item in text.split(","):
        item = item.strip()
        base, _, rest = item.partition(":")
        wire, _, grad = rest.partition(":")
        rank = 0 if base == "dense" else int(base) if base.isdigit() else -1
        ok_grad = not grad or (grad in GRAD_ROUNDINGS and (grad == "nearest" or wire in INT_MODES))
        if not 0 <= rank <= d_model or (wire and wire not in WIRE_MODES) or not ok_grad:
            raise ManifestError(
                f"--variants item {item!r} is invalid: 'dense' or k in 1..{d_model}, "
                f"optionally ':' and one of {', '.join(WIRE_MODES)}, then optionally ':' "
                f"and how gradients round ({', '.join(GRAD_ROUNDINGS)}; int modes only)"
            )
        variants.append(Variant(rank, wire or None, grad or "nearest"))
    return variants


def with_rank(manifest: Manifest, rank: int) -> Manifest:
    model = dataclasses.replace(manifest.model, subspace_rank=rank)
    return dataclasses.replace(manifest, model=model)


def token_id_bytes(vocab_size: int) -> int:
    """Smallest unsigned integer that holds a token id (the package has no token-id frame yet)."""
    return 1 if vocab_size <= 1 << 8 else 2 if vocab_size <= 1 << 16 else 4


def boundary_tensors(trainer: LocalTrainer) -> tuple[torch.Tensor, torch.Tensor]:
    """What crosses the first boundary for one validation micro-batch: (forward, backward).

    Forward is stage 0's encoded output (k coefficients, or x when dense); backward is the
    gradient of the loss with respect to it, i.e. (dL/dx) U with the subspace.
    """
    stages = trainer.stages
    batch = trainer.val.batch(trainer.val_ids[: trainer.manifest.inner.micro_batch])
    inputs, targets = batch.inputs, batch.targets
    with torch.no_grad():
        c = stages[0].encode_boundary(stages[0](None, inputs), inputs)
    c = c.detach().requires_grad_(True)
    h = stages[1].decode_boundary(c, inputs)
    for stage in stages[1:]:
        h = stage(h, inputs)
    lm_loss(h, targets).backward()
    trainer.optimizer.zero_grad()
    return c.detach(), c.grad.detach()


def wire_bytes(x: torch.Tensor, mode: str) -> tuple[float, float]:
    """(bytes per token, relative L2 error) of x [B, T, width] through ActivationCodec."""
    codec = ActivationCodec(mode=mode)
    frame = codec.encode(x.float().contiguous())
    y = codec.decode(frame, tuple(x.shape))
    rel = float((y - x).norm() / x.norm().clamp_min(1e-30))
    return len(frame) / (x.shape[0] * x.shape[1]), rel


def tail_rel_drop(curve: list[tuple[int, float]]) -> float:
    """(loss at the first point past 75% of the budget - final loss) / final loss."""
    total, final = curve[-1]
    start = next(loss for tokens, loss in curve if tokens >= 0.75 * total)
    return (start - final) / final


def run_variant(base: Manifest, variant: Variant, steps: int, eval_every: int) -> dict[str, Any]:
    rank = variant.rank
    manifest = with_rank(base, rank)
    trainer = LocalTrainer(
        manifest, LocalTrainConfig(steps=steps, wire=variant.wire, wire_grad=variant.grad)
    )
    result = drive(
        trainer,
        max_steps=steps,
        eval_every=eval_every,
        report=lambda line: log_stderr(f"[{variant.name}] {line}"),
    )
    forward, backward = boundary_tensors(trainer)
    ids = token_id_bytes(manifest.model.vocab_size)
    wire = {}
    for mode in WIRE_MODES:
        fwd, fwd_err = wire_bytes(forward, mode)
        bwd, bwd_err = wire_bytes(backward, mode)
        wire[mode] = {
            "fwd": round(fwd + ids, 2),
            "bwd": round(bwd, 2),
            "rel_err_fwd": float(f"{fwd_err:.3g}"),
            "rel_err_bwd": float(f"{bwd_err:.3g}"),
        }
    dense_bf16 = 2 * 2 * manifest.model.d_model + ids  # both ways, the token id forward
    in_loop = None
    if variant.wire is not None:
        in_loop = wire[variant.wire]["fwd"] + wire[variant.wire]["bwd"]
    return {
        "variant": variant.name,
        "k": rank,
        "wire": variant.wire,
        "grad_rounding": variant.grad,
        "wire_bytes_per_token": in_loop,
        "x_fewer_than_dense_bf16": None if in_loop is None else round(dense_bf16 / in_loop, 1),
        "boundary_width": forward.shape[-1],
        "val_loss": round(result.val_curve[-1][1], 4),
        "val_curve": [(tokens, round(loss, 4)) for tokens, loss in result.val_curve],
        "tail_rel_drop": round(tail_rel_drop(result.val_curve), 4),
        "train_seconds": round(result.train_seconds, 1),
        "tokens_per_s": round(result.tokens_per_s, 1),
        "bytes_per_token": wire,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    set_threads(args.threads)
    base = load_manifest(args.manifest)
    check_data_available(base)
    variants = parse_variants(args.variants, base.model.d_model)
    tokens_per_step = base.inner.local_batch * base.model.seq_len
    steps = math.ceil(args.tokens / tokens_per_step)
    eval_every = args.eval_every or max(1, steps // 8)
    if args.jobs == 1:
        rows = [run_variant(base, v, steps, eval_every) for v in variants]
    else:
        spawn = multiprocessing.get_context("spawn")  # no torch state forked into workers
        with ProcessPoolExecutor(
            args.jobs, mp_context=spawn, initializer=set_threads, initargs=(args.threads,)
        ) as pool:
            n = len(variants)
            rows = list(pool.map(run_variant, [base] * n, variants, [steps] * n, [eval_every] * n))
    dense = next((r for r in rows if r["k"] == 0 and r["wire"] is None), None)
    within = fewest = None
    if dense is not None:
        for row in rows:
            row["rel_to_dense"] = round(row["val_loss"] / dense["val_loss"] - 1, 4)
        ok = [r for r in rows if r["k"] and r["val_loss"] <= (1 + WITHIN) * dense["val_loss"]]
        within = min((r["k"] for r in ok if r["wire"] is None), default=None)
        in_loop = [r for r in ok if r["wire"] is not None]
        fewest = min(in_loop, key=lambda r: r["wire_bytes_per_token"], default=None)
    return {
        "manifest": base.run.name,
        "run_id": base.run_id,
        "d_model": base.model.d_model,
        "threads": args.threads,
        "tokens_per_step": tokens_per_step,
        "steps": steps,
        "tokens": steps * tokens_per_step,
        "eval_every_steps": eval_every,
        "token_id_bytes": token_id_bytes(base.model.vocab_size),
        "variants": rows,
        "dense_tail_rel_drop": dense["tail_rel_drop"] if dense else None,
        "smallest_k_within_2pct": within,
        "fewest_wire_bytes_within_2pct": fewest and fewest["variant"],
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }


def print_table(out: dict[str, Any]) -> None:
    print(
        f"{out['manifest']} (d={out['d_model']}), {out['tokens']} tokens per variant "
        f"({out['steps']} steps), {out['threads']} thread(s); bytes/token fwd (+{out['token_id_bytes']}"
        " B token id) / bwd"
    )
    print(f"{'variant':>8} {'val_loss':>9} {'vs dense':>9} {'tail drop':>9}  ", end="")
    print("  ".join(f"{m + ' fwd/bwd':>15}" for m in WIRE_MODES))
    for r in out["variants"]:
        rel = r.get("rel_to_dense")
        rel_s = f"{100 * rel:+8.2f}%" if rel is not None else f"{'-':>9}"
        wire = "  ".join(
            f"{r['bytes_per_token'][m]['fwd']:>7.1f}/{r['bytes_per_token'][m]['bwd']:<7.1f}"
            for m in WIRE_MODES
        )
        print(
            f"{r['variant']:>8} {r['val_loss']:9.4f} {rel_s} {100 * r['tail_rel_drop']:8.2f}%  {wire}"
        )
    for r in out["variants"]:
        curve = ", ".join(f"({t}, {loss:.3f})" for t, loss in r["val_curve"])
        print(f"curve {r['variant']}: {curve}")
    for r in out["variants"]:
        if r["wire"] is not None:
            print(
                f"wire in the loop, {r['variant']}: {r['wire_bytes_per_token']} B per token and "
                f"boundary both ways, {r['x_fewer_than_dense_bf16']}x fewer than dense bf16"
            )
    print(f"smallest k within 2% of dense: {out['smallest_k_within_2pct']}")
    print(f"fewest wire bytes within 2% of dense: {out['fewest_wire_bytes_within_2pct']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tokens <= 0 or args.threads <= 0 or args.jobs <= 0 or args.eval_every < 0:
        print("subspace_quality: --tokens/--threads/--jobs must be positive", file=sys.stderr)
        return 2
    try:
        out = run(args)
    except ManifestError as exc:
        print(f"subspace_quality: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out))
    else:
        print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
