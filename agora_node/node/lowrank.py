"""Low-rank pseudo-gradients for the outer mix (PowerSGD-style, Vogels et al. 2019).

With `outer.rank = r`, each weight matrix M (rows x cols) of a replica's pseudo-gradient,
plus what earlier rounds left out of it (error feedback), travels as two thin factors
in two mixes of the same group:

1. `first`: P_i = M_i Q, rows x r, where Q is a random cols x r matrix that every member
   draws from the round's seed, so the group's mean of the P_i is (mean M) Q;
2. `second`: P = orth(mean P), then Q_i = M_i^T P, cols x r; the parameters that are not
   worth factoring (vectors, and matrices where r (rows + cols) >= rows cols) travel
   whole in this mix, after the factors;
3. `finish`: the mixed update is P (mean Q)^T, the same on every member (same mixed
   factors, same float64 arithmetic), and M_i - P Q_i^T is kept as the residual for
   the next round.

Q is warm-started: each member starts from the mean Q its group mixed last round (power
iteration across rounds, so P follows the pseudo-gradient's top subspace as it drifts),
or draws it from the round's seed when it has none (first round, after a reset). Members
need not agree on Q: whatever subspace their mean P spans, every member projects onto
the same orthonormal P, so the result is the projection of the group's mean M onto it
and the same on all of them; a stale or foreign Q only makes that subspace worse.
The first factor is orthonormalized in float64 (Householder QR) and the update rebuilt in
float64 before rounding to float32, so members on different hardware disagree only
where a float64 difference crosses a float32 rounding boundary; if they ever do, their
anchors' digests differ and the anchor mix repairs it (outer.py).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class _Matrix:
    offset: int
    rows: int
    cols: int


class LowRank:
    """One replica's factorization of its flat pseudo-gradient; see the module docstring.

    shapes: the shapes of the parameters, in the order of the flat vector."""

    def __init__(self, shapes: list[tuple[int, ...]], rank: int) -> None:
        if rank < 1:
            raise ValueError(f"rank must be at least 1, not {rank}")
        self.rank = rank
        self.matrices: list[_Matrix] = []
        self.whole: list[tuple[int, int]] = []
        """Ranges of the flat vector that travel whole (in the second mix)."""
        offset = 0
        for shape in shapes:
            n = math.prod(shape)
            rows = shape[0] if len(shape) >= 2 else 1
            if len(shape) >= 2 and rank * (rows + n // rows) < n:
                self.matrices.append(_Matrix(offset, rows, n // rows))
            else:
                self.whole.append((offset, offset + n))
            offset += n
        self.numel = offset
        self.first_numel = sum(m.rows * rank for m in self.matrices)
        """Values of the first mix (the P factors)."""
        self.second_numel = sum(m.cols * rank for m in self.matrices) + sum(
            hi - lo for lo, hi in self.whole
        )
        """Values of the second mix (the Q factors, then the whole parameters)."""
        self.residual: Tensor | None = None
        self.warm: list[Tensor] | None = None
        """Last round's mixed Q of every matrix: where this round's power iteration starts."""
        self._m: Tensor | None = None
        self._p: list[Tensor] = []
        self._q: list[Tensor] = []

    @property
    def ratio(self) -> float:
        """Values of the full vector per value on the wire (both mixes)."""
        return self.numel / (self.first_numel + self.second_numel)

    def first(self, delta: Tensor, seed: bytes) -> Tensor:
        """The P factors of delta + residual, as one flat float32 vector."""
        m = delta.detach().reshape(-1).float()
        if m.numel() != self.numel:
            raise ValueError(f"expected {self.numel} values, got {m.numel()}")
        if self.residual is not None:
            m = m + self.residual
        self._m = m
        gen = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(seed).digest()[:8]) >> 1)
        parts = []
        for k, mat in enumerate(self.matrices):
            q = torch.randn(mat.cols, self.rank, generator=gen)
            if self.warm is not None:
                q = self.warm[k]
            parts.append((self._view(m, mat) @ q).reshape(-1))
        return torch.cat(parts) if parts else torch.zeros(0)

    def second(self, mixed_first: Tensor) -> Tensor:
        """From the group's mean P: this replica's Q factors, then its whole parameters."""
        if self._m is None:
            raise RuntimeError("second() before first()")
        if mixed_first.numel() != self.first_numel:
            raise ValueError(f"expected {self.first_numel} values, got {mixed_first.numel()}")
        self._p, self._q, parts, at = [], [], [], 0
        for mat in self.matrices:
            p = mixed_first[at : at + mat.rows * self.rank].reshape(mat.rows, self.rank)
            at += mat.rows * self.rank
            p = torch.linalg.qr(p.double()).Q
            q = self._view(self._m, mat).T @ p.float()
            self._p.append(p)
            self._q.append(q)
            parts.append(q.reshape(-1))
        parts += [self._m[lo:hi] for lo, hi in self.whole]
        return torch.cat(parts) if parts else torch.zeros(0)

    def finish(self, mixed_second: Tensor) -> Tensor:
        """The mixed update P (mean Q)^T (and the mixed whole parameters), as a flat float32
        vector; the residual becomes M_i - P Q_i^T."""
        if self._m is None or len(self._p) != len(self.matrices):
            raise RuntimeError("finish() before second()")
        if mixed_second.numel() != self.second_numel:
            raise ValueError(f"expected {self.second_numel} values, got {mixed_second.numel()}")
        out = torch.empty(self.numel)
        residual = torch.zeros(self.numel)
        at, warm = 0, []
        for mat, p, own_q in zip(self.matrices, self._p, self._q, strict=True):
            q = mixed_second[at : at + mat.cols * self.rank].reshape(mat.cols, self.rank)
            at += mat.cols * self.rank
            warm.append(torch.linalg.qr(q.double()).Q.float())  # same span, well conditioned
            self._view(out, mat).copy_((p @ q.double().T).float())
            self._view(residual, mat).copy_(self._view(self._m, mat) - p.float() @ own_q.T)
        for lo, hi in self.whole:
            out[lo:hi] = mixed_second[at : at + hi - lo]
            at += hi - lo
        self.residual, self.warm = residual, warm
        self._m, self._p, self._q = None, [], []
        return out

    def abandon(self) -> None:
        """The round's mixes failed: the residual stays what it was (the replica applies its
        own delta; what the factors would have left out is not lost)."""
        self._m, self._p, self._q = None, [], []

    def reset(self) -> None:
        """Forget the residual and the warm start (the weights were replaced, e.g. by a
        state transfer)."""
        self.residual, self.warm = None, None
        self.abandon()

    @staticmethod
    def _view(flat: Tensor, mat: _Matrix) -> Tensor:
        return flat[mat.offset : mat.offset + mat.rows * mat.cols].view(mat.rows, mat.cols)
