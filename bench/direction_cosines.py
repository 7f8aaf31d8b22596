"""Leave-one-out cosines of honest pseudo-gradients, as the delta reducers see them.

    python bench/direction_cosines.py --manifest tiny --tokens 51200 --inner-steps 1 [--attack A]

Runs bench/byzantine.py's swarm (5 replicas, one group, the daemon's aggregation) and
records, for every span a reducer aggregates in the delta mix, each contribution's
cosine with the coordinate-wise median of the others (`loo_cosines`, the rule behind
`AggregationSpec.min_cosine`). Prints one JSON line: the honest cosines' count, min,
quantiles, and with `--attack` the attacker's (taken as the lowest cosine of each
call that has all replicas' parts; calls without it, once it is left out, are honest).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import agora_node.comms.collective.allreduce as allreduce  # noqa: E402
from agora_node.comms.collective.aggregate import loo_cosines  # noqa: E402
from agora_node.stages.manifest_files import load_manifest  # noqa: E402
from bench import byzantine  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--manifest", default="tiny")
    p.add_argument("--replicas", type=int, default=5)
    p.add_argument("--tokens", type=int, default=51_200)
    p.add_argument("--inner-steps", type=int, default=1)
    p.add_argument("--eval-samples", type=int, default=16)
    p.add_argument("--attack", default=None, choices=byzantine.ATTACKS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ban-s", type=float, default=600.0)
    # byzantine.run reads it (since f81e2ab): without it this command failed at once
    p.add_argument("--memory", action="store_true", help="memory after each round (stderr)")
    args = p.parse_args(argv)
    manifest = load_manifest(args.manifest)
    manifest = dataclasses.replace(
        manifest, outer=dataclasses.replace(manifest.outer, inner_steps=args.inner_steps)
    )
    seen: list[list[float | None]] = []
    real = allreduce.aggregate

    def recording(values, weights, spec):
        if spec.min_cosine > -1 and len(values) >= 3:  # the delta mix
            seen.append(loo_cosines(values))
        return real(values, weights, spec)

    allreduce.aggregate = recording
    result = asyncio.run(byzantine.run(manifest, args, args.attack))
    # with an attacker present, its part is the one with the lowest cosine in a call that
    # refused something; calls without it (it was left out) are all honest
    honest, attacker = [], []
    for cosines in seen:
        known = [c for c in cosines if c is not None]
        if args.attack and len(known) == args.replicas:
            lowest = min(known)
            attacker.append(lowest)
            known.remove(lowest)
        honest += known
    t = torch.tensor(honest, dtype=torch.float64)
    q = [0.0, 0.01, 0.05, 0.25, 0.5, 0.75, 1.0]
    out = {
        "calls": len(seen),
        "honest": {
            "n": len(honest),
            **{f"q{int(x * 100)}": round(float(t.quantile(x)), 4) for x in q},
        },
        "attacker": [round(c, 4) for c in attacker],
        "val_loss": round(result["val_loss"], 4),
        "flagged": result["flagged"],
        "attack": args.attack,
        "tokens": args.tokens,
        "inner_steps": args.inner_steps,
    }
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
