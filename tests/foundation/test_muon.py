"""The Muon inner optimizer (stages/optim.py): the orthogonalized update, which tensors it
steps, and that a checkpoint of it resumes the same run."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from agora_node.stages.manifest_files import load_manifest
from agora_node.stages.model import Stage
from agora_node.stages.optim import InnerOptimizer, Muon, orthogonalize

pytestmark = pytest.mark.timeout(60)

TINY = load_manifest("tiny")
MUON = dataclasses.replace(TINY, inner=dataclasses.replace(TINY.inner, optimizer="muon"))


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (48, 48), (256, 704)])
def test_orthogonalize_flattens_the_singular_values_and_keeps_the_directions(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    g = g @ torch.diag(torch.logspace(-1, 0, g.shape[1]))  # singular values spread 10x
    o = orthogonalize(g)
    assert o.shape == g.shape
    s = torch.linalg.svdvals(o)
    assert float(s.min()) > 0.6 and float(s.max()) < 1.2, s  # about 1, whatever g's spread
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    cosine = float((o * (u @ vh)).sum() / (o.norm() * (u @ vh).norm()))
    assert cosine > 0.9  # close to U V^T: the update keeps the gradient's directions


def test_a_muon_step_is_the_orthogonalized_nesterov_momentum_with_decoupled_decay():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(16, 32))
    start = p.detach().clone()
    lr, wd, mu = 0.02, 0.1, 0.95
    opt = Muon([p], lr=lr, momentum=mu, weight_decay=wd)
    g1, g2 = torch.randn(16, 32), torch.randn(16, 32)
    p.grad = g1.clone()
    opt.step()
    # buffer = g1; Nesterov update = orthogonalize(g1 + mu * g1); wide matrix: scale 1
    expected = start * (1 - lr * wd) - lr * orthogonalize(g1 * (1 + mu))
    torch.testing.assert_close(p.detach(), expected)
    p.grad = g2.clone()
    opt.step()
    buf = mu * g1 + g2
    expected = expected * (1 - lr * wd) - lr * orthogonalize(g2 + mu * buf)
    torch.testing.assert_close(p.detach(), expected)


@pytest.mark.parametrize("whole_model", [False, True])
def test_muon_steps_the_blocks_matrices_and_adamw_the_rest(whole_model):
    """A stage's parameters, or every stage's in one module as the reference trainer holds
    them (names `0.blocks.0.attn...`): the same matrices go to Muon."""
    stages = [Stage(MUON, s) for s in range(MUON.num_stages)]
    module = torch.nn.ModuleList(stages) if whole_model else stages[1]
    opt = InnerOptimizer(module, MUON.inner)
    adamw, muon = opt.optimizers
    assert isinstance(muon, Muon) and isinstance(adamw, torch.optim.AdamW)
    by_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    for stage in stages if whole_model else [module]:
        for name, p in stage.named_parameters():
            if not p.requires_grad:
                continue
            hidden = (
                p.ndim == 2 and name.startswith("blocks.") and not name.endswith("kv_mix.tokens")
            )
            assert (id(p) in by_muon) == hidden, name
    assert by_muon, "no matrix went to Muon"


def test_a_muon_checkpoint_resumes_the_same_run():
    def run(stage: Stage, opt: InnerOptimizer, seeds: range) -> None:
        for seed in seeds:
            g = torch.Generator().manual_seed(seed)
            for p in opt.params:
                p.grad = torch.randn(p.shape, generator=g) * 1e-2
            opt.step()
            opt.zero_grad()

    torch.manual_seed(0)
    straight = Stage(MUON, 1)
    resumed = Stage(MUON, 1)
    resumed.load_state_dict(straight.state_dict())
    opt = InnerOptimizer(straight, MUON.inner)
    run(straight, opt, range(2))
    saved_weights, saved_opt = copy.deepcopy((straight.state_dict(), opt.state_dict()))
    run(straight, opt, range(2, 4))
    resumed.load_state_dict(saved_weights)
    fresh = InnerOptimizer(resumed, MUON.inner)
    fresh.load_state_dict(saved_opt)
    assert fresh.steps == 2
    run(resumed, fresh, range(2, 4))
    for (name, a), b in zip(
        straight.state_dict().items(), resumed.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(a, b, msg=name)
