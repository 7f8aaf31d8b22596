"""Walsh-Hadamard transform and the seeded random-sign rotation."""

from __future__ import annotations

import pytest
import torch

from agora_node.compression.hadamard import fwht, random_signs, rotate, unrotate

pytestmark = pytest.mark.timeout(60)

_M64 = (1 << 64) - 1


def sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def splitmix_signs(seed: int, n: int) -> list[float]:
    """Plain-integer splitmix64 reference for the wire-contract sign vector."""
    out = []
    for i in range(1, n + 1):
        z = (seed + i * 0x9E3779B97F4A7C15) & _M64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        z ^= z >> 31
        out.append(-1.0 if z >> 63 else 1.0)
    return out


@pytest.mark.parametrize("n", [1, 2, 4, 8, 32, 512])
def test_fwht_is_normalized_sylvester_matrix(n: int) -> None:
    eye = torch.eye(n, dtype=torch.float64)
    torch.testing.assert_close(fwht(eye), sylvester(n).double() / n**0.5)


@pytest.mark.parametrize("shape", [(7, 256), (2, 3, 64), (1,), (5, 1024)])
def test_unrotate_inverts_rotate(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    y = rotate(x, seed=42)
    torch.testing.assert_close(unrotate(y, seed=42), x, atol=1e-5, rtol=1e-5)
    # Orthonormal: norms of every block are preserved.
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), atol=1e-4, rtol=1e-5)


def test_wrong_seed_does_not_invert() -> None:
    x = torch.randn(4, 64)
    assert not torch.allclose(unrotate(rotate(x, 1), 2), x, atol=1e-3)


def test_signs_follow_splitmix64_reference() -> None:
    for seed in (0, 1, 12345, _M64):
        assert random_signs(seed, 64).tolist() == splitmix_signs(seed, 64)
    # Pinned: a change here breaks decoding of frames from peers running the old code.
    assert random_signs(0, 8).tolist() == [-1.0, 1.0, 1.0, -1.0, 1.0, 1.0, 1.0, -1.0]


def test_negative_seed_is_taken_mod_2_64() -> None:
    assert torch.equal(random_signs(-1, 32), random_signs(_M64, 32))


def test_rotation_spreads_a_spike_evenly() -> None:
    x = torch.zeros(256)
    x[17] = 100.0
    y = rotate(x, seed=9)
    torch.testing.assert_close(y.abs(), torch.full((256,), 100.0 / 16))


def test_non_power_of_two_block_is_rejected() -> None:
    with pytest.raises(ValueError, match="power of two"):
        fwht(torch.zeros(3, 12))
