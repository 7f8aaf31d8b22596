"""The stage cut: chained stages equal the unsplit model; boundaries compress exactly."""

import dataclasses

import pytest
import torch

from agora_node.stages.manifest_files import load_manifest
from agora_node.stages.model import Stage, Transformer, build_stages, lm_loss

pytestmark = pytest.mark.timeout(120)


def small_manifest(rank: int):
    m = load_manifest("tiny")
    model = dataclasses.replace(
        m.model, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=128, seq_len=32, subspace_rank=rank
    )
    return dataclasses.replace(m, model=model)


def run_chain(stages, tokens, targets):
    """Forward/backward through the stages the way the swarm does it: only the
    boundary coefficients travel; gradients w.r.t. them travel back."""
    h, sent = None, []
    for stage in stages:
        h = stage(h, tokens)
        if not stage.is_last:
            c = stage.encode_boundary(h, tokens)
            received = c.detach().requires_grad_()
            sent.append((h, c, received))
            h = stages[stage.index + 1].decode_boundary(received, tokens)
    loss = lm_loss(h, targets)
    loss.backward()
    for _, c, received in reversed(sent):
        c.backward(received.grad)
    return loss, sent


@pytest.mark.parametrize("rank", [0, 8, 16])
def test_chained_stages_equal_unsplit_model(rank):
    m = small_manifest(rank)
    full, stages = Transformer(m), build_stages(m)
    tokens = torch.randint(0, m.model.vocab_size, (3, m.model.seq_len + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    ref = lm_loss(full(x), y)
    ref.backward()
    loss, _ = run_chain(stages, x, y)
    assert torch.allclose(loss, ref, atol=1e-5)
    full_params = dict(full.named_parameters())
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(full_params)  # the cut loses and duplicates nothing
    for stage in stages:
        for name, p in stage.named_parameters():
            torch.testing.assert_close(p, full_params[name])  # same deterministic init
            torch.testing.assert_close(p.grad, full_params[name].grad, atol=1e-6, rtol=1e-4)


def test_boundary_decodes_exactly_from_k_coefficients():
    m = load_manifest("tiny")  # real size: d=256, k=32
    stages = build_stages(m)
    # Train a few steps so the trainable parts are not at init.
    opt = torch.optim.AdamW([p for s in stages for p in s.parameters()], lr=1e-2)
    tokens = torch.randint(0, 256, (2, m.model.seq_len + 1))
    for _ in range(3):
        opt.zero_grad()
        run_chain(stages, tokens[:, :-1], tokens[:, 1:])
        opt.step()
    _, sent = run_chain(stages, tokens[:, :-1], tokens[:, 1:])
    for (x, c, _), receiver in zip(sent, stages[1:], strict=True):
        assert c.shape[-1] == m.model.subspace_rank
        rebuilt = receiver.decode_boundary(c.detach(), tokens[:, :-1])
        assert (rebuilt - x.detach()).abs().max().item() <= 1e-5


def test_k_dim_gradient_equals_full_dimensional_gradient():
    m = small_manifest(8)
    s0, s1 = Stage(m, 0), Stage(m, 1)
    tokens = torch.randint(0, m.model.vocab_size, (2, m.model.seq_len))
    # Full-dimensional path: x travels as is.
    x = s0(None, tokens)
    x_recv = x.detach().requires_grad_()
    s1(x_recv, tokens).square().mean().backward()
    x.backward(x_recv.grad)
    full_grads = {n: p.grad.clone() for n, p in s0.named_parameters()}
    s0.zero_grad(), s1.zero_grad()
    # k-dim path: only c = (x - T) U and dL/dc = dL/dx U travel.
    x = s0(None, tokens)
    c = s0.encode_boundary(x, tokens)
    c_recv = c.detach().requires_grad_()
    s1(s1.decode_boundary(c_recv, tokens), tokens).square().mean().backward()
    torch.testing.assert_close(c_recv.grad, x_recv.grad @ s0.basis, atol=1e-7, rtol=1e-4)
    c.backward(c_recv.grad)
    for name, p in s0.named_parameters():
        torch.testing.assert_close(p.grad, full_grads[name], atol=1e-7, rtol=1e-4)


def test_stage_built_alone_is_deterministic():
    m = small_manifest(8)
    a, b = Stage(m, 2), Stage(m, 2)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    # Fixed tables are recomputed from the seed, never part of transferred state.
    assert "fixed_table" not in a.state_dict() and "basis" not in a.state_dict()
