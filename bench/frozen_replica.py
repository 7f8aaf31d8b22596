"""A replica that falls asleep: does its partner at the same stage keep training?

    python bench/frozen_replica.py --freeze 60 --runs 2 --json

Starts a bootstrap, two stage-0 replicas (a0, a1) and one stage-1 replica (b0) of a
2-layer `tiny` on loopback (1 torch thread each), waits until a0 ends an outer round
that both stage-0 replicas mixed, then SIGSTOPs a1's main process (a laptop asleep) for
`--freeze` seconds and wakes it. Prints, per run, the outer rounds a0 ended during the
freeze, the micro-batches b0 refused as norm outliers (in the whole run), and the
re-bases b0's norm watch logged during the freeze (it logs one that pardons senders it
had refused; one on norms taken but too far to count, before any refusal, is silent).
Early in training the boundary activations grow fast; a norm watch whose level the
frozen replica holds refuses the other one (suspects.NormWatch).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.harness import TestSwarm, poll, small_manifest  # noqa: E402

ROUND = re.compile(r"I agora_node\.node\.outer: outer round \d+ \| group (\d+)/")
REBASED = "norm watch re-based"
REFUSED = "activation norm far from the recent ones"


def one_run(workdir: Path, freeze_s: float) -> dict:
    swarm = TestSwarm(workdir)
    try:
        manifest = small_manifest(workdir / "two.toml", stages=2, layers=2, inner_steps=2)
        swarm.bootstrap(manifest)
        a0, a1, b0 = (
            swarm.join(n, "--stage", s) for n, s in (("a0", "0"), ("a1", "0"), ("b0", "1"))
        )
        for node in (a0, a1, b0):
            swarm.serving(node)

        poll(lambda: "2" in ROUND.findall(swarm.log(a0)), 240, "a round a0 and a1 mixed")
        a0_at, b0_at = len(swarm.log(a0)), len(swarm.log(b0))  # the freeze's logs start here
        os.kill(a1.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(freeze_s)  # the freeze itself is what is measured
        finally:
            os.kill(a1.proc.pid, signal.SIGCONT)
        a0_freeze, b0_log = swarm.log(a0)[a0_at:], swarm.log(b0)
        return {
            "a0_rounds_during_freeze": len(ROUND.findall(a0_freeze)),
            "refused_by_b0": b0_log.count(REFUSED),
            "rebased_during_freeze": b0_log[b0_at:].count(REBASED),
        }
    finally:
        swarm.stop(grace_s=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--freeze", type=float, default=60.0, help="seconds a1 is stopped")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    runs = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="agora-frozen-") as tmp:
            runs.append(one_run(Path(tmp), args.freeze))
        print(f"run {i + 1}: {runs[-1]}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"freeze_s": args.freeze, "runs": runs}))


if __name__ == "__main__":
    main()
