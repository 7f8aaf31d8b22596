"""The single-process reference: tokens/s and memory of LocalTrainer, the swarm's denominator.

    python bench/reference.py --manifest tiny --seconds 60 --json [--threads 2]

Trains every stage chained in one process for `--seconds` of training-step time (validation
at the start and end is not counted) and prints tokens/s over the steps alone (and the CPU
seconds they took), peak RSS, and validation loss before and after. Progress lines go to stderr; with --json stdout holds
only the JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from common import drive, peak_rss_mb, set_threads

from agora_node.node.train_local import LocalTrainConfig, LocalTrainer
from agora_node.protocol.manifest import ManifestError
from agora_node.stages.manifest_files import check_data_available, load_manifest


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--manifest", default="tiny", help="builtin name or TOML path (default tiny)")
    p.add_argument("--seconds", type=float, default=60.0, help="training-step wall time")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p.parse_args(argv)


def run(manifest_name: str, seconds: float, threads: int) -> dict[str, Any]:
    set_threads(threads)
    manifest = load_manifest(manifest_name)
    check_data_available(manifest)
    trainer = LocalTrainer(manifest, LocalTrainConfig(max_seconds=seconds))
    started = time.perf_counter()
    result = drive(trainer, max_seconds=seconds)
    return {
        "manifest": manifest.run.name,
        "run_id": manifest.run_id,
        "threads": threads,
        "steps": result.steps,
        "tokens": result.tokens,
        "train_seconds": round(result.train_seconds, 2),
        "cpu_seconds": round(result.cpu_seconds, 2),
        "wall_seconds": round(time.perf_counter() - started, 2),
        "tokens_per_s": round(result.tokens_per_s, 1),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "val_loss_start": round(result.val_curve[0][1], 4),
        "val_loss_end": round(result.val_curve[-1][1], 4),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.seconds <= 0 or args.threads <= 0:
        print("reference: --seconds and --threads must be positive", file=sys.stderr)
        return 2
    try:
        out = run(args.manifest, args.seconds, args.threads)
    except ManifestError as exc:
        print(f"reference: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out))
    else:
        print(
            f"{out['manifest']} ({out['run_id']}), {out['threads']} threads: "
            f"{out['steps']} steps, {out['tokens']} tokens in {out['train_seconds']} s of steps\n"
            f"  tokens/s     {out['tokens_per_s']:.0f}\n"
            f"  peak RSS     {out['peak_rss_mb']:.0f} MB\n"
            f"  val loss     {out['val_loss_start']:.4f} -> {out['val_loss_end']:.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
