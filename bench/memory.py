"""Memory of one stage: the estimate placement and `--dry-run` use, against what a stage
worker really allocates while it trains, and the time of an inner step.

    python bench/memory.py --json [--manifests tiny,bench] [--steps 3] [--threads 2]
        [--quality-manifest tiny] [--quality-steps 300] [--eval-every 50]

For each manifest, stage and mode, in this process: a `StageWorker` is built and trained
for `--steps` inner steps the way a daemon drives it (micro-batches of one inner step in
flight: all their forwards, then their backwards with a gradient from downstream; the
last stage computes its loss and backward at once). torch's profiler records every CPU
allocation and free (`profile_memory`); `measured_bytes` is the peak of live bytes over
the whole run, counted from before the worker existed (weights, their version copy,
gradients, optimizer state, autograd graphs, the step's temporaries).
`estimated_bytes` is `device_bytes` of `memory.stage_memory_bytes` for the same
stage, mode and in-flight count (what `--dry-run` prints and a GPU node checks against
its free memory; the outer anchor and momentum live on the host and are not in it).

Modes: `fp32` (AdamW's moments in float32), `8bit` (float8 with a float32 scale per
block of 256, optim.AdamW8bit: `--optimizer-states 8bit`), and either with
`+in-backward` (`--optimizer-step in-backward`: each parameter steps as soon as its
gradient is ready), written `in-backward` and `8bit+in-backward`. In-backward needs a
run that steps every micro-batch: `--micro-batch N` and `--local-batch N` override the
manifests' (0: theirs), and rows say which they used.

Quality: the reference trainer on `--quality-manifest` in each of `--quality-modes`,
alternating a step of each on the same data order, validation loss every
`--eval-every` steps; `gap` is each mode's final loss against the first mode's;
`tail_rel_drop` says how much the first mode's curve still fell over its last quarter
(relative to its final loss), i.e. whether it had flattened.

One JSON line: {"rows": [{"manifest", "micro_batch", "local_batch", "mode", "stage", "estimated_bytes",
"measured_bytes", "ratio", "step_s"}], "quality": {...}, "conditions": {...}}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import log_stderr, set_threads  # noqa: E402
from torch._C._autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from agora_node.node.train_local import LocalTrainConfig, LocalTrainer  # noqa: E402
from agora_node.node.worker import StageWorker  # noqa: E402
from agora_node.protocol.manifest import Manifest  # noqa: E402
from agora_node.stages import memory  # noqa: E402
from agora_node.stages.device import Compute  # noqa: E402
from agora_node.stages.manifest_files import load_manifest  # noqa: E402

MODES = ("fp32", "8bit", "in-backward", "8bit+in-backward")


def compute_of(mode: str) -> Compute:
    """A mode's CPU compute: `fp32` or `8bit` states, `+in-backward` for the step."""
    parts = mode.split("+")
    if mode not in MODES:
        raise SystemExit(f"unknown mode {mode!r}: one of {', '.join(MODES)}")
    states = "8bit" if "8bit" in parts else "fp32"
    step = "in-backward" if "in-backward" in parts else "after-backward"
    return Compute("cpu", "fp32", states, step)


def with_batches(manifest: Manifest, micro_batch: int, local_batch: int) -> Manifest:
    """The manifest with another micro_batch and local_batch (0: its own)."""
    inner = manifest.inner
    return dataclasses.replace(
        manifest,
        inner=dataclasses.replace(
            inner,
            micro_batch=micro_batch or inner.micro_batch,
            local_batch=local_batch or inner.local_batch,
        ),
    )


def train(manifest: Manifest, stage: int, steps: int, mode: str) -> list[float]:
    """Build a worker and train it `steps` inner steps; seconds per step."""
    worker = StageWorker(manifest, stage, compute=compute_of(mode))
    spec, model = manifest.inner, manifest.model
    n_micro = spec.local_batch // spec.micro_batch
    gen = torch.Generator().manual_seed(stage)
    width = worker.stage.boundary_width
    step_s = []
    try:
        for step in range(steps):
            started = time.perf_counter()
            batches = [
                torch.randint(
                    0, model.vocab_size, (spec.micro_batch, model.seq_len + 1), generator=gen
                )
                for _ in range(n_micro)
            ]
            c_in = None if stage == 0 else torch.randn(spec.micro_batch, model.seq_len, width)
            if worker.stage.is_last:
                for tokens in batches:
                    worker.forward_backward_last(c_in, tokens, 1 / n_micro)
            else:
                ids = [f"{step}/{i}" for i in range(n_micro)]
                outs = [worker.forward(i, c_in, t) for i, t in zip(ids, batches, strict=True)]
                for mb_id, out in zip(ids, outs, strict=True):
                    worker.backward(mb_id, torch.randn_like(out) * 1e-3)
            step_s.append(time.perf_counter() - started)
        assert worker.stats.steps == steps
    finally:
        worker.close()
    return step_s


def peak_live_bytes(prof: profile) -> int:
    """The most CPU bytes alive at once during the profile, from its allocation events
    (relative to the start: a tensor freed inside that existed before counts negative)."""
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def measure(manifest: Manifest, stage: int, steps: int, mode: str) -> tuple[int, float]:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step_s = train(manifest, stage, steps, mode)
    return peak_live_bytes(prof), statistics.median(step_s[1:] or step_s)


def quality(
    manifest: Manifest, modes: list[str], steps: int, eval_every: int, eval_samples: int
) -> dict:
    """The modes against the first, a step of each in turn (A B A B), same data order."""
    trainers = {
        mode: LocalTrainer(
            manifest,
            LocalTrainConfig(steps=steps, eval_samples=eval_samples, compute=compute_of(mode)),
        )
        for mode in modes
    }
    tokens_per_step = manifest.inner.local_batch * manifest.model.seq_len
    curves = {mode: [(0, t.evaluate())] for mode, t in trainers.items()}
    seconds = dict.fromkeys(modes, 0.0)
    for step in range(1, steps + 1):
        for mode, trainer in trainers.items():
            started = time.perf_counter()
            trainer.train_step()
            seconds[mode] += time.perf_counter() - started
            if step % eval_every == 0 or step == steps:
                curves[mode].append((step * tokens_per_step, trainer.evaluate()))
                log_stderr(f"{mode:16s} step {step:5d} | val {curves[mode][-1][1]:.4f}")
    final = {mode: curve[-1][1] for mode, curve in curves.items()}
    first = curves[modes[0]]
    quarter = first[-1 - max(1, len(first) // 4)][1]
    return {
        "manifest": manifest.run.name,
        "micro_batch": manifest.inner.micro_batch,
        "local_batch": manifest.inner.local_batch,
        "steps": steps,
        "tokens": steps * tokens_per_step,
        "val_loss": final,
        "gap": {mode: round(final[mode] / final[modes[0]] - 1, 5) for mode in modes[1:]},
        "tail_rel_drop": {modes[0]: round((quarter - first[-1][1]) / first[-1][1], 5)},
        "step_s": {mode: round(seconds[mode] / steps, 4) for mode in modes},
        "val_curve": curves,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--manifests", default="tiny,bench")
    ap.add_argument("--modes", default="fp32,8bit", help=f"of {', '.join(MODES)}")
    ap.add_argument("--micro-batch", type=int, default=0, help="0: each manifest's own")
    ap.add_argument("--local-batch", type=int, default=0, help="0: each manifest's own")
    ap.add_argument("--quality-modes", default="fp32,8bit")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quality-manifest", default="tiny")
    ap.add_argument("--quality-steps", type=int, default=300, help="0: skip the quality run")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-samples", type=int, default=16)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    set_threads(args.threads)
    rows = []
    for name in args.manifests.split(","):
        manifest = with_batches(load_manifest(name), args.micro_batch, args.local_batch)
        for mode in args.modes.split(","):
            n_micro = manifest.inner.local_batch // manifest.inner.micro_batch
            for stage in range(manifest.num_stages):
                measured, step_s = measure(manifest, stage, args.steps, mode)
                last = stage == manifest.num_stages - 1
                estimate = memory.stage_memory_bytes(
                    manifest,
                    stage,
                    optimizer=manifest.inner.optimizer,
                    in_flight=1 if last else n_micro,
                    optimizer_states=compute_of(mode).optimizer_states,
                    optimizer_step=compute_of(mode).optimizer_step,
                )["device_bytes"]
                row = {
                    "manifest": name,
                    "micro_batch": manifest.inner.micro_batch,
                    "local_batch": manifest.inner.local_batch,
                    "mode": mode,
                    "stage": stage,
                    "estimated_bytes": estimate,
                    "measured_bytes": measured,
                    "ratio": round(estimate / measured, 3),
                    "step_s": round(step_s, 4),
                }
                rows.append(row)
                log_stderr(
                    f"{name:6s} {mode:16s} stage {stage}: estimated {row['estimated_bytes'] / 2**20:8.1f}"
                    f" MiB, measured {measured / 2**20:8.1f} MiB (x{row['ratio']:.3f}), "
                    f"step {step_s:.3f}s"
                )
    conditions = {
        "threads": args.threads,
        "steps": args.steps,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": torch.get_num_threads(),
        "in_flight": "one inner step's micro-batches (the daemon's default); last stage: 1",
    }
    out = {"rows": rows, "conditions": conditions}
    if args.quality_steps:
        out["quality"] = quality(
            with_batches(load_manifest(args.quality_manifest), args.micro_batch, args.local_batch),
            args.quality_modes.split(","),
            args.quality_steps,
            args.eval_every,
            args.eval_samples,
        )
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
