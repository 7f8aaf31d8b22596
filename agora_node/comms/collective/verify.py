"""Checking a span's result before adopting it: a second reducer (the witness) and sketches.

The witness of span j is the span's backup owner, `plan.owner(j, 1)`. Members push
their part of span j to the witness too. The owner's result names the members whose
parts it aggregated (a bitmask: a late part is legitimately missing); it must name
the owner and a majority of the group. The witness reduces the span over exactly
those parts, as the owner should have. A member that fetched span j's result from
its owner asks the witness for a *sketch* of that reduction under a fresh random
nonce of its own: the value's norm and a few random +-1 projections. The owner has already
committed to the value it sent, so it cannot aim a forgery at projections drawn
afterwards: a result that differs from the witness's value by more than a small
fraction of its norm fails the comparison with overwhelming probability (for a
difference of 20% of the norm and the default tolerance of 5%, about 1e-6), and is
then not adopted: the member keeps its own values for that span (allreduce.py).
So is a result whose witness lacks one of the named parts (the owner could
otherwise name its own part and withhold it from the witness). The witness
compares the owner's value with its own directly. Only a witness that does not
answer at all leaves a result unchecked (counted).
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import Tensor

SKETCH_ROWS = 8
NONCE_BYTES = 16


def members_mask(members: tuple[str, ...], chosen: list[str] | set[str]) -> bytes:
    """Bitmask over `members` (plan order) of the `chosen` ones."""
    bits = 0
    for i, m in enumerate(members):
        if m in chosen:
            bits |= 1 << i
    return bits.to_bytes(-(-len(members) // 8) or 1, "little")


def mask_members(members: tuple[str, ...], mask: bytes) -> list[str] | None:
    """The members a mask names (None if it is not a mask over `members`)."""
    if len(mask) != (-(-len(members) // 8) or 1):
        return None
    bits = int.from_bytes(mask, "little")
    if bits >> len(members):
        return None
    return [m for i, m in enumerate(members) if bits >> i & 1]


def sketch(value: Tensor, nonce: bytes) -> Tensor:
    """[norm, p_1 .. p_k] in float64: p_i = sum of the values times +-1 signs from `nonce`."""
    seed = int.from_bytes(hashlib.sha256(nonce).digest()[:8], "little") & ((1 << 63) - 1)
    g = torch.Generator().manual_seed(seed)
    flat = value.reshape(-1).float()
    rows = [torch.linalg.vector_norm(flat, dtype=torch.float64)]
    for _ in range(SKETCH_ROWS):
        signs = torch.randint(0, 2, (flat.numel(),), generator=g, dtype=torch.int8) * 2 - 1
        rows.append((flat * signs).sum(dtype=torch.float64))
    return torch.stack(rows)


def sketch_bytes(value: Tensor, nonce: bytes) -> bytes:
    return sketch(value, nonce).numpy().tobytes()


def parse_sketch(data: bytes) -> Tensor | None:
    """A sketch from the wire, or None if it is not one (wrong size, not finite)."""
    if len(data) != 8 * (SKETCH_ROWS + 1):
        return None
    out = torch.frombuffer(bytearray(data), dtype=torch.float64)
    return out if bool(torch.isfinite(out).all()) and out[0] >= 0 else None


def sketches_match(mine: Tensor, theirs: Tensor, tolerance: float) -> bool:
    """Could both sketches (same nonce) come from values within `tolerance` of each other
    (relative to the larger norm)?"""
    scale = max(float(mine[0]), float(theirs[0]))
    bound = tolerance * scale + 1e-12
    return bool(((mine - theirs).abs() <= bound).all())


def values_match(a: Tensor, b: Tensor, tolerance: float) -> bool:
    """The witness's own check: the two values directly."""
    if a.shape != b.shape:
        return False
    scale = max(float(a.norm()), float(b.norm()))
    diff = float(torch.linalg.vector_norm((a - b).double()))
    return math.isfinite(diff) and diff <= tolerance * scale + 1e-12
