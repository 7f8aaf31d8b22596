"""Micro-batches in flight against validation loss: the asynchronous pipeline simulated in
one process, with and without weight prediction, at equal tokens.

    python bench/staleness.py [--manifest tiny] [--tokens N] [--in-flight 1,2,4,8]
                              [--latency 0,4] [--json]

Each stage is a real `StageWorker` (the daemon's, with its version copies, stashing and
steps); only the network and the clock are simulated. Time is counted in ticks: a
forward takes 1 tick on a stage, a backward 2, the last stage's forward and backward 3,
and a hop between stages `--latency` ticks. A stage runs its work in the order it
arrives (the worker thread is FIFO), so which weight version each forward sees, and
when each gradient lands, follows from the schedule as in a swarm of one replica per
stage. The head keeps `in_flight` micro-batches in the pipeline and reads samples in
the reference trainer's order, so every variant trains the same tokens on the same data
and only the staleness differs; in_flight 1 is the reference trainer step for step.

Per variant: validation loss over the run (at equal tokens), the mean lag of a
gradient (steps between the step a forward's weights came from and the step its
gradient lands in, per stage), and the pipeline's utilization (busy ticks over all
stages' ticks): how much of the latency the in-flight micro-batches hide. Variants
alternate (one evaluation interval of each in turn), so a load change on the machine
hits all of them alike; the ticks and the losses do not depend on the machine at all
(the same command prints the same losses). Each interval ends with the pipeline drained
(every micro-batch back), which a daemon's evaluation does not do: a little less
staleness than a swarm's at the same in_flight, once per evaluation.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from agora_node.node.train_local import ids_in_order  # noqa: E402
from agora_node.node.worker import StageWorker  # noqa: E402
from agora_node.stages.data import TokenBatch, TokenWindows  # noqa: E402
from agora_node.stages.manifest_files import load_manifest  # noqa: E402
from bench.common import log_stderr, set_threads  # noqa: E402

FORWARD_TICKS, BACKWARD_TICKS = 1, 2


@dataclass(order=True)
class _Arrival:
    at: int
    seq: int
    stage: int = field(compare=False)
    kind: str = field(compare=False)  # "fwd" or "bwd"
    mb: int = field(compare=False)
    payload: torch.Tensor | None = field(compare=False)


class SimulatedPipeline:
    """One replica per stage, `in_flight` micro-batches kept in the pipeline by the head."""

    def __init__(
        self,
        manifest,
        *,
        in_flight: int,
        latency: int,
        predict: bool,
        windows: TokenWindows,
        lag_momentum: bool = False,
    ) -> None:
        self.manifest, self.in_flight, self.latency = manifest, in_flight, latency
        self.workers = [
            StageWorker(manifest, i, predict_weights=predict, lag_momentum=lag_momentum)
            for i in range(manifest.num_stages)
        ]
        self.windows = windows
        spec = manifest.inner
        self.scale = spec.micro_batch / spec.local_batch
        self.cursor = 0  # samples read, in the reference trainer's order
        self.clock = 0
        self.busy_ticks = 0
        self.lags: list[list[int]] = [[] for _ in self.workers]

    def _next_batch(self) -> TokenBatch:
        count = self.manifest.inner.micro_batch
        ids = ids_in_order(self.windows, self.cursor, count)
        self.cursor += count
        return self.windows.batch(ids)

    def train(self, microbatches: int) -> None:
        """Run `microbatches` more micro-batches through the pipeline, all the way back."""
        last = len(self.workers) - 1
        free = [0] * len(self.workers)  # tick each stage is free from
        queue: list[_Arrival] = []
        seq = 0
        batches: dict[int, torch.Tensor] = {}
        versions: dict[tuple[int, int], int] = {}
        injected = done = 0

        def push(at: int, stage: int, kind: str, mb: int, payload) -> None:
            nonlocal seq
            seq += 1
            heapq.heappush(queue, _Arrival(at, seq, stage, kind, mb, payload))

        def inject(at: int) -> None:
            nonlocal injected
            batches[injected] = self._next_batch()
            push(at, 0, "fwd", injected, None)
            injected += 1

        for _ in range(min(self.in_flight, microbatches)):
            inject(self.clock)
        while queue:
            a = heapq.heappop(queue)
            worker, batch = self.workers[a.stage], batches[a.mb]
            begin = max(a.at, free[a.stage])
            if a.kind == "fwd" and a.stage == last:
                _, grad = worker.forward_backward_last(a.payload, batch, self.scale)
                self.lags[a.stage].append(0)  # the last stage steps on its latest version
                end = begin + FORWARD_TICKS + BACKWARD_TICKS
                push(end + self.latency, a.stage - 1, "bwd", a.mb, grad)
            elif a.kind == "fwd":
                versions[(a.stage, a.mb)] = worker.version
                c = worker.forward(f"{a.mb}", a.payload, batch)
                end = begin + FORWARD_TICKS
                push(end + self.latency, a.stage + 1, "fwd", a.mb, c)
            else:
                self.lags[a.stage].append(worker.version - versions.pop((a.stage, a.mb)))
                grad = worker.backward(f"{a.mb}", a.payload)
                end = begin + BACKWARD_TICKS
                if a.stage > 0:
                    push(end + self.latency, a.stage - 1, "bwd", a.mb, grad)
                else:
                    done += 1
                    del batches[a.mb]
                    if injected < microbatches:
                        inject(end)
            free[a.stage] = end
            self.busy_ticks += end - begin
            self.clock = max(self.clock, end)
        assert done == microbatches, (done, microbatches)

    @torch.no_grad()
    def evaluate(self, windows: TokenWindows, ids: list[int]) -> float:
        total = 0.0
        step = self.manifest.inner.micro_batch
        for i in range(0, len(ids), step):
            batch = windows.batch(ids[i : i + step])
            out = None
            for worker in self.workers:
                out = worker.forward_eval(out, batch)
            total += float(out) * len(batch)
        return total / len(ids)

    def utilization(self) -> float:
        return self.busy_ticks / (self.clock * len(self.workers)) if self.clock else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--manifest", default="tiny")
    parser.add_argument("--tokens", type=int, default=196_608, help="training tokens per variant")
    parser.add_argument("--in-flight", default="1,2,4,8", help="micro-batches in flight to run")
    parser.add_argument("--latency", default="4", help="ticks per hop (a forward is 1 tick)")
    parser.add_argument(
        "--predict", default="both", choices=["off", "on", "both"], help="weight prediction"
    )
    parser.add_argument(
        "--lag-momentum",
        default="off",
        choices=["off", "on", "both"],
        help="lower Adam's beta1 by each stage's measured lag (optim.lag_beta1)",
    )
    parser.add_argument("--eval-every", type=int, default=24_576, help="tokens between evaluations")
    parser.add_argument("--eval-samples", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    set_threads(args.threads)
    manifest = load_manifest(args.manifest)
    spec = manifest.inner
    mb_tokens = spec.micro_batch * manifest.model.seq_len
    if args.eval_every % mb_tokens or args.tokens % args.eval_every:
        parser.error(f"--eval-every must be a multiple of {mb_tokens} and divide --tokens")
    train, val = TokenWindows(manifest, "train"), TokenWindows(manifest, "val")
    val_ids = val.fixed_subset(args.eval_samples)
    choices = {"off": [False], "on": [True], "both": [False, True]}
    predicts, momenta = choices[args.predict], choices[args.lag_momentum]
    variants: dict[str, SimulatedPipeline] = {}
    for latency in [int(x) for x in args.latency.split(",")]:
        for k in [int(x) for x in args.in_flight.split(",")]:
            corrections = [(p, m) for p in predicts for m in momenta] if k > 1 else [(False,) * 2]
            for predict, momentum in corrections:
                torch.manual_seed(manifest.run.seed)
                name = f"inflight{k}_lat{latency}" + ("_predict" if predict else "")
                name += "_lagmomentum" if momentum else ""
                variants[name] = SimulatedPipeline(
                    manifest,
                    in_flight=k,
                    latency=latency,
                    predict=predict,
                    windows=train,
                    lag_momentum=momentum,
                )
    curves: dict[str, list[tuple[int, float]]] = {n: [] for n in variants}
    for name, pipe in variants.items():
        curves[name].append((0, pipe.evaluate(val, val_ids)))
    started = time.monotonic()
    for tokens in range(args.eval_every, args.tokens + 1, args.eval_every):
        for name, pipe in variants.items():  # one interval of each in turn
            pipe.train(args.eval_every // mb_tokens)
            curves[name].append((tokens, pipe.evaluate(val, val_ids)))
        log_stderr(
            f"{tokens:>8} tokens ({time.monotonic() - started:.0f}s): "
            + "  ".join(f"{n} {c[-1][1]:.4f}" for n, c in curves.items())
        )
    result = {
        "manifest": manifest.run.name,
        "tokens": args.tokens,
        "val_loss": {n: round(c[-1][1], 4) for n, c in curves.items()},
        "curve": {n: [[t, round(v, 4)] for t, v in c] for n, c in curves.items()},
        "mean_lag_per_stage": {
            n: [round(sum(x) / len(x), 3) if x else 0.0 for x in p.lags]
            for n, p in variants.items()
        },
        "utilization": {n: round(p.utilization(), 3) for n, p in variants.items()},
        "conditions": {
            "threads": args.threads,
            "ticks": {"forward": FORWARD_TICKS, "backward": BACKWARD_TICKS},
            "eval_samples": args.eval_samples,
        },
    }
    if args.json:
        print(json.dumps(result))
    else:
        for n in variants:
            print(
                f"{n:28s} val {result['val_loss'][n]:.4f}  util {result['utilization'][n]:.3f}"
                f"  lag/stage {result['mean_lag_per_stage'][n]}"
            )


if __name__ == "__main__":
    main()
