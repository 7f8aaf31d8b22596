"""Helpers shared by the training benchmarks: threads, memory, and a timed drive of LocalTrainer.

`drive` calls the reference trainer's own `train_step` and `evaluate` (no second training loop)
and times the steps alone, so evaluation never dilutes tokens/s; `LocalTrainer.run` counts
evaluation and checkpoint time inside its tokens/s.
"""

from __future__ import annotations

import contextlib
import resource
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from agora_node.node.train_local import LocalTrainer


def set_threads(threads: int) -> None:
    """Pin torch to `threads` intra-op threads and one inter-op thread (comparable across hosts)."""
    torch.set_num_threads(threads)
    # Fails once inter-op work has started in this process; the first setting then stands.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)


def exit_on_sigterm() -> None:
    """SIGTERM ends the benchmark as Ctrl-C does: through its `finally` blocks, so the
    daemons, namespaces and files it started are stopped and removed (Python's default
    for SIGTERM is to die on the spot, leaving them)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def log_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class DriveResult:
    steps: int = 0
    tokens: int = 0
    train_seconds: float = 0.0
    """Wall time inside train_step only."""
    cpu_seconds: float = 0.0
    """CPU time of this process (all threads) inside train_step only."""
    val_curve: list[tuple[int, float]] = field(default_factory=list)
    """(tokens trained, validation loss), starting at 0 tokens."""
    train_losses: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.train_seconds if self.train_seconds else 0.0


def drive(
    trainer: LocalTrainer,
    *,
    max_steps: int | None = None,
    max_seconds: float | None = None,
    eval_every: int = 0,
    report: Callable[[str], None] = log_stderr,
) -> DriveResult:
    """Step `trainer` until max_steps steps or max_seconds of step time; validate at the ends.

    eval_every > 0 also validates every that many steps. Only train_step is timed.
    """
    if max_steps is None and max_seconds is None:
        raise ValueError("give max_steps or max_seconds")
    tokens_per_step = trainer.manifest.inner.local_batch * trainer.manifest.model.seq_len
    out = DriveResult()
    out.val_curve.append((0, trainer.evaluate()))
    report(f"tokens {0:9d} | val_loss {out.val_curve[-1][1]:.4f}")
    while (max_steps is None or out.steps < max_steps) and (
        max_seconds is None or out.train_seconds < max_seconds
    ):
        started, cpu_started = time.perf_counter(), time.process_time()
        loss = trainer.train_step()
        out.train_seconds += time.perf_counter() - started
        out.cpu_seconds += time.process_time() - cpu_started
        out.steps += 1
        out.tokens += tokens_per_step
        out.train_losses.append(loss)
        report(
            f"step {out.steps:5d} | loss {loss:.4f} | {out.tokens_per_s:7.0f} tok/s "
            f"| {out.train_seconds:6.1f}s in steps"
        )
        if eval_every and out.steps % eval_every == 0:
            out.val_curve.append((out.tokens, trainer.evaluate()))
            report(f"tokens {out.tokens:9d} | val_loss {out.val_curve[-1][1]:.4f}")
    if out.val_curve[-1][0] != out.tokens:
        out.val_curve.append((out.tokens, trainer.evaluate()))
        report(f"tokens {out.tokens:9d} | val_loss {out.val_curve[-1][1]:.4f}")
    return out


def control_status(child) -> dict | None:  # noqa: ANN001 - node.demo.Child
    """A daemon's status snapshot over its control socket (DATA_DIR/control.sock, a Unix
    socket: reachable from any network namespace), or None if it does not answer."""
    from pathlib import Path

    from agora_node.node.control import ControlError, control_call_sync

    data_dir = Path(child.argv[child.argv.index("--data-dir") + 1])
    try:  # the snapshot behind both; its "node" part is what the status page serves
        return control_call_sync(data_dir / "control.sock", "Status", timeout=5).get("node")
    except ControlError:
        return None


def parse_rates(text: str, count: int) -> tuple[float, ...]:
    """'UP,DOWN[,RTT]' -> floats (Mbit/s, Mbit/s[, ms]); ValueError unless rates > 0 and
    the RTT >= 0."""
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        values = ()
    if len(values) != count or min(values[:2]) <= 0 or values[-1] < 0:
        raise ValueError(f"{text!r}: want {count} comma-separated numbers, rates > 0")
    return values


class DaemonLab:
    """A network lab (tests/netlab.py) for benchmark daemons: a host of its own per
    process, its links shaped to `link` = (up Mbit/s, down Mbit/s, RTT ms) when given.
    The kernel here has no netem, so the RTT goes to the daemons' transport
    (`daemon_args`): half of it on every message a daemon sends."""

    def __init__(self, link: tuple[float, float, float] | None = None) -> None:
        from tests.netlab import NetLab, why_not

        if (reason := why_not()) is not None:
            raise SystemExit(f"--lab: {reason}")
        self.lab, self.link = NetLab.create(), link

    def host(self, name: str):  # noqa: ANN201 - tests.netlab.Host
        """A fresh host on the switch, with the lab's links."""
        host = self.lab.public(name)
        if self.link is not None:
            self.lab.shape(host, *self.link[:2])
        return host

    def restore(self, host) -> None:  # noqa: ANN001
        """The host's links back to the lab's after a degradation (`NetLab.shape`)."""
        if self.link is not None:
            self.lab.shape(host, *self.link[:2])
        else:
            self.lab.unshape(host)

    def command(self, host) -> tuple[tuple[str, ...], list[str]]:  # noqa: ANN001
        """(what a command runs under, the daemon's listen arguments) on `host`."""
        return tuple(self.lab.exec_prefix(host)), ["--host-maddrs", f"/ip4/{host.ip}/tcp/0"]

    def daemon_args(self) -> list[str]:
        if self.link is None or not self.link[2]:
            return []
        return ["--emulate-link", f"100000,{self.link[2] / 2}"]

    def close(self) -> int:
        """Delete the namespaces; how many are left behind."""
        return len(self.lab.destroy()) + len(self.lab.leftovers())
