"""stage_costs and stage_memory_bytes against what torch actually does on real stages."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from agora_node.protocol.manifest import InnerSpec, Manifest, ModelSpec, StageSpec
from agora_node.stages.manifest_files import load_manifest
from agora_node.stages.memory import stage_memory_bytes, stage_param_count
from agora_node.stages.model import Stage, count_parameters, lm_loss
from agora_node.stages.optim import InnerOptimizer
from agora_node.stages.placement import stage_costs, stage_flops_per_token

pytestmark = pytest.mark.timeout(60)

TINY = load_manifest("tiny")
DENSE_UNEVEN = Manifest(
    model=ModelSpec(
        d_model=64, n_layers=5, n_heads=4, n_kv_heads=2, ffn_dim=96, seq_len=16, subspace_rank=0
    ),
    stages=StageSpec(count=3, layers=(2, 1, 2)),
    inner=InnerSpec(micro_batch=2, local_batch=2),
)
SUBSPACE_UNEVEN = Manifest(
    model=ModelSpec(
        d_model=64, n_layers=5, n_heads=4, n_kv_heads=2, ffn_dim=96, seq_len=16, subspace_rank=8
    ),
    stages=StageSpec(count=3, layers=(1, 3, 1)),
    inner=InnerSpec(micro_batch=2, local_batch=2),
)
LONG = load_manifest("long")  # keys and values from a mixture of subspaces
LONG_SHORT = Manifest(
    model=ModelSpec(**{**LONG.model.__dict__, "seq_len": 128}),
    stages=LONG.stages,
    inner=LONG.inner,
)
MANIFESTS = [TINY, DENSE_UNEVEN, SUBSPACE_UNEVEN, LONG_SHORT]


def stages_of(manifest: Manifest):
    return [(manifest, s) for s in range(manifest.num_stages)]


ALL_STAGES = [pair for m in MANIFESTS for pair in stages_of(m)]


def _input(manifest: Manifest, stage: int):
    m = manifest.model
    tokens = torch.randint(0, m.vocab_size, (manifest.inner.micro_batch, m.seq_len))
    x = None if stage == 0 else torch.randn(*tokens.shape, m.d_model, requires_grad=True)
    return x, tokens


@pytest.mark.parametrize(("manifest", "stage"), ALL_STAGES)
def test_param_count_matches_the_real_stage(manifest: Manifest, stage: int) -> None:
    assert stage_param_count(manifest, stage) == count_parameters(Stage(manifest, stage))


@pytest.mark.parametrize(("manifest", "stage"), ALL_STAGES)
def test_matmul_flops_match_torchs_count(manifest: Manifest, stage: int) -> None:
    """Our FLOPs minus the attention term we add = what torch counts for the matmuls."""
    m = manifest.model
    x, tokens = _input(manifest, stage)
    module = Stage(manifest, stage)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        module(x, tokens)
    counted = counter.get_flop_counts()["Global"]
    matmuls = sum(v for k, v in counted.items() if "mm" in str(k))
    attention = 2 * m.d_model * m.seq_len * len(manifest.stage_layers(stage))
    per_token = stage_flops_per_token(manifest, stage) - attention
    assert matmuls / tokens.numel() == pytest.approx(per_token, rel=1e-6)


def test_costs_are_normalized_and_follow_the_cut() -> None:
    costs = stage_costs(TINY)
    assert sum(costs) / len(costs) == pytest.approx(1.0)
    assert costs[1] == pytest.approx(costs[2])  # identical middle stages
    assert costs[3] > costs[1]  # full-rank last blocks and the head
    uneven = stage_costs(SUBSPACE_UNEVEN)
    assert uneven[1] > 2.5 * uneven[0]


@pytest.mark.parametrize(("manifest", "stage"), ALL_STAGES)
def test_activation_estimate_matches_saved_tensors(manifest: Manifest, stage: int) -> None:
    module = Stage(manifest, stage)
    x, tokens = _input(manifest, stage)
    estimate = stage_memory_bytes(manifest, stage)["activation_bytes"]
    assert estimate == pytest.approx(_saved_bytes(module, x, tokens), rel=0.05)


def _saved_bytes(module: Stage, x, tokens, context=None) -> int:  # noqa: ANN001
    """Bytes autograd keeps for backward of one forward (parameters and buffers excluded)."""
    owned = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in owned:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x, tokens, context)
        if module.is_last:
            lm_loss(out, tokens)
    return sum(saved.values())


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_optimizer_state_matches_the_inner_optimizer(optimizer: str) -> None:
    manifest = Manifest(
        model=TINY.model,
        stages=TINY.stages,
        inner=InnerSpec(optimizer=optimizer, micro_batch=1, local_batch=1),
    )
    module = Stage(manifest, 0)
    opt = InnerOptimizer(module, manifest.inner)
    x, tokens = _input(manifest, 0)
    module(x, tokens).square().mean().backward()
    opt.step()
    state_bytes = sum(
        t.nbytes
        for o in opt.optimizers
        for s in o.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.ndim > 0
    )
    memory = stage_memory_bytes(manifest, 0, optimizer=optimizer)
    assert memory["optimizer_bytes"] == state_bytes


def test_memory_parts_add_up_and_scale() -> None:
    memory = stage_memory_bytes(TINY, 3)
    params = count_parameters(Stage(TINY, 3))
    assert memory["params"] == params
    assert memory["param_bytes"] == memory["version_bytes"] == memory["grad_bytes"] == 4 * params
    # anchor + outer momentum on the host, and with overlapped rounds (TINY's) the weights
    # at the round's end and at the eager step, kept while the mixes run
    assert TINY.outer.overlap and memory["outer_bytes"] == 16 * params
    blocking = dataclasses.replace(TINY, outer=dataclasses.replace(TINY.outer, overlap=False))
    assert stage_memory_bytes(blocking, 3)["outer_bytes"] == 8 * params
    on_device = ("param", "version", "grad", "optimizer", "buffer")
    peak = max(memory["activation_bytes"], memory["step_bytes"])  # never at once
    assert memory["device_bytes"] == sum(memory[f"{k}_bytes"] for k in on_device) + peak
    assert memory["total_bytes"] == memory["device_bytes"] + memory["outer_bytes"]
    buffers = sum(b.nbytes for b in Stage(TINY, 3).buffers())
    assert memory["buffer_bytes"] == buffers
    half = stage_memory_bytes(TINY, 3, dtype_bytes=2)
    assert half["param_bytes"] == 2 * params
    two = stage_memory_bytes(TINY, 3, in_flight=2)
    assert two["activation_bytes"] == 2 * memory["activation_bytes"]
    with pytest.raises(ValueError):
        stage_memory_bytes(TINY, 0, optimizer="sgd")


def test_gpu_manifest_is_sized_without_building_it() -> None:
    manifest = load_manifest("gpu-1b")
    total = sum(stage_param_count(manifest, s) for s in range(manifest.num_stages))
    assert 0.7e9 < total < 1.3e9
    assert stage_memory_bytes(manifest, 0)["total_bytes"] > 16 * stage_param_count(manifest, 0)


@pytest.mark.parametrize(
    ("kv_rank", "kv_tokens", "kv_compress"),
    [(0, False, "all"), (8, False, "all"), (8, True, "all"), (8, False, "remote")],
)
@pytest.mark.parametrize("stage", [0, 3])
def test_a_cell_members_activation_estimate_matches_its_saved_tensors(
    kv_rank: int, kv_tokens: bool, kv_compress: str, stage: int
) -> None:
    """One member of a cell of 2 (its chunk, the whole sequence's K/V) against torch."""
    from concurrent.futures import ThreadPoolExecutor

    from agora_node.stages.context_parallel import CellContext, ChunkLayout, LocalCell
    from agora_node.stages.kv_frames import FramedExchange
    from agora_node.stages.model import AttentionContext

    spec = ModelSpec(
        **{
            **LONG.model.__dict__,
            "seq_len": 256,
            "kv_rank": kv_rank,
            "kv_tokens": kv_tokens,
            "kv_compress": kv_compress,
        }
    )
    manifest = Manifest(model=spec, stages=LONG.stages, inner=LONG.inner)
    module = Stage(manifest, stage)
    x, tokens = _input(manifest, stage)
    layout, cell = ChunkLayout(spec.seq_len, 2), LocalCell(2, timeout_s=30)

    def member(rank: int) -> int:
        context = AttentionContext(cell=CellContext(layout, FramedExchange(cell.member(rank))))
        chunk = layout.take(tokens, rank)
        return _saved_bytes(module, None if x is None else layout.take(x, rank), chunk, context)

    with ThreadPoolExecutor(2) as pool:
        measured = list(pool.map(member, range(2)))
    estimate = stage_memory_bytes(manifest, stage, cp_degree=2)["activation_bytes"]
    alone = stage_memory_bytes(manifest, stage)["activation_bytes"]
    assert estimate < 0.6 * alone
    for bytes_ in measured:
        assert estimate == pytest.approx(bytes_, rel=0.05)
