"""DiLoCo variants at an equal token budget, simulated in one process (no network).

    python bench/diloco.py --manifest tiny --replicas 4 [--tokens N] [--inner-steps H] [--json]

The JSON says how many steps ddp took against the manifest's warm-up (a budget inside
the warm-up compares learning-rate schedules, not methods: a warning says so) and
whether it had flattened (`ddp.tail_rel_drop`: its fall over the last quarter,
relative to its final loss). ddp's bytes are computed (a ring all-reduce of fp32
gradients per step), not measured.

Every method spends the same number of training tokens in total:

- ddp: synchronous data parallel, i.e. one model trained with R times the local batch
  (its traffic: a ring all-reduce of fp32 gradients every step);
- diloco: R replicas, H inner steps, outer step over one group of everyone, fp32;
- gossip: groups of --group-size (default 2) drawn afresh every round, with the
  factored anchor mix, fp32;
- gossip_int8 / gossip_int4: gossip with int8 / int4 pseudo-gradients (rotation,
  error feedback, zstd framing), int8 mixed results and bf16 anchors.

Replicas run the real OuterLoop over an in-process transport and board, so bytes are
what the collective would put on the wire (payload frames, per replica, sent).
val_loss is the mean over replicas of each replica's own model on a fixed validation set.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from agora_node.comms.collective import Deadlines, LocalNetwork, MatchmakingConfig, MemoryBoard  # noqa: E402
from agora_node.node.outer import OuterConfig, OuterLoop  # noqa: E402
from agora_node.node.train_local import LocalTrainConfig, LocalTrainer  # noqa: E402
from agora_node.protocol.identity import Identity  # noqa: E402
from agora_node.protocol.manifest import Manifest  # noqa: E402
from agora_node.stages.manifest_files import load_manifest  # noqa: E402

METHODS = ("ddp", "diloco", "gossip", "gossip_int8", "gossip_int4")
# In one process nothing fails and nobody is late: deadlines only need to be generous.
PATIENT = Deadlines(base=600.0)
TOGETHER = MatchmakingConfig(window=600.0, settle=0.0, poll_interval=0.01)


def trainer(manifest: Manifest, eval_samples: int, shard: int, shards: int) -> LocalTrainer:
    t = LocalTrainer(manifest, LocalTrainConfig(eval_samples=eval_samples))
    t.cursor = shard * (len(t.train) // shards)  # disjoint slices of the epoch order
    return t


def run_ddp(manifest: Manifest, args: argparse.Namespace) -> tuple[float, float, dict]:
    """One model, R times the local batch; validation loss at each quarter of the budget,
    so the JSON can say whether it had flattened."""
    r = args.replicas
    inner = dataclasses.replace(
        manifest.inner,
        local_batch=manifest.inner.local_batch * r,
        micro_batch=manifest.inner.micro_batch,
    )
    big = dataclasses.replace(manifest, inner=inner)
    t = trainer(big, args.eval_samples, 0, 1)
    steps = args.tokens // (inner.local_batch * manifest.model.seq_len)
    quarters = {round(steps * q / 4) for q in (1, 2, 3)}
    curve = []
    for step in range(1, steps + 1):
        t.train_step()
        if step in quarters:
            curve.append(t.evaluate())
    final = t.evaluate()
    params = sum(p.numel() for p in t.model.parameters())
    ring = 2 * (r - 1) / r * 4 * params  # bytes one replica sends per fp32 all-reduce
    last_quarter = curve[-1] if curve else final
    info = {
        "steps": steps,
        "val_curve_quarters": [round(v, 4) for v in [*curve, final]],
        "tail_rel_drop": round((last_quarter - final) / final, 5),
    }
    return final, steps * ring, info


def outer_config(method: str, args: argparse.Namespace) -> OuterConfig:
    codec = {"gossip_int8": "int8", "gossip_int4": "int4"}.get(method, "fp32")
    group = 0 if method == "diloco" else args.group_size
    return OuterConfig(
        group_size=group,
        codec=codec,
        deadlines=PATIENT,
        matchmaking=TOGETHER,
        mix_momentum=args.momentum_mix,
    )


async def run_outer(
    manifest: Manifest, method: str, args: argparse.Namespace
) -> tuple[float, float]:
    r, h = args.replicas, args.inner_steps
    tokens_per_step = manifest.inner.local_batch * manifest.model.seq_len
    rounds = max(1, args.tokens // (r * h * tokens_per_step))
    network, board, cfg = LocalNetwork(), MemoryBoard(), outer_config(method, args)
    trainers, loops = [], []
    for k in range(r):
        t = trainer(manifest, args.eval_samples, k, r)
        # fixed keys: every method meets the same sequence of random groups
        ident = Identity(Ed25519PrivateKey.from_private_bytes(bytes([k + 1]) * 32))
        loops.append(
            OuterLoop(
                t.model,
                ident,
                run_id="bench",
                stage=0,
                config=cfg,
                book=network.join(ident.peer_id),
                transport=network.transport(ident.peer_id),
                board=board,
            )
        )
        trainers.append(t)
    sent = 0
    for _ in range(rounds):
        for loop in loops:
            await loop.begin_round(expect=r)
        # train in a worker thread so the anchor mixes progress on the event loop meanwhile
        await asyncio.to_thread(lambda: [t.train_step() for t in trainers for _ in range(h)])
        reports = await asyncio.gather(*(lp.end_round(tokens=h * tokens_per_step) for lp in loops))
        sent += sum(rep.bytes_sent for rep in reports)
    val = sum(t.evaluate() for t in trainers) / r
    return val, sent / r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--manifest", default="tiny")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument(
        "--tokens",
        type=int,
        default=393_216,
        help="training tokens per method, all replicas (the default gives ddp 48 steps, "
        "past tiny's 20-step warm-up)",
    )
    p.add_argument(
        "--inner-steps",
        type=int,
        default=6,
        help="H (the manifest's is too long for the default budget)",
    )
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--eval-samples", type=int, default=64)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--momentum-mix", action="store_true", help="also mix outer momenta (ablation)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    manifest = load_manifest(args.manifest)
    val, sent, seconds, ddp = {}, {}, {}, None
    for method in args.methods.split(","):
        started = time.perf_counter()
        if method == "ddp":
            val[method], sent[method], ddp = run_ddp(manifest, args)
            if ddp["steps"] <= manifest.inner.warmup_steps:
                print(
                    f"warning: ddp took {ddp['steps']} steps, within the manifest's warm-up of "
                    f"{manifest.inner.warmup_steps}: its lr never reached the manifest's; raise "
                    "--tokens for a meaningful comparison",
                    file=sys.stderr,
                )
        else:
            val[method], sent[method] = asyncio.run(run_outer(manifest, method, args))
        seconds[method] = time.perf_counter() - started
        if not args.json:
            print(
                f"{method:12s} val_loss {val[method]:.4f}  bytes/replica {sent[method] / 1e6:10.2f} MB  ({seconds[method]:.0f}s)"
            )
    result = {
        "val_loss": val,
        "bytes_per_replica": {k: int(v) for k, v in sent.items()},
        "config": {
            "manifest": args.manifest,
            "replicas": args.replicas,
            "tokens": args.tokens,
            "inner_steps": args.inner_steps,
            "group_size": args.group_size,
            "warmup_steps": manifest.inner.warmup_steps,
            "inner_steps_per_replica": (
                args.tokens // (args.replicas * manifest.inner.local_batch * manifest.model.seq_len)
            ),
        },
        "ddp": ddp,
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
    }
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
