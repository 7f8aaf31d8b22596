"""DiLoCo variants at an equal token budget, simulated in one process (no network).

    python bench/diloco.py --manifest tiny --replicas 4 [--tokens N] [--inner-steps H] [--json]

The JSON says how many steps ddp took against the manifest's warm-up (a budget inside
the warm-up compares learning-rate schedules, not methods: a warning says so) and
whether it had flattened (`ddp.tail_rel_drop`: its fall over the last quarter,
relative to its final loss). ddp's bytes are measured once and multiplied by its
steps: R replicas put one fp32 all-reduce of a gradient-sized vector through the same
collective (every step's is the same size). `blocking_s` is what the outer rounds
blocked each replica's inner loop, in total (mean over replicas; in one process, so
no link time is in it).

Every method spends the same number of training tokens in total:

- ddp: synchronous data parallel, i.e. one model trained with R times the local batch
  (its traffic: an fp32 all-reduce of the gradients every step, through the same collective);
- diloco: R replicas, H inner steps, outer step over one group of everyone, fp32;
- gossip: groups of --group-size (default 2) drawn afresh every round, with the
  factored anchor mix, fp32;
- gossip_int8 / gossip_int4: gossip with int8 / int4 pseudo-gradients (rotation,
  error feedback, zstd framing), int8 mixed results and bf16 anchors;
- diloco_topk4: one group of everyone with sparse pseudo-gradients (the top 1/64 of each
  block of 256 in int4, error feedback) and sparse mixed results (the top 1/64 of the mix).
  Not in the default list (`--methods` adds it);
- gossip_topk4: gossip (groups of --group-size) with diloco_topk4's sparse pseudo-gradients
  and results; anchors mixed in bf16. Not in the default list;
- diloco_lowrank: one group of everyone, each weight matrix's pseudo-gradient as two
  rank --rank factors in two mixes (PowerSGD-style, error feedback; node/lowrank.py),
  factors in --factor-codec. Not in the default list;
- gossip_lowrank: gossip (groups of --group-size) with diloco_lowrank's factors; anchors
  in bf16 (fp32 with fp32 factors). Not in the default list;
- alone: every replica trains by itself and never mixes (groups of one, outer lr 1 and
  no momentum, so the outer step lands on its own weights): the floor a method must beat
  to show that its replicas learn from each other. Not in the default list;
- diloco_overlap: diloco whose rounds overlap inner steps (manifest `outer.overlap`): each
  round's new anchor lands --overlap-steps inner steps into the next round, with the
  progress made since the round's end added to it (what node/rounds.py does when the
  mixes take that long). Not in the default list.

With --curve-every N the JSON also has `curve` (per outer method, [tokens, val_loss]
every N rounds and at the end; an overlapped round's point is taken with its pending
anchor landed) and `tail_rel_drop` (its fall over the last quarter, as ddp's; None for a
curve of one point).

`refused` counts, per method, the parts reducers refused (norm, direction): a codec that
makes honest parts look like outliers shows here. `val_loss_of_mean` is the validation
loss of the replicas' mean weights, a diagnostic: equal to `val_loss` when the replicas
agree (diloco), below it by what their disagreement costs each replica (gossip).

Replicas run the real OuterLoop over an in-process transport and board, so bytes are
what the collective would put on the wire (payload frames, per replica, sent).
val_loss is the mean over replicas of each replica's own model on a fixed validation set.
With `--unsent weights` a replica's model is its anchor less what its parts have not sent
yet, so the replicas differ (`val_loss_of_mean` says by how much it matters), and
`val_loss_anchor` is the mean loss of their anchors, what the replicas share, attest
and hand a joiner (equal to `val_loss` otherwise, where the weights are the anchors).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402
from torch import nn  # noqa: E402

from agora_node.comms.collective import Deadlines, LocalNetwork, MatchmakingConfig, MemoryBoard  # noqa: E402
from agora_node.node.outer import OuterLoop  # noqa: E402
from agora_node.node.outer_state import OuterConfig, OuterState  # noqa: E402
from agora_node.node.train_local import LocalTrainConfig, LocalTrainer  # noqa: E402
from agora_node.protocol.identity import Identity  # noqa: E402
from agora_node.protocol.manifest import Manifest  # noqa: E402
from agora_node.stages.manifest_files import load_manifest  # noqa: E402

METHODS = ("ddp", "diloco", "gossip", "gossip_int8", "gossip_int4")
CODECS = {
    "gossip_int8": "int8",
    "gossip_int4": "int4",
    "diloco_topk4": "topk4",
    "gossip_topk4": "topk4",
}
KNOWN = (
    *METHODS,
    "diloco_topk4",
    "gossip_topk4",
    "diloco_lowrank",
    "gossip_lowrank",
    "diloco_overlap",
    "alone",
)
# In one process nothing fails and nobody is late: deadlines only need to be generous.
PATIENT = Deadlines(base=600.0)
TOGETHER = MatchmakingConfig(window=600.0, settle=0.0, poll_interval=0.01)


def trainer(manifest: Manifest, eval_samples: int, shard: int, shards: int) -> LocalTrainer:
    t = LocalTrainer(manifest, LocalTrainConfig(eval_samples=eval_samples))
    t.cursor = shard * (len(t.train) // shards)  # disjoint slices of the epoch order
    return t


def identity(k: int) -> Identity:
    """Fixed keys: every method meets the same sequence of random groups."""
    return Identity(Ed25519PrivateKey.from_private_bytes(bytes([k + 1]) * 32))


def outer_loops(models: list[nn.Module], cfg: OuterConfig, run_id: str) -> list[OuterLoop]:
    """One OuterLoop per model (replica k keeps key k), over one in-process network."""
    network, board = LocalNetwork(), MemoryBoard()
    loops = []
    for k, model in enumerate(models):
        ident = identity(k)
        book, transport = network.join(ident.peer_id), network.transport(ident.peer_id)
        loops.append(
            OuterLoop(
                model, ident, run_id=run_id, stage=0, config=cfg, book=book,
                transport=transport, board=board,
            )
        )  # fmt: skip
    return loops


async def allreduce_bytes(model: nn.Module, r: int) -> float:
    """Bytes one of `r` replicas sends in one fp32 all-reduce of `model`'s parameters through
    the collective (an outer round of plain DiLoCo moves exactly that: the delta mix)."""
    cfg = OuterConfig(group_size=0, codec="fp32", deadlines=PATIENT, matchmaking=TOGETHER)
    loops = outer_loops([copy.deepcopy(model) for _ in range(r)], cfg, "bench-ddp")
    with torch.no_grad():  # a non-zero "gradient" per replica
        for loop in loops:
            for p in loop.state.params:
                p.add_(torch.randn_like(p), alpha=1e-3)
    for loop in loops:
        await loop.begin_round(expect=r)
    reports = await asyncio.gather(*(lp.end_round(tokens=1) for lp in loops))
    if any(len(rep.delta_group) != r for rep in reports):
        raise RuntimeError("the all-reduce did not include every replica")
    return sum(rep.bytes_sent for rep in reports) / r


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
    per_step = asyncio.run(allreduce_bytes(t.model, r))
    last_quarter = curve[-1] if curve else final
    info = {
        "steps": steps,
        "val_curve_quarters": [round(v, 4) for v in [*curve, final]],
        "tail_rel_drop": round((last_quarter - final) / final, 5),
        "allreduce_bytes_per_step": int(per_step),
    }
    return final, steps * per_step, info


def outer_config(method: str, args: argparse.Namespace) -> OuterConfig:
    low_rank = method.endswith("_lowrank")
    codec = args.factor_codec if low_rank else CODECS.get(method, "fp32")
    group = 0 if method.startswith("diloco") else args.group_size
    if method == "alone":  # a group of one whose outer step lands on its own weights
        return OuterConfig(
            lr=1.0, momentum=0.0, group_size=1, deadlines=PATIENT, matchmaking=TOGETHER
        )
    return OuterConfig(
        lr=args.outer_lr,
        momentum=args.outer_momentum,
        group_size=group,
        codec=codec,
        rank=args.rank if low_rank else 0,
        result_codec=args.result_codec if codec != "fp32" and not low_rank else None,
        anchor_codec=args.anchor_codec,
        unsent=args.unsent if codec in ("int8", "int4", "topk4") and not low_rank else "feedback",
        deadlines=PATIENT,
        matchmaking=TOGETHER,
        mix_momentum=args.momentum_mix,
        consensus=args.consensus,
    )


async def run_outer(
    manifest: Manifest, method: str, args: argparse.Namespace
) -> tuple[float, float, float, int, tuple[float, float], list[list[float]]]:
    r, h = args.replicas, args.inner_steps
    tokens_per_step = manifest.inner.local_batch * manifest.model.seq_len
    rounds = max(1, args.tokens // (r * h * tokens_per_step))
    trainers = [trainer(manifest, args.eval_samples, k, r) for k in range(r)]
    run_id = "bench" if args.group_seed == 0 else f"bench-{args.group_seed}"  # groups' seed
    loops = outer_loops([t.model for t in trainers], outer_config(method, args), run_id)
    sent = blocked = 0.0
    refused = 0
    late = min(args.overlap_steps, h) if method.endswith("_overlap") else 0
    landing: list[Landing] = []
    curve: list[list[float]] = []  # [tokens so far, mean val loss] every --curve-every rounds

    def train(steps: int) -> None:
        for t in trainers:
            for _ in range(steps):
                t.train_step()

    for done in range(1, rounds + 1):
        for loop in loops:
            await loop.begin_round(expect=r)
        # train in a worker thread so the anchor mixes progress on the event loop meanwhile
        await asyncio.to_thread(train, late)
        for pending in landing:  # the previous round's anchors land `late` steps in
            started = time.perf_counter()
            pending.land()
            blocked += time.perf_counter() - started
        await asyncio.to_thread(train, h - late)
        if late:
            landing = [
                Landing(t.model, lp.state, args.eager)
                for t, lp in zip(trainers, loops, strict=True)
            ]
        ends = (
            lp.end_round(tokens=h * tokens_per_step, weights=landing[k] if late else None)
            for k, lp in enumerate(loops)
        )
        reports = await asyncio.gather(*ends)
        sent += sum(rep.bytes_sent for rep in reports)
        if not late:  # overlapped, what blocks is `land` (timed there), not end_round
            blocked += sum(rep.seconds_blocked for rep in reports)
        refused += sum(len(rep.outliers) + len(rep.direction_outliers) for rep in reports)
        if args.curve_every and done % args.curve_every == 0 and done < rounds:
            # evaluation draws no random numbers: the run trains exactly as without it
            point = landed_loss(trainers, landing)
            curve.append([done * r * h * tokens_per_step, point])
            print(f"{method}: round {done}/{rounds}, val_loss {point:.4f}", file=sys.stderr)
    for pending in landing:  # the last round's anchors, with no progress since
        started = time.perf_counter()
        pending.land()
        blocked += time.perf_counter() - started
    val = sum(t.evaluate() for t in trainers) / r
    if args.curve_every:
        curve.append([rounds * r * h * tokens_per_step, val])
    kept_apart = any(lp.config.unsent == "weights" for lp in loops)
    anchors = anchor_loss(trainers, loops) if kept_apart else val
    return val, sent / r, blocked / r, refused, (consensus_loss(trainers), anchors), curve


def landed_loss(trainers: list[LocalTrainer], landing: list[Landing]) -> float:
    """Mean validation loss of the replicas, each with its pending anchor landed (overlap:
    the weights it would have, not its eager step); their weights are put back after."""
    total = 0.0
    for k, t in enumerate(trainers):
        kept = landing[k].flat() if landing else None
        if landing:
            landing[k].land()
        total += t.evaluate()
        if kept is not None:
            landing[k].load(kept)
    return total / len(trainers)


def tail_drops(curves: dict[str, list[list[float]]]) -> dict[str, float | None]:
    """Per method, the fall of validation loss over the last quarter of its curve, relative
    to its final loss (ddp's `tail_rel_drop`), from the earlier point nearest three
    quarters of the tokens; None for a curve of one point."""
    drops: dict[str, float | None] = {}
    for method, curve in curves.items():
        final_tokens, final = curve[-1]
        earlier = curve[:-1]
        if not earlier:
            drops[method] = None
            continue
        _, at = min(earlier, key=lambda point: abs(point[0] - 0.75 * final_tokens))
        drops[method] = round((at - final) / final, 5)
    return drops


@torch.no_grad()
def loss_at(trainer: LocalTrainer, flat: torch.Tensor) -> float:
    """Validation loss of `trainer`'s model holding the weights `flat`; its own are put back."""
    params = list(trainer.model.parameters())
    kept = [p.detach().clone() for p in params]
    offset = 0
    for p in params:
        p.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    try:
        return trainer.evaluate()
    finally:
        for p, k in zip(params, kept, strict=True):
            p.copy_(k)


def consensus_loss(trainers: list[LocalTrainer]) -> float:
    """Validation loss of the replicas' mean weights (a diagnostic: below `val_loss` by
    what the replicas' disagreement costs each of them; equal when they agree)."""
    flats = [torch.cat([p.detach().reshape(-1) for p in t.model.parameters()]) for t in trainers]
    return loss_at(trainers[0], torch.stack(flats).mean(0))


def anchor_loss(trainers: list[LocalTrainer], loops: list[OuterLoop]) -> float:
    """Mean validation loss of the replicas' anchors: what they share, attest and hand a
    joiner. The replicas' weights are their anchors except with `--unsent weights`."""
    return sum(loss_at(t, lp.state.anchor) for t, lp in zip(trainers, loops, strict=True)) / len(
        trainers
    )


class Landing:
    """outer.Weights of an overlapped round in one process: `read` is the weights at the
    round's end, `write` keeps the new anchor until `land` sets it plus the progress made
    since (overlap.OverlappedWeights in the daemon)."""

    def __init__(self, model: nn.Module, state: OuterState, eager: bool) -> None:
        self.model = model
        self.at_end = self.start = self.flat()
        self.new: torch.Tensor | None = None
        if eager:  # go on from the outer step the own pseudo-gradient would make
            self.start = state.preview_from(self.at_end)
            self.load(self.start)

    def flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).float() for p in self.model.parameters()])

    async def read(self) -> torch.Tensor:
        return self.at_end

    async def write(self, flat: torch.Tensor) -> None:
        self.new = flat

    def land(self) -> None:
        self.load(self.new + (self.flat() - self.start))

    @torch.no_grad()
    def load(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.model.parameters():
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


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
    p.add_argument(
        "--group-seed",
        type=int,
        default=0,
        help="another sequence of random groups (gossip); 0: the one every earlier run met",
    )
    p.add_argument(
        "--overlap-steps",
        type=int,
        default=1,
        help="diloco_overlap: inner steps into the next round at which a round's anchor lands",
    )
    p.add_argument(
        "--eager",
        action="store_true",
        help="diloco_overlap: inner steps go on from the outer step of the replica's own "
        "pseudo-gradient, corrected when the mixed one lands",
    )
    p.add_argument("--eval-samples", type=int, default=64)
    p.add_argument(
        "--curve-every",
        type=int,
        default=0,
        help="outer methods: validation loss every this many rounds too (stderr, and JSON "
        "`curve` and `tail_rel_drop`, the fall over the last quarter of the rounds relative "
        "to the final loss); 0: only at the end",
    )
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--momentum-mix", action="store_true", help="also mix outer momenta (ablation)")
    p.add_argument(
        "--consensus",
        type=float,
        default=None,
        help="gossip: pull toward the anchor group's mean through the momentum, by this "
        "fraction (NoLoCo-style; default: adopt the mean)",
    )
    p.add_argument("--outer-lr", type=float, default=0.7, help="outer Nesterov lr (default 0.7)")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="outer momentum (0.9)")
    p.add_argument(
        "--result-codec",
        default=None,
        help="mixed results of the compressed methods (default: the codec's own default)",
    )
    p.add_argument(
        "--anchor-codec",
        default=None,
        choices=("fp32", "bf16", "int8", "int4"),
        help="anchors of the anchor mixes (gossip) on the wire (default: fp32 with fp32 "
        "deltas, else bf16)",
    )
    p.add_argument(
        "--unsent",
        default="feedback",
        choices=("feedback", "weights"),
        help="methods with error feedback (int8, int4, topk4): what a part leaves out goes "
        "into the next part (feedback) or stays in the replica's weights (manifest "
        "outer.unsent)",
    )
    p.add_argument("--rank", type=int, default=4, help="*_lowrank: the factors' rank (4)")
    p.add_argument(
        "--factor-codec",
        default="bf16",
        choices=("fp32", "bf16", "int8", "int4"),
        help="*_lowrank: how the factors travel (bf16)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.curve_every < 0:
        p.error("--curve-every must be 0 (off) or a number of rounds")
    unknown = set(args.methods.split(",")) - set(KNOWN)
    if unknown:
        p.error(f"unknown methods {sorted(unknown)}; known: {', '.join(KNOWN)}")
    manifest = load_manifest(args.manifest)
    val, sent, seconds, blocking, refused, of_mean, ddp = {}, {}, {}, {}, {}, {}, None
    of_anchor: dict[str, float] = {}
    curves: dict[str, list[list[float]]] = {}
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
            outcome = asyncio.run(run_outer(manifest, method, args))
            val[method], sent[method], blocking[method], refused[method] = outcome[:4]
            of_mean[method], of_anchor[method] = outcome[4]
            if args.curve_every:
                curves[method] = outcome[5]
        seconds[method] = time.perf_counter() - started
        if not args.json:
            print(
                f"{method:12s} val_loss {val[method]:.4f}  bytes/replica {sent[method] / 1e6:10.2f} MB  ({seconds[method]:.0f}s)"
            )
    result = {
        "val_loss": val,
        "bytes_per_replica": {k: int(v) for k, v in sent.items()},
        "blocking_s": {k: round(v, 2) for k, v in blocking.items()},
        "refused": refused,
        "val_loss_of_mean": of_mean,
        "val_loss_anchor": of_anchor,
        "config": {
            "manifest": args.manifest,
            "replicas": args.replicas,
            "tokens": args.tokens,
            "inner_steps": args.inner_steps,
            "group_size": args.group_size,
            "group_seed": args.group_seed,
            "overlap_steps": args.overlap_steps,
            "eager": args.eager,
            "outer_lr": args.outer_lr,
            "outer_momentum": args.outer_momentum,
            "result_codec": args.result_codec,
            "anchor_codec": args.anchor_codec,
            "rank": args.rank,
            "factor_codec": args.factor_codec,
            "consensus": args.consensus,
            "unsent": args.unsent,
            "warmup_steps": manifest.inner.warmup_steps,
            "inner_steps_per_replica": (
                args.tokens // (args.replicas * manifest.inner.local_batch * manifest.model.seq_len)
            ),
        },
        "ddp": ddp,
        **(
            {
                "curve": {m: [[t, round(v, 4)] for t, v in c] for m, c in curves.items()},
                "tail_rel_drop": tail_drops(curves),
            }
            if args.curve_every
            else {}
        ),
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
    }
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
