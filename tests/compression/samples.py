"""Test tensors the codec tests share: gaussian, heavy-tailed, with outliers."""

from __future__ import annotations

import torch


def gaussian(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def student_t(n: int, df: int = 2, seed: int = 0) -> torch.Tensor:
    # t = z / sqrt(chi2 / df), chi2 from a sum of df squared normals (df integer here).
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g)
    chi2 = (torch.randn(int(df), n, generator=g) ** 2).sum(0)
    return z / torch.sqrt(chi2 / df)


def with_outliers(n: int, seed: int = 0, every: int = 1000, size: float = 100.0) -> torch.Tensor:
    x = gaussian(n, seed)
    x[::every] *= size
    return x
