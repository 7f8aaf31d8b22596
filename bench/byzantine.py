"""One stage with 5 replicas, one of them Byzantine, simulated in one process (no network).

    python bench/byzantine.py --manifest tiny [--replicas 5] [--tokens N] [--attacks a,b] [--json]

Every run spends the same training tokens. The Byzantine replica trains like the
others but sends, in every outer round, a manipulated pseudo-gradient, and claims
1000x the tokens it processed (reducers cap the weight):

- scaled: 1000 x its delta;       - sign_flip: -1 x its delta;
- random: Gaussian noise with its delta's norm;
- stale: its first round's delta, replayed every round;
- free_ride: it trains like the others but sends, from its second round on, the
  previous round's mixed delta (what every member holds): the stage's own consensus.

Replicas run the real OuterLoop over an in-process transport and board, configured
as the daemon does (`OuterConfig.from_manifest`: the manifest's aggregation,
CenteredClip by default, norm screening, verified results), one group of everyone.
`undefended` repeats the attack with what main did (plain mean, no norm screen,
no result check). Printed per attack: val_loss (mean over the honest replicas of
their own model; `honest` is the all-honest run), whether an honest replica's
suspects ledger (node/suspects.py) banned the attacker (it refused its contribution
for its norm, or its span's result failed the witness check) and after how many
seconds, by how many honest replicas (`flagged_by`), in how many of the rounds after
that first ban the honest replicas' groups left it out (`excluded_rounds` of
`rounds_after_flag`: a strict majority of round entries must name it) or at least one
reducer dropped its parts (`ignored_rounds`), and whether the honest replicas' anchors
are equal at the end. `--json` prints one line: a list of those objects.
`--memory` prints, to stderr after each round, the process's resident memory and the
bytes its live tensors hold (the five replicas share the process).

Lying about round numbers and join times is covered by tests (tests/outer/test_groups.py,
tests/node/test_rounds.py), not here.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from agora_node.comms.collective import (  # noqa: E402
    AggregationSpec,
    Deadlines,
    LocalNetwork,
    MatchmakingConfig,
    MemoryBoard,
)
from agora_node.node.outer import OuterLoop, part_signing  # noqa: E402
from agora_node.node.outer_state import ModuleWeights, OuterConfig, OuterState  # noqa: E402
from agora_node.node.suspects import Suspects  # noqa: E402
from agora_node.node.train_local import LocalTrainConfig, LocalTrainer  # noqa: E402
from agora_node.protocol.identity import Identity  # noqa: E402
from agora_node.protocol.identity import verify as verify_signature  # noqa: E402
from agora_node.protocol.manifest import Manifest  # noqa: E402
from agora_node.stages.manifest_files import load_manifest  # noqa: E402

ATTACKS = ("scaled", "sign_flip", "random", "stale", "free_ride")
PATIENT = Deadlines(base=600.0)
TOGETHER = MatchmakingConfig(window=600.0, settle=0.0, poll_interval=0.01)


class ByzantineWeights(ModuleWeights):
    """The weights end_round reads, such that anchor - weights is the attacker's delta."""

    def __init__(self, state: OuterState, attack: str, seed: int) -> None:
        super().__init__(state)
        self.attack, self.first = attack, None
        self.generator = torch.Generator().manual_seed(seed)
        self.momentum: torch.Tensor | None = None
        self.mixed: torch.Tensor | None = None
        """The previous round's mixed delta, recovered from the outer momentum (with one
        group of everyone the anchor mix is skipped, so m' = mu m + mixed)."""

    def forged(self, delta: torch.Tensor) -> torch.Tensor:
        if self.first is None:
            self.first = delta.clone()
        if self.attack == "scaled":
            return 1000 * delta
        if self.attack == "sign_flip":
            return -delta
        if self.attack == "random":
            noise = torch.randn(delta.numel(), generator=self.generator)
            return noise * (delta.norm() / noise.norm().clamp_min(1e-30))
        if self.attack == "stale":
            return self.first
        if self.attack == "free_ride":
            return delta if self.mixed is None else self.mixed
        raise ValueError(self.attack)

    async def read(self) -> torch.Tensor:
        m = self.state.momentum
        if self.momentum is not None:
            self.mixed = m - self.state.mu * self.momentum
        self.momentum = m.clone()
        real = await super().read()
        return self.state.anchor - self.forged(self.state.anchor - real)


def trainer(manifest: Manifest, eval_samples: int, shard: int, shards: int) -> LocalTrainer:
    t = LocalTrainer(manifest, LocalTrainConfig(eval_samples=eval_samples))
    t.cursor = shard * (len(t.train) // shards)  # disjoint slices of the epoch order
    return t


def config(manifest: Manifest, defended: bool) -> OuterConfig:
    overrides = {}
    if not defended:  # main's daemon: plain mean, nothing refused, results unchecked
        overrides = {
            "aggregation": AggregationSpec(max_norm_ratio=float("inf")),
            "verify_results": False,
        }
    return OuterConfig.from_manifest(
        manifest,
        group_size=0,
        codec="fp32",
        deadlines=PATIENT,
        matchmaking=TOGETHER,
        **overrides,
    )


async def run(
    manifest: Manifest, args: argparse.Namespace, attack: str | None, defended: bool = True
) -> dict:
    r, h = args.replicas, args.inner_steps
    tokens_per_step = manifest.inner.local_batch * manifest.model.seq_len
    rounds = max(1, args.tokens // (r * h * tokens_per_step))
    board, cfg = MemoryBoard(), config(manifest, defended)
    network = LocalNetwork(verify=verify_signature if cfg.verify_results else None)
    trainers, loops = [], []
    for k in range(r):
        t = trainer(manifest, args.eval_samples, k, r)
        ident = Identity(Ed25519PrivateKey.from_private_bytes(bytes([k + 1]) * 32))
        loop = OuterLoop(
            t.model,
            ident,
            run_id="byzantine",
            stage=0,
            config=cfg,
            book=network.join(ident.peer_id, part_signing(ident, cfg)),
            transport=network.transport(ident.peer_id),
            board=board,
            suspects=Suspects(me=ident.peer_id, ban_s=args.ban_s),
        )
        trainers.append(t)
        loops.append(loop)
    bad = r - 1 if attack else None
    weights = [ModuleWeights(lp.state) for lp in loops]
    if bad is not None:
        weights[bad] = ByzantineWeights(loops[bad].state, attack, seed=args.seed)
    honest = [k for k in range(r) if k != bad]
    started, flagged_after = time.perf_counter(), None
    after = {"rounds": 0, "excluded": 0, "ignored": 0}
    for _ in range(rounds):
        for loop in loops:
            await loop.begin_round(expect=r)
        await asyncio.to_thread(lambda: [t.train_step() for t in trainers for _ in range(h)])
        claims = [h * tokens_per_step * (1000 if k == bad else 1) for k in range(r)]
        reports = await asyncio.gather(
            *(
                lp.end_round(tokens=c, weights=w)
                for lp, c, w in zip(loops, claims, weights, strict=True)
            )
        )
        if args.memory:
            print(f"round {loops[0].totals['rounds']}: {_memory()}", file=sys.stderr, flush=True)
        if bad is None:
            continue
        suspect = loops[bad].me
        if flagged_after is not None:  # a round that began after the first ban
            after["rounds"] += 1
            after["excluded"] += all(suspect in reports[k].excluded for k in honest)
            after["ignored"] += any(suspect in reports[k].ignored for k in honest)
        elif any(loops[k].suspects.is_banned(suspect) for k in honest):
            flagged_after = time.perf_counter() - started
    digests = {loops[k].state.digest() for k in honest}
    flagged_by = (
        0 if bad is None else sum(loops[k].suspects.is_banned(loops[bad].me) for k in honest)
    )
    return {
        "val_loss": sum(trainers[k].evaluate() for k in honest) / len(honest),
        "flagged": flagged_after is not None,
        "flagged_after_s": None if flagged_after is None else round(flagged_after, 1),
        "flagged_by": flagged_by,
        "rounds_after_flag": after["rounds"],
        "excluded_rounds": after["excluded"],
        "ignored_rounds": after["ignored"],
        "anchors_equal": len(digests) == 1,
        "rounds": rounds,
    }


def _memory() -> str:
    """Resident memory of this process, and what its live tensors hold (MB)."""
    gc.collect()
    storages = {id(t.untyped_storage()): t.untyped_storage() for t in _tensors()}
    live = sum(s.nbytes() for s in storages.values())
    rss = Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]
    return f"resident {int(rss) // 1024} MB, live tensors {live // 2**20} MB"


def _tensors() -> list[torch.Tensor]:
    with warnings.catch_warnings():  # torch's deprecated aliases warn on isinstance
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--manifest", default="tiny")
    p.add_argument("--replicas", type=int, default=5)
    p.add_argument("--tokens", type=int, default=122_880, help="training tokens, all replicas")
    p.add_argument("--inner-steps", type=int, default=3)
    p.add_argument("--eval-samples", type=int, default=64)
    p.add_argument("--attacks", default=",".join(ATTACKS))
    p.add_argument("--no-undefended", action="store_true", help="skip main's behaviour")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ban-s", type=float, default=600.0, help="ban period of the suspects ledger")
    p.add_argument("--json", action="store_true")
    p.add_argument("--memory", action="store_true", help="memory after each round (stderr)")
    args = p.parse_args(argv)
    manifest = load_manifest(args.manifest)
    # H as run here, so that the reducers' weight cap is what H inner steps can process
    manifest = dataclasses.replace(
        manifest, outer=dataclasses.replace(manifest.outer, inner_steps=args.inner_steps)
    )
    honest = asyncio.run(run(manifest, args, None))
    if not args.json:
        print(json.dumps({"honest_val_loss": round(honest["val_loss"], 4)}), flush=True)
    out = []
    for attack in args.attacks.split(","):
        attacked = asyncio.run(run(manifest, args, attack))
        val = {"honest": round(honest["val_loss"], 4), "attacked": round(attacked["val_loss"], 4)}
        if not args.no_undefended:
            plain = asyncio.run(run(manifest, args, attack, defended=False))
            val["undefended"] = round(plain["val_loss"], 4)
        row = {
            "val_loss": val,
            "flagged": attacked["flagged"],
            "flagged_after_s": attacked["flagged_after_s"],
            "flagged_by": attacked["flagged_by"],
            "rounds_after_flag": attacked["rounds_after_flag"],
            "excluded_rounds": attacked["excluded_rounds"],
            "ignored_rounds": attacked["ignored_rounds"],
            "anchors_equal": attacked["anchors_equal"],
            "attack": attack,
            "rounds": attacked["rounds"],
        }
        out.append(row)
        if not args.json:
            print(json.dumps(row), flush=True)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
