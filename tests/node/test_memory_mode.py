"""The consumer-GPU memory mode and the memory estimate: 8-bit AdamW moments track float32
AdamW, hold what the estimate says, and a stage worker allocates what the estimate says
(torch's own allocation events, through bench/memory.py's measurement); the optimizer
stepped in backward gives the weights of the plain step."""

import dataclasses
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from agora_node.node.errors import JoinError
from agora_node.node.joining import stages_fitting
from agora_node.node.train_local import LocalTrainConfig, LocalTrainer
from agora_node.node.worker import StageWorker
from agora_node.stages import memory
from agora_node.stages.device import OPTIMIZER_STEPS, Compute
from agora_node.stages.manifest_files import load_manifest
from agora_node.stages.optim import (
    AdamW8bit,
    InnerOptimizer,
    dequantize_blockwise,
    quantize_blockwise,
)

pytestmark = pytest.mark.timeout(180)


def _memory_bench():
    path = Path(__file__).resolve().parents[2] / "bench" / "memory.py"
    spec = importlib.util.spec_from_file_location("agora_bench_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_blockwise_float8_keeps_each_value_to_a_few_percent_across_its_block():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * torch.logspace(-3, 1, 1000)  # 4 decades in a block
    codes, scale = quantize_blockwise(x)
    assert codes.dtype == torch.float8_e4m3fn and codes.numel() == 1000
    assert scale.shape == (math.ceil(1000 / 256),)
    back = dequantize_blockwise(codes, scale, x)
    rel = ((back - x).abs() / x.abs()).max()
    assert rel < 0.07
    zeros = torch.zeros(300)
    assert torch.equal(dequantize_blockwise(*quantize_blockwise(zeros), zeros), zeros)


def test_8bit_adamw_tracks_fp32_adamw():
    torch.manual_seed(0)
    target = torch.randn(64, 32)
    x = torch.randn(512, 64)
    y = x @ target
    runs = {}
    for name, make in {
        "fp32": lambda ps: torch.optim.AdamW(ps, lr=3e-2, weight_decay=0.01),
        "8bit": lambda ps: AdamW8bit(ps, lr=3e-2, weight_decay=0.01),
    }.items():
        torch.manual_seed(1)
        w = torch.nn.Parameter(torch.randn(64, 32) * 0.1)
        opt = make([w])
        losses = []
        for _ in range(300):
            loss = ((x @ w - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        runs[name] = losses, w.detach()
    (l32, w32), (l8, w8) = runs["fp32"], runs["8bit"]
    assert l32[-1] < 1e-3 * l32[0] and l8[-1] < 1e-3 * l8[0]  # both converge ...
    assert (w8 - w32).norm() / w32.norm() < 0.02  # ... to the same weights (measured 0.3%)


def test_8bit_states_hold_what_the_estimate_says_and_checkpoints_say_their_format():
    m = load_manifest("tiny")
    states = {}
    for mode in ("fp32", "8bit"):
        trainer = LocalTrainer(
            m, LocalTrainConfig(steps=1, eval_samples=2, compute=Compute("cpu", "fp32", mode))
        )
        trainer.train_step()
        held = sum(
            t.nbytes
            for o in trainer.optimizer.optimizers
            for s in o.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor) and t.ndim > 0
        )
        expected = sum(
            memory.stage_memory_bytes(m, s, optimizer_states=mode)["optimizer_bytes"]
            for s in range(m.num_stages)
        )
        assert abs(held - expected) <= 8 * sum(1 for _ in trainer.model.parameters())  # padding
        states[mode] = trainer.optimizer.state_dict()
    assert states["8bit"]["states"] == "8bit"
    # A checkpoint of the other format: the steps survive, the moments start afresh.
    fresh = InnerOptimizer(LocalTrainer(m, LocalTrainConfig(steps=1)).model, m.inner, "8bit")
    fresh.load_state_dict(states["fp32"])
    assert fresh.steps == 1 and not fresh.optimizers[0].state


@pytest.mark.parametrize("mode", ["fp32", "8bit", "in-backward", "8bit+in-backward"])
@pytest.mark.parametrize("stage", [0, 3])
def test_the_device_estimate_is_within_15_percent_of_what_a_worker_allocates(stage, mode):
    bench = _memory_bench()
    m = load_manifest("tiny")
    compute = bench.compute_of(mode)
    if compute.optimizer_step == "in-backward":
        m = _stepping_every_micro_batch(m)
    n_micro = m.inner.local_batch // m.inner.micro_batch
    measured, _ = bench.measure(m, stage, 2, mode)
    last = stage == m.num_stages - 1
    estimate = memory.stage_memory_bytes(
        m,
        stage,
        in_flight=1 if last else n_micro,
        optimizer_states=compute.optimizer_states,
        optimizer_step=compute.optimizer_step,
    )["device_bytes"]
    assert abs(estimate / measured - 1) < 0.15, (estimate, measured)


def _stepping_every_micro_batch(manifest, **inner):
    """The manifest with one micro-batch per inner step (what in-backward needs)."""
    spec = dataclasses.replace(manifest.inner, local_batch=manifest.inner.micro_batch, **inner)
    return dataclasses.replace(manifest, inner=spec)


def _drive(worker: StageWorker, micro_batches: list, c_in, grads: list) -> None:
    """Micro-batches the way a daemon interleaves them (two in flight), with an outer step
    holding inner steps across the second's backward."""
    if worker.stage.is_last:
        for i, tokens in enumerate(micro_batches):
            if i == 1:
                worker._hold()
            worker.forward_backward_last(c_in, tokens, 1.0)
            if i == 1:
                worker._release(False)
        return
    a, b, c = micro_batches
    worker.forward("a", c_in, a)
    worker.forward("b", c_in, b)
    worker.backward("a", grads[0])
    worker._hold()
    worker.forward("c", c_in, c)
    worker.backward("b", grads[1])  # held: its gradient waits for the release
    worker._release(False)
    worker.backward("c", grads[2])


@pytest.mark.parametrize("states", ["fp32", "8bit"])
@pytest.mark.parametrize("stage", [0, 3])
def test_the_optimizer_in_backward_gives_the_weights_of_the_plain_step(stage, states):
    # unclipped (grad_clip far above the norms): per-tensor and whole-step clipping agree
    m = _stepping_every_micro_batch(load_manifest("tiny"), grad_clip=1e9)
    plain, fused = (
        StageWorker(m, stage, compute=Compute("cpu", "fp32", states, when))
        for when in OPTIMIZER_STEPS
    )
    fused.stage.load_state_dict(plain.stage.state_dict())
    fused.versions.publish(0)
    start = {n: p.detach().clone() for n, p in plain.stage.named_parameters()}
    stepped_in_backward = []
    step_param = fused.optimizer.step_param
    fused.optimizer.step_param = lambda p, g: stepped_in_backward.append(p) or step_param(p, g)
    g = torch.Generator().manual_seed(0)
    mb, seq, width = m.inner.micro_batch, m.model.seq_len, plain.stage.boundary_width
    tokens = [torch.randint(0, m.model.vocab_size, (mb, seq + 1), generator=g) for _ in range(3)]
    c_in = None if stage == 0 else torch.randn(mb, seq, width, generator=g)
    grads = [torch.randn(mb, seq, width, generator=g) * 1e-2 for _ in range(3)]
    try:
        for worker in (plain, fused):
            _drive(worker, tokens, c_in, grads)
        assert plain.stats.steps == fused.stats.steps == 3
        assert fused.optimizer.steps == plain.optimizer.steps == 3
        # every parameter stepped on its own for each micro-batch (the held one's at release)
        assert len(stepped_in_backward) == 3 * len(fused.masters)
        weights = dict(fused.stage.named_parameters())
        for name, p in plain.stage.named_parameters():
            assert not torch.equal(p, start[name]), name
            torch.testing.assert_close(weights[name], p, rtol=1e-5, atol=1e-7)
    finally:
        plain.close()
        fused.close()


def test_in_backward_clips_one_step_late_bounds_each_tensor_and_skips_non_finite():
    m = _stepping_every_micro_batch(load_manifest("tiny"))
    clip, beta1 = m.inner.grad_clip, m.inner.beta1
    model = torch.nn.Linear(4, 4)
    opt = InnerOptimizer(model, m.inner, when="in-backward")
    w, b = model.weight, model.bias
    first_moment = lambda p: opt._by_param[p][0].state[p]["exp_avg"]  # noqa: E731
    # first step: no earlier norm, so each tensor is held to grad_clip on its own
    assert opt.step_param(w, torch.full_like(w, 1e6))
    assert float(first_moment(w).norm()) == pytest.approx((1 - beta1) * clip, rel=1e-4)
    assert opt.finish_step() == pytest.approx(4e6)  # the step's norm, unclipped
    # next step: the factor the last step's norm called for, clip / 4e6
    small = torch.full_like(b, 0.1)
    assert opt.step_param(b, small)
    expected = (1 - beta1) * small * clip / 4e6
    torch.testing.assert_close(first_moment(b), expected, rtol=1e-4, atol=0)
    moved = w.detach().clone()
    assert not opt.step_param(w, torch.full_like(w, float("nan")))
    assert torch.equal(w.detach(), moved) and opt.skipped == 1
    assert w.grad is None and b.grad is None


def test_in_backward_is_refused_where_the_run_accumulates_micro_batches():
    m = load_manifest("tiny")
    assert m.inner.local_batch > m.inner.micro_batch
    in_backward = Compute("cpu", "fp32", "fp32", "in-backward")
    with pytest.raises(ValueError, match="accumulates 2 micro-batches"):
        StageWorker(m, 0, compute=in_backward)
    with pytest.raises(JoinError, match="--optimizer-step after-backward"):
        stages_fitting(m, in_backward)
    assert stages_fitting(_stepping_every_micro_batch(m), in_backward) is None


def test_the_local_trainer_steps_in_backward_to_the_same_weights():
    m = _stepping_every_micro_batch(load_manifest("tiny"), grad_clip=1e9)
    trainers = [
        LocalTrainer(
            m, LocalTrainConfig(steps=3, eval_samples=2, compute=Compute("cpu", "fp32", "fp32", w))
        )
        for w in OPTIMIZER_STEPS
    ]
    for trainer in trainers:
        for _ in range(3):
            trainer.train_step()
    plain, fused = (dict(t.model.named_parameters()) for t in trainers)
    assert trainers[1].optimizer.steps == 3
    for name, p in plain.items():
        torch.testing.assert_close(fused[name], p, rtol=1e-5, atol=1e-7)


def test_8bit_moments_stay_8bit_through_a_checkpoint():
    # torch casts floating state to the parameter's dtype on load: float32 codes would
    # hold the moments in four times the memory the option is chosen to save
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(300))
    opt = AdamW8bit([p], lr=1e-2)
    p.grad = torch.randn(300)
    opt.step()
    saved = {k: v for k, v in opt.state[p].items()}
    restored = AdamW8bit([p], lr=1e-2)
    restored.load_state_dict(opt.state_dict())
    state = restored.state[p]
    assert state["m_codes"].dtype == state["r_codes"].dtype == torch.float8_e4m3fn
    assert torch.equal(state["m_codes"].float(), saved["m_codes"].float())
    assert torch.equal(state["r_scale"], saved["r_scale"])
