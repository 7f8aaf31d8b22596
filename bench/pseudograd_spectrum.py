"""How much of a pseudo-gradient the sparse codec's top-k holds, against a low-rank view.

    OMP_NUM_THREADS=1 python bench/pseudograd_spectrum.py --manifest tiny --json

Trains the reference trainer (all stages in one process) and takes the pseudo-gradient
of H inner steps (the weights' change) at a few points of training. For each, the share
of its squared norm held by: the top 4 of each block of 256 values (what `topk4` keeps,
over every parameter), and the best rank-r approximation of each weight matrix
(r = 1..16, over the matrices, which hold nearly all of it). A rank-r factor pair of an
m x n matrix is r(m + n) values: for 512 x 512, rank 4 is 1/64 of the values, as many as
top-4 of 256 keeps, without positions. Also the share of the largest 1/64 and 1/32 of the
values chosen over the whole stage instead of per block (what a stage-wide top-k would
keep, before its longer positions).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from agora_node.node.train_local import LocalTrainConfig, LocalTrainer  # noqa: E402
from agora_node.stages.manifest_files import load_manifest  # noqa: E402

RANKS = (1, 2, 4, 8, 16)


def shares(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict:
    total = matrices = topk = 0.0
    by_rank = dict.fromkeys(RANKS, 0.0)
    flats = []
    for name, old in before.items():
        delta = (after[name] - old).float()
        energy = float(delta.pow(2).sum())
        total += energy
        flat = delta.flatten()
        flats.append(flat)
        blocks = torch.cat([flat, flat.new_zeros((-flat.numel()) % 256)]).view(-1, 256)
        topk += float(blocks.abs().topk(4, dim=1).values.pow(2).sum())
        if delta.dim() == 2 and min(delta.shape) >= 2 * max(RANKS):
            matrices += energy
            singular = torch.linalg.svdvals(delta).pow(2)
            for r in RANKS:
                by_rank[r] += float(singular[:r].sum())
    squares = torch.cat(flats).pow(2)
    wide = {
        f"stage_top_1_{d}": float(squares.topk(squares.numel() // d).values.sum()) / total
        for d in (64, 32)
    }
    return {
        "matrix_share": round(matrices / total, 4),
        "top4_of_256": round(topk / total, 4),
        **{k: round(v, 4) for k, v in wide.items()},
        **{f"rank{r}": round(v / matrices, 4) for r, v in by_rank.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--manifest", default="tiny")
    parser.add_argument("--inner-steps", type=int, default=6, help="H")
    parser.add_argument("--at", default="0,24,60", help="first inner step of each window")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    trainer = LocalTrainer(load_manifest(args.manifest), LocalTrainConfig())

    def weights() -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    rows = []
    for start in (int(x) for x in args.at.split(",")):
        while trainer.optimizer.steps < start:
            trainer.train_step()
        before = weights()
        while trainer.optimizer.steps < start + args.inner_steps:
            trainer.train_step()
        row = {"steps": [start, start + args.inner_steps], **shares(before, weights())}
        rows.append(row)
        if not args.json:
            print(row, flush=True)
    if args.json:
        print(json.dumps({"manifest": args.manifest, "windows": rows}))


if __name__ == "__main__":
    main()
