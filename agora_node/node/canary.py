"""Canary micro-batches (the SCOUT idea): the same input through several replicas of a
stage, and who departs from the strict majority.

Replicas of a stage hold the same anchor after each outer round and drift apart only
by their own inner steps since, so their outputs for one input are close; a replica
that computes something else (wrong weights, garbage, a scaled output) is far from
all of them. `departing` is the pure decision; `Pipeline` (pipeline.py) sends the
probes and flags the answer's authors in the suspects ledger.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def distance(a: Tensor, b: Tensor) -> float:
    """||a - b|| relative to the larger of the two norms (inf if either is not finite)."""
    a, b = a.float().reshape(-1), b.float().reshape(-1)
    if a.shape != b.shape or not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return math.inf
    scale = max(float(a.norm()), float(b.norm()), 1e-12)
    return float((a - b).norm()) / scale


def departing(outputs: dict[str, Tensor], tolerance: float) -> list[str]:
    """The answers' authors to flag: those farther than `tolerance` from every member of
    some strict majority of the answers that agree among themselves.

    Needs 3 answers or more (with two, neither outvotes the other). If no strict
    majority agrees (all far apart), nobody is flagged: there is nothing to depart from."""
    peers = sorted(outputs)
    n = len(peers)
    if n < 3:
        return []
    close = {
        p: {q for q in peers if q != p and distance(outputs[p], outputs[q]) <= tolerance}
        for p in peers
    }
    need = n // 2 + 1  # a strict majority, counting the peer itself
    majority = {p for p in peers if len(close[p]) + 1 >= need}
    if not majority:
        return []
    return [p for p in peers if p not in majority and not close[p] & majority]
