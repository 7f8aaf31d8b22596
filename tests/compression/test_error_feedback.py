"""ErrorFeedback: the sum of decoded updates tracks the true sum over many rounds.

Guarantee: after any number of rounds, sum(decoded) = sum(true) - residual, and the residual
is a single round's quantization error (per element at most half a step, rotation aside).
Without feedback the errors add up like a random walk, or worse, when they are biased.
"""

from __future__ import annotations

import pytest
import torch

from agora_node.compression import Codec, ErrorFeedback, dequantize, quantize, relative_error

pytestmark = pytest.mark.timeout(60)

N = 1 << 14
ROUNDS = 50


def run_rounds(
    codec: Codec, seed: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ErrorFeedback]:
    g = torch.Generator().manual_seed(0)
    drift = 0.3 * torch.randn(N, generator=g)  # pseudo-gradients share a direction over rounds
    ef = ErrorFeedback(codec, seed=seed)
    true, with_ef, without = torch.zeros(N), torch.zeros(N), torch.zeros(N)
    for _ in range(ROUNDS):
        delta = drift + torch.randn(N, generator=g)
        true += delta
        with_ef += dequantize(ef.compress("layer.weight", delta))
        without += dequantize(quantize(delta, codec, seed=seed))
    return true, with_ef, without, ef


@pytest.mark.parametrize(
    ("codec", "limit"), [(Codec.INT8, 0.001), (Codec.INT4, 0.015)], ids=["INT8", "INT4"]
)
@pytest.mark.parametrize("seed", [None, 0])
def test_sum_of_decoded_tracks_true_sum(codec: Codec, limit: float, seed: int | None) -> None:
    true, with_ef, without, ef = run_rounds(codec, seed)
    err_ef, err_plain = relative_error(true, with_ef), relative_error(true, without)
    assert err_ef < limit
    assert err_ef < 0.25 * err_plain
    # The identity behind it: what was not yet delivered is exactly the residual.
    residual = ef.residual("layer.weight")
    torch.testing.assert_close(
        with_ef + residual, true, atol=1e-4 * true.abs().max().item(), rtol=0
    )


def test_component_below_half_a_step_is_delivered_eventually() -> None:
    # Each block: one spike, and a small steady drift that int4 rounds to zero every time.
    delta = torch.full((1024,), 1e-3)
    delta[::256] = 1.0
    ef = ErrorFeedback(Codec.INT4, seed=None)
    sent_ef, sent_plain = torch.zeros(1024), torch.zeros(1024)
    for _ in range(ROUNDS):
        sent_ef += dequantize(ef.compress("w", delta))
        sent_plain += dequantize(quantize(delta, Codec.INT4))
    small = torch.ones(1024, dtype=torch.bool)
    small[::256] = False
    assert torch.equal(sent_plain[small], torch.zeros(int(small.sum())))
    step = 1.0 / 7
    assert bool(((sent_ef[small] - ROUNDS * 1e-3).abs() <= step / 2 + 1e-6).all())


def test_feedback_survives_a_fallback() -> None:
    ef = ErrorFeedback(Codec.INT4, seed=None, max_rel_error=0.01)
    x = torch.randn(4096)
    q = ef.compress("w", x)
    assert q.codec is Codec.BF16
    torch.testing.assert_close(dequantize(q) + ef.residual("w"), x)


def test_names_are_independent_and_reset_forgets() -> None:
    ef = ErrorFeedback(Codec.INT4)
    ef.compress("a", torch.randn(300))
    ef.compress("b", torch.randn(20, 5))
    assert ef.residual("a").shape == (300,) and ef.residual("b").shape == (20, 5)
    ef.reset("a")
    assert ef.residual("a") is None and ef.residual("b") is not None
    ef.reset()
    assert ef.residual("b") is None


def test_shape_change_under_one_name_is_a_bug() -> None:
    ef = ErrorFeedback()
    ef.compress("w", torch.randn(10))
    with pytest.raises(ValueError, match="residual"):
        ef.compress("w", torch.randn(11))


def test_input_is_not_modified() -> None:
    ef = ErrorFeedback(Codec.INT4)
    x = torch.randn(512)
    original = x.clone()
    ef.compress("w", x)
    ef.compress("w", x)
    assert torch.equal(x, original)
