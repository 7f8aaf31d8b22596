"""A stage's tensors as one flat float32 vector on the host, and back.

The outer step, checkpoints' outer state and a cell's weight versions all read a stage's
weights (or gradients) as one vector on the host, whatever the device they live on.
Each tensor is copied into its slice of one host buffer: concatenating on the device
first would need a whole extra copy of the stage's weights there, at the moment the
worker is busiest."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


def host_flat(tensors: Iterable[Tensor]) -> Tensor:
    """The tensors' values in order, float32, in one new host vector."""
    tensors = list(tensors)
    out = torch.empty(sum(t.numel() for t in tensors), dtype=torch.float32)
    offset = 0
    for t in tensors:
        n = t.numel()
        out[offset : offset + n].copy_(t.detach().reshape(-1))
        offset += n
    return out


@torch.no_grad()
def write_flat(tensors: Iterable[Tensor], flat: Tensor) -> None:
    """tensors := the values of `flat` in order (in place, on their own device and dtype)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n
