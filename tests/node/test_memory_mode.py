"""The consumer-GPU memory mode and the memory estimate: 8-bit AdamW moments track float32
AdamW, hold what the estimate says, and a stage worker allocates what the estimate says
(torch's own allocation events, through bench/memory.py's measurement)."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from agora_node.node.train_local import LocalTrainConfig, LocalTrainer
from agora_node.stages import memory
from agora_node.stages.device import Compute
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


@pytest.mark.parametrize("mode", ["fp32", "8bit"])
@pytest.mark.parametrize("stage", [0, 3])
def test_the_device_estimate_is_within_15_percent_of_what_a_worker_allocates(stage, mode):
    bench = _memory_bench()
    m = load_manifest("tiny")
    n_micro = m.inner.local_batch // m.inner.micro_batch
    measured, _ = bench.measure(m, stage, 2, mode)
    last = stage == m.num_stages - 1
    estimate = memory.stage_memory_bytes(
        m, stage, in_flight=1 if last else n_micro, optimizer_states=mode
    )["device_bytes"]
    assert abs(estimate / measured - 1) < 0.15, (estimate, measured)
