"""A replica joins a stage that is already training: how soon does it mix with it?

    python bench/late_joiner.py --runs 6 --json

Starts a bootstrap, one stage-0 replica (a0) and two stage-1 replicas of a 4-layer
`tiny` on loopback (1 torch thread each, `--inner-steps` a round, overlapped rounds),
waits until a0 has ended `--after` outer rounds alone, then starts a second stage-0
replica (a1), which copies a0's state and joins its rounds. Prints, per run:

- `seconds_to_together`: from a1's state load to the first outer round both replicas
  logged as mixed by the two of them (None: not within `--deadline` seconds);
- `a0_rounds_meanwhile`: the rounds a0 ended in that time (each one alone);
- `mismatched`: rounds one replica logged as mixed by two (a group of 2/2) and the
  other as mixed alone (1/1): a group only one side formed, which that side waits on;
- `a1_alone`: rounds a1 logged as mixed alone before that first round together (it
  entered a round a0 had closed without it, and saw so).

`--load N` keeps N busy processes (pure Python loops, nice 0) running beside the swarm,
as on a volunteer's machine doing other work; the mismatched groups showed on a loaded
machine (the slow test suite), rarely on an idle one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.harness import TestSwarm, poll, small_manifest  # noqa: E402

ROUND = re.compile(r"I agora_node\.node\.outer: outer round (\d+) \| group (\d+)/(\d+)")
LOADED = "loaded stage 0 state"


def groups(log: str) -> dict[int, int]:
    """Outer round -> how many replicas mixed it, as one replica's log says."""
    return {int(r): int(k) for r, k, _ in ROUND.findall(log)}


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def load(n: int):  # noqa: ANN201
    """`n` busy processes for the duration, stopped (by pid) after it."""
    procs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.join()


def one_run(workdir: Path, after: int, deadline_s: float, rank: int, inner_steps: int) -> dict:
    swarm = TestSwarm(workdir)
    try:
        manifest = small_manifest(
            workdir / "two.toml",
            stages=2,
            layers=4,
            inner_steps=inner_steps,
            overlap=True,
            outer_rank=rank,
        )
        swarm.bootstrap(manifest)
        a0, b0, b1 = (
            swarm.join(n, "--stage", s) for n, s in (("a0", "0"), ("b0", "1"), ("b1", "1"))
        )
        for node in (a0, b0, b1):
            swarm.serving(node)
        poll(lambda: len(groups(swarm.log(a0))) >= after, 240, f"{after} rounds of a0")
        a1 = swarm.join("a1", "--stage", "0")
        poll(lambda: LOADED in swarm.log(a1), 120, "a1's state load")
        loaded, a0_at = time.monotonic(), len(swarm.log(a0))

        def together() -> bool:
            g0, g1 = groups(swarm.log(a0)), groups(swarm.log(a1))
            return any(g0.get(r) == 2 for r, k in g1.items() if k == 2)

        try:
            poll(together, deadline_s, "a round both replicas mixed together")
            seconds = round(time.monotonic() - loaded, 1)
        except AssertionError:  # poll's timeout
            seconds = None
        g0, g1 = groups(swarm.log(a0)), groups(swarm.log(a1))
        first = min((r for r, k in g1.items() if k == 2 and g0.get(r) == 2), default=None)
        return {
            "seconds_to_together": seconds,
            "a0_rounds_meanwhile": len(ROUND.findall(swarm.log(a0)[a0_at:])),
            "mismatched": sorted(r for r in g0.keys() & g1.keys() if g0[r] != g1[r]),
            "a1_alone": sorted(r for r, k in g1.items() if k == 1 and (first is None or r < first)),
        }
    finally:
        swarm.stop(grace_s=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--after", type=int, default=4, help="a0's rounds before a1 starts")
    parser.add_argument("--deadline", type=float, default=150.0)
    parser.add_argument("--rank", type=int, default=0, help="outer.rank (0: dense parts)")
    parser.add_argument("--inner-steps", type=int, default=3, help="H of the run")
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the swarm")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    runs = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="agora-late-") as tmp, load(args.load):
            runs.append(
                one_run(Path(tmp), args.after + i % 3, args.deadline, args.rank, args.inner_steps)
            )
        print(f"run {i + 1}: {runs[-1]}", file=sys.stderr, flush=True)
    times = [r["seconds_to_together"] for r in runs if r["seconds_to_together"] is not None]
    summary = {
        "runs": len(runs),
        "together": len(times),
        "median_s": statistics.median(times) if times else None,
        "max_s": max(times, default=None),
        "runs_with_mismatched_rounds": sum(bool(r["mismatched"]) for r in runs),
        "runs_with_a1_alone": sum(bool(r["a1_alone"]) for r in runs),
    }
    print(json.dumps(summary), file=sys.stderr)
    if args.json:
        print(
            json.dumps({"after": args.after, "rank": args.rank, "summary": summary, "runs": runs})
        )


if __name__ == "__main__":
    main()
