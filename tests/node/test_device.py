"""--device and --precision: names, what this machine resolves them to, a stage worker
under bf16 autocast, and the one-line refusal of a stage the device cannot hold.

The CUDA tests are marked `gpu` and skip with the reason where torch sees no CUDA
device (this project's CI machines have none)."""

import math

import pytest
import torch

from agora_node.node.train_local import LocalTrainConfig, LocalTrainer
from agora_node.node.worker import StageWorker
from agora_node.stages import memory
from agora_node.stages.device import (
    CPU,
    Compute,
    DeviceError,
    check_names,
    resolve_device,
    resolve_precision,
)
from agora_node.stages.manifest_files import load_manifest

pytestmark = pytest.mark.timeout(120)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")


def test_device_and_precision_names_are_checked():
    for good in ("auto", "cpu", "cuda", "cuda:0", "cuda:12", "mps"):
        check_names(good, "auto")
    for bad in ("tpu", "cuda:", "cuda:x", "CPU", "gpu", ""):
        with pytest.raises(DeviceError, match="--device must be one of"):
            check_names(bad, "auto")
    with pytest.raises(DeviceError, match="--precision must be one of"):
        check_names("cpu", "fp16")


def test_auto_picks_the_best_device_this_machine_has():
    best = "cuda:0" if torch.cuda.is_available() else None
    if best is None:
        best = "mps" if torch.backends.mps.is_available() else "cpu"
    assert resolve_device("auto") == best
    assert resolve_device("cpu") == "cpu"
    assert Compute.resolve("cpu", "auto") == Compute("cpu", "fp32")  # bf16 autocast: CUDA only


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_device_the_machine_lacks_is_an_error_not_a_fallback():
    for name in ("cuda", "cuda:1"):
        with pytest.raises(DeviceError, match="torch sees no CUDA device.*--device cpu"):
            resolve_device(name)


def test_precision_follows_the_device():
    assert resolve_precision("cpu", "auto") == "fp32"
    assert resolve_precision("cpu", "bf16") == "bf16"
    assert resolve_precision("cpu", "fp32") == "fp32"
    assert Compute("cpu", "bf16").autocast().fast_dtype == torch.bfloat16
    assert not CPU.autocast()._enabled


def _simulated_cuda(monkeypatch, capabilities: dict[str, tuple[int, int]]) -> None:
    """torch.cuda as a machine with these cards would answer (no GPU needed): bf16 works
    everywhere, emulated below 8.0, as torch 2.13's is_bf16_supported() says by default."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(capabilities))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(
        torch.cuda, "get_device_capability", lambda device=None: capabilities[str(device)]
    )


def test_auto_precision_is_bf16_only_where_the_card_computes_it_natively(monkeypatch):
    # a T4 (7.5) emulates bf16: slower than fp32, and attention then falls back to a
    # kernel that holds the whole score matrix; an A100 (8.0) computes it natively
    _simulated_cuda(monkeypatch, {"cuda:0": (8, 0), "cuda:1": (7, 5)})
    assert Compute.resolve("cuda:0", "auto").precision == "bf16"
    assert Compute.resolve("cuda:1", "auto").precision == "fp32"  # the card asked about
    assert Compute.resolve("cuda:1", "bf16").precision == "bf16"  # asked for: allowed


def test_free_memory_counts_what_the_allocator_holds_cached(monkeypatch):
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * gib, 24 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 10 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 7 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 9 * gib)
    gpu = Compute("cuda:0", "bf16")
    assert gpu.free_bytes() == 5 * gib  # 2 free on the card + 3 cached, unused
    assert gpu.memory_status() == {
        "allocated": 7 * gib, "reserved": 10 * gib, "peak_allocated": 9 * gib
    }  # fmt: skip
    assert CPU.free_bytes() is None and CPU.memory_status() is None


def test_releasing_memory_collects_cycles_and_empties_the_cuda_cache(monkeypatch):
    import gc
    import weakref

    emptied: list[bool] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))

    class Held:  # what a closed stage leaves: an optimizer in a reference cycle
        pass

    held = Held()
    held.me = held
    gone = weakref.ref(held)
    del held
    gc.disable()
    try:
        assert gone() is not None  # only the cycle collector frees it
        Compute("cuda:0", "bf16").release_memory()
        assert gone() is None and emptied == [True]
        CPU.release_memory()
        assert emptied == [True]  # no CUDA call on the CPU
    finally:
        gc.enable()


def test_out_of_memory_halves_the_graphs_kept_and_is_counted():
    worker = StageWorker(load_manifest("tiny"), 1, max_graphs=8)
    try:
        worker.out_of_memory()
        worker.out_of_memory()
        assert worker.max_graphs == 2 and worker.stats.out_of_memory == 2
    finally:
        worker.close()


def _one_micro_batch(workers, tokens):
    """Forward through every stage, loss and backward; the host tensors each hop returned."""
    c, sent = None, []
    for w in workers[:-1]:
        c = w.forward("mb", c, tokens)
        sent.append(c)
    loss, grad = workers[-1].forward_backward_last(c, tokens, 1.0)
    for w in reversed(workers[:-1]):
        sent.append(grad)
        grad = w.backward("mb", grad)
    return loss, [t for t in sent if t is not None]


def test_bf16_autocast_workers_train_like_fp32_and_hand_the_wire_fp32_host_tensors():
    m = load_manifest("tiny")
    tokens = torch.randint(0, m.model.vocab_size, (m.inner.micro_batch, m.model.seq_len + 1))
    results = {}
    for precision in ("fp32", "bf16"):
        workers = [
            StageWorker(m, s, compute=Compute("cpu", precision)) for s in range(m.num_stages)
        ]
        for w in workers:
            w.micro_per_step = 1  # step after this micro-batch
        loss, crossed = _one_micro_batch(workers, tokens)
        assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in crossed)
        assert all(torch.isfinite(t).all() for t in crossed)
        assert all(w.stats.steps == 1 for w in workers)
        masters = [p for w in workers for p in w.masters]
        assert all(p.dtype == torch.float32 for p in masters)  # fp32 master weights
        results[precision] = loss, crossed
    (loss32, sent32), (loss16, sent16) = results["fp32"], results["bf16"]
    assert loss16 != loss32  # autocast really ran in bf16 ...
    assert abs(loss16 - loss32) / loss32 < 0.01  # ... and only changed rounding
    for a, b in zip(sent32, sent16, strict=True):
        assert (a - b).norm() / a.norm() < 0.05


def test_the_reference_trainer_runs_under_bf16_autocast_and_learns():
    # one layer of tiny: bf16 matmuls are emulated on most CPUs (all of tiny took 80 s)
    from agora_node.protocol.manifest import parse_manifest

    text = load_manifest("tiny").to_toml().replace("n_layers = 8", "n_layers = 1")
    m = parse_manifest(text.replace("count = 4", "count = 1"))
    trainer = LocalTrainer(
        m, LocalTrainConfig(steps=4, eval_samples=2, compute=Compute("cpu", "bf16"))
    )
    losses = [trainer.train_step() for _ in range(4)]
    assert losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())


def test_a_stage_the_device_cannot_hold_is_refused_in_one_line():
    m = load_manifest("gpu-1b")
    need = memory.stage_device_bytes(m, 1)  # weights, optimizer, one micro-batch's graph
    enough = math.ceil(need / memory.MEMORY_HEADROOM)
    assert memory.does_not_fit(m, 1, "cuda:0", None) is None  # memory not probed: no claim
    assert memory.does_not_fit(m, 1, "cuda:0", enough) is None
    reason = memory.does_not_fit(m, 1, "cuda:0", enough - 1024)
    assert reason is not None and "\n" not in reason
    assert "stage 1 needs about" in reason and "cuda:0" in reason and "--device cpu" in reason


@pytest.mark.gpu
@needs_cuda
def test_a_worker_on_cuda_computes_what_the_cpu_worker_computes():
    m = load_manifest("tiny")
    tokens = torch.randint(0, m.model.vocab_size, (m.inner.micro_batch, m.model.seq_len + 1))
    out = {}
    for device in ("cpu", "cuda:0"):
        workers = [StageWorker(m, s, compute=Compute(device, "fp32")) for s in range(m.num_stages)]
        loss, crossed = _one_micro_batch(workers, tokens)
        assert all(t.device.type == "cpu" for t in crossed)  # the wire sees host tensors
        state = workers[1].state_dict()
        assert all(t.device.type == "cpu" for t in state["model"].values())
        out[device] = loss, crossed, workers[1].parameter_checksum()
    assert abs(out["cpu"][0] - out["cuda:0"][0]) < 1e-3
    for a, b in zip(out["cpu"][1], out["cuda:0"][1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@needs_cuda
def test_bf16_autocast_on_cuda_learns():
    m = load_manifest("tiny")
    compute = Compute.resolve("cuda", "bf16")
    trainer = LocalTrainer(m, LocalTrainConfig(steps=4, eval_samples=2, compute=compute))
    losses = [trainer.train_step() for _ in range(4)]
    assert losses[-1] < losses[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_join_on_a_missing_device_is_one_line_and_exit_2_before_the_identity(tmp_path, capsys):
    from agora_node.node.cli import main

    peer = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWJTjvve5CHTecvRiyBZSEgRN7cHWUDhThRpcBxcUEb3xX"
    argv = ["join", "--initial-peers", peer, "--data-dir", str(tmp_path / "d")]
    assert main([*argv, "--device", "cuda:1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("agora-node: error: --device cuda:1: ")
    assert not (tmp_path / "d" / "identity.key").exists()


def test_a_device_keeps_as_many_graphs_as_its_free_memory_holds_and_recomputes_the_rest():
    m = load_manifest("gpu-1b")
    one = memory.stage_device_bytes(m, 1)
    per_graph = memory.stage_device_bytes(m, 1, in_flight=2) - one
    assert per_graph > 0
    for graphs in (0, 1, 5):
        free = math.ceil((one + graphs * per_graph) / memory.MEMORY_HEADROOM) + 1
        assert memory.graph_budget(m, 1, free, most=16) == graphs
    assert memory.graph_budget(m, 1, 10**15, most=16) == 16  # capped
    assert memory.graph_budget(m, 1, None, most=16) == 16  # not probed: the default
    # A 24 GiB card holds a middle stage of gpu-1b (1B parameters in 6 stages) with a few
    # graphs, though all 16 micro-batches of an inner step would need 79 GiB.
    card = 24 * 2**30
    assert memory.does_not_fit(m, 1, "cuda:0", card) is None
    assert 0 < memory.graph_budget(m, 1, card, most=16) < 16
    assert memory.stage_device_bytes(m, 1, in_flight=16) > card


def test_a_micro_batch_that_runs_the_device_out_of_memory_is_answered_busy(monkeypatch):
    import asyncio

    from agora_node.comms.pipeline_wire import (
        ForwardHeader,
        Status,
        decode_response,
        encode_forward,
    )
    from agora_node.compression import ActivationCodec
    from agora_node.node.config import PipelineConfig
    from agora_node.node.pipeline import Pipeline

    m = load_manifest("tiny")
    worker = StageWorker(m, m.num_stages - 1, max_graphs=8)

    def out_of_memory(*_args):  # noqa: ANN202
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(worker, "forward_backward_last", out_of_memory)
    p = Pipeline(m, worker, None, "me", lambda s: [], PipelineConfig())
    b, s, w = m.inner.micro_batch, m.model.seq_len, worker.stage.boundary_width
    header = ForwardHeader(
        run_id=m.run_id, mb_id="x", stage=worker.index, batch=b, seq=s, width=w,
        loss_scale=m.inner.micro_batch / m.inner.local_batch,
    )  # fmt: skip
    tokens = torch.zeros(b, s + 1, dtype=torch.long)
    data = encode_forward(header, tokens, ActivationCodec().encode(torch.zeros(b, s, w)))

    async def ask() -> bytes:
        return b"".join([chunk async for chunk in p.handle("upstream", data)])

    try:
        reply, _ = decode_response(asyncio.run(ask()))
        # busy: the sender tries another replica; this node keeps fewer graphs from now on
        assert reply.status == Status.BUSY.value and "out of device memory" in reply.message
        assert p.stats.rejected_codes == {"out_of_memory": 1}
        assert worker.max_graphs == 4 and worker.stats.out_of_memory == 1
    finally:
        worker.close()
