"""Randomized Hadamard rotation: spreads outliers over a block before quantization.

rotate(x) = H(D x) on every block of the last dimension, where D is a diagonal of random
signs derived from an integer seed and H the orthonormal Walsh-Hadamard matrix (Sylvester
order). H is symmetric and orthonormal, so unrotate(y) = D H(y) is the exact inverse.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

_MASK64 = (1 << 64) - 1
_DENSE_MAX = 256


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal fast Walsh-Hadamard transform over the last dim (a power of two)."""
    n = x.shape[-1]
    if not is_power_of_two(n):
        raise ValueError(f"Hadamard block must be a power of two, got {n}")
    lead = x.shape[:-1]
    # H_n = H_(n/m) kron H_m: one matmul does the inner m (BLAS is ~2x faster than butterflies
    # there), butterflies do the rest, if any.
    m = min(n, _DENSE_MAX)
    y = (x.reshape(-1, m) @ _sylvester(m, x.dtype, x.device)).reshape(-1, n)
    h = m
    while h < n:
        # Pair element j with j + h inside every chunk of 2h: one butterfly stage.
        y = y.view(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(*lead, n) * (1.0 / math.sqrt(n))


@lru_cache(maxsize=16)
def _sylvester(m: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The unnormalized +-1 Hadamard matrix of order m (entries exact in any float dtype)."""
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < m:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


@lru_cache(maxsize=64)
def _signs_cpu(seed: int, n: int) -> torch.Tensor:
    # splitmix64 in numpy rather than torch.Generator: the sign vector is part of the wire
    # contract (a receiver rebuilds it from the seed in the header), so it must not depend on
    # the torch or numpy version a peer happens to run.
    idx = np.arange(1, n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = np.uint64(seed & _MASK64) + idx * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    bits = (z >> np.uint64(63)).astype(np.float32)
    return torch.from_numpy(1.0 - 2.0 * bits)


def random_signs(seed: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The +-1 float32 diagonal D of length n for `seed` (any int, taken mod 2**64)."""
    return _signs_cpu(seed & _MASK64, n).to(device)


def rotate(x: torch.Tensor, seed: int) -> torch.Tensor:
    """H(D x) on each block of the last dim; the last dim is the block (a power of two)."""
    return fwht(x * random_signs(seed, x.shape[-1], x.device))


def unrotate(y: torch.Tensor, seed: int) -> torch.Tensor:
    """Exact inverse of `rotate` (up to float rounding)."""
    return fwht(y) * random_signs(seed, y.shape[-1], y.device)
