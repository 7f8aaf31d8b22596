"""Where a stage computes: the device (`--device`) and the precision (`--precision`).

A stage's weights, optimizer state and activations live on its device; tensors cross
to the host only at the wire (boundary activations, K/V frames, outer deltas) and in
checkpoints, so every wire format is the same whatever device a peer uses.

Precision: master weights and optimizer state stay float32 everywhere, and so do the
outer step and its anchors (docs/outer.md). `bf16` runs the stage's forward and
backward under torch autocast in bfloat16; `auto` picks it on a CUDA device that
supports it and float32 elsewhere (on CPU, bf16 autocast is slower on most cores and
only changes rounding).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

DEVICE_NAMES = ("auto", "cpu", "cuda", "cuda:N", "mps")
PRECISIONS = ("auto", "fp32", "bf16")
OPTIMIZER_STATES = ("fp32", "8bit")
OPTIMIZER_STEPS = ("after-backward", "in-backward")
_CUDA = re.compile(r"cuda(?::(\d+))?")
# torch is imported inside the functions that probe it: option validation and
# `--dry-run` stay free of it.


class DeviceError(ValueError):
    """A device or precision that this machine cannot provide; the message says why."""


def check_names(device: str, precision: str) -> None:
    """Syntax only (no probing of the machine): for option validation."""
    if device not in ("auto", "cpu", "mps") and not _CUDA.fullmatch(device):
        raise DeviceError(f"--device must be one of {', '.join(DEVICE_NAMES)}, not {device!r}")
    if precision not in PRECISIONS:
        raise DeviceError(f"--precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")


def _mps_available() -> bool:
    import torch

    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def resolve_device(name: str) -> str:
    """`auto`: the first CUDA device, else Apple's MPS, else the CPU. An explicit device
    this machine lacks is an error, never a silent fall back to the CPU."""
    import torch

    check_names(name, "auto")
    if name == "auto":
        if torch.cuda.is_available():
            return "cuda:0"
        return "mps" if _mps_available() else "cpu"
    if name in ("cpu", "mps"):
        if name == "mps" and not _mps_available():
            raise DeviceError("--device mps: this machine has no usable Apple MPS device")
        return name
    match = _CUDA.fullmatch(name)
    assert match is not None  # check_names
    if not torch.cuda.is_available():
        raise DeviceError(
            f"--device {name}: torch sees no CUDA device (torch {torch.__version__}: a CPU-only "
            "build, or no driver); use --device cpu, or install a CUDA build of torch"
        )
    index = int(match.group(1) or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(
            f"--device {name}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}"
        )
    return f"cuda:{index}"


BF16_NATIVE = (8, 0)
"""CUDA compute capability from which bfloat16 matmuls and fused attention are native
(Ampere). Older cards (T4, V100, RTX 20xx) run bf16 emulated: slower than fp32, and
attention falls back to a kernel that holds the whole score matrix."""


def resolve_precision(device: str, precision: str) -> str:
    """`fp32` or `bf16` (autocast) for a resolved device; `auto`: bf16 on a CUDA device
    that computes it natively (compute capability 8.0 or newer), fp32 elsewhere."""
    import torch

    check_names("auto", precision)
    kind = device.split(":")[0]
    bf16_ok = kind == "cpu" or (kind == "cuda" and torch.cuda.is_bf16_supported())
    if precision == "bf16" and not bf16_ok:
        raise DeviceError(f"--precision bf16: {device} does not support bfloat16 autocast")
    if precision == "auto":
        native = kind == "cuda" and torch.cuda.get_device_capability(device) >= BF16_NATIVE
        return "bf16" if native else "fp32"
    return precision


@dataclass(frozen=True)
class OptimizerMode:
    """How a node's inner optimizer spends memory (stages/memory.py prices it)."""

    states: str = "fp32"
    """AdamW's moments: `fp32` or `8bit`."""
    step: str = "after-backward"
    """`after-backward` or `in-backward` (each parameter steps once its gradient is ready)."""


PLAIN = OptimizerMode()


@dataclass(frozen=True)
class Compute:
    """How this node computes its stage: the device (a torch device string, resolved),
    the precision (fp32 or bf16 autocast), how the inner optimizer holds AdamW's
    moments (`fp32`, or `8bit` to save memory: optim.AdamW8bit) and when it steps
    (`after-backward`, or `in-backward`: each parameter as soon as its gradient is
    ready, so the gradients are never all held at once). All are the node's own
    choice; replicas exchange weights, never these."""

    device: str = "cpu"
    precision: str = "fp32"
    optimizer_states: str = "fp32"
    optimizer_step: str = "after-backward"

    @classmethod
    def resolve(
        cls,
        device: str = "auto",
        precision: str = "auto",
        optimizer_states: str = "fp32",
        optimizer_step: str = "after-backward",
    ) -> Compute:
        """What the options name, checked against this machine (DeviceError if it lacks it)."""
        dev = resolve_device(device)
        return cls(dev, resolve_precision(dev, precision), optimizer_states, optimizer_step)

    @property
    def optimizer_mode(self) -> OptimizerMode:
        return OptimizerMode(self.optimizer_states, self.optimizer_step)

    @property
    def kind(self) -> str:
        return self.device.split(":")[0]

    def autocast(self) -> Any:
        """The context a stage's forward runs in (disabled for fp32)."""
        import torch

        on = self.precision == "bf16"
        return torch.autocast(self.kind, dtype=torch.bfloat16, enabled=on)

    def synchronize(self) -> None:
        """Wait for the device's queued work (timing); nothing to wait for on the CPU."""
        if self.kind == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def describe(self) -> str:
        """One phrase for the log, --dry-run and the status page."""
        name = self.device
        if self.kind == "cuda":
            import torch

            props = torch.cuda.get_device_properties(self.device)
            name += f" ({props.name}, {props.total_memory / 2**30:.0f} GiB)"
        states = ", 8-bit optimizer states" if self.optimizer_states == "8bit" else ""
        when = ", optimizer step in backward" if self.optimizer_step == "in-backward" else ""
        return f"{name}, {self.precision}{states}{when}"

    def free_bytes(self) -> int | None:
        """Accelerator memory free now, counting what torch's allocator holds cached but
        unused (free for this process's tensors); None on the CPU and MPS (not probed)."""
        if self.kind == "cuda":
            import torch

            cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(
                self.device
            )
            return int(torch.cuda.mem_get_info(self.device)[0]) + max(0, int(cached))
        return None

    def release_memory(self) -> None:
        """Collect unreachable objects (a closed stage's optimizer and pipeline sit in
        reference cycles) and, on CUDA, hand the allocator's cached blocks back: before
        a new stage measures free memory. Blocks for a moment: call it off the loop."""
        import gc

        gc.collect()
        if self.kind == "cuda":
            import torch

            torch.cuda.empty_cache()

    def memory_status(self) -> dict[str, int] | None:
        """Bytes this process holds on the accelerator (tensors, allocator, peak tensors),
        for the status page; None on the CPU and MPS."""
        if self.kind != "cuda":
            return None
        import torch

        return {
            "allocated": int(torch.cuda.memory_allocated(self.device)),
            "reserved": int(torch.cuda.memory_reserved(self.device)),
            "peak_allocated": int(torch.cuda.max_memory_allocated(self.device)),
        }


CPU = Compute()
