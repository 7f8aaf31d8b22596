"""What serving a stage costs in memory, and what a device can hold (pure arithmetic).

- `stage_memory_bytes`: by part, what a stage worker holds on its device and the outer
  state on the host (`--dry-run` prints it; bench/memory.py checks it against torch's
  allocations);
- `does_not_fit` / `stages_that_fit`: a stage against a device's free memory (the
  choice of `--stage auto` and the refusal of `--stage N`);
- `graph_budget`: how many in-flight micro-batches' graphs a worker keeps there.
"""

from __future__ import annotations

import math

from agora_node.protocol.manifest import InnerSpec, Manifest, ModelSpec
from agora_node.stages.device import PLAIN, OptimizerMode


def _block_matrices(spec: ModelSpec, constrained: bool) -> list[int]:
    """Values in each weight matrix of one block (q, k, v, out, gate, up, down, and the
    K/V subspace bases when kv_rank > 0)."""
    d, kv, f = spec.d_model, spec.n_kv_heads * spec.head_dim, spec.ffn_dim
    out = spec.subspace_rank if constrained else d
    return [
        d * d,
        d * kv,
        d * kv,
        d * out,
        d * f,
        d * f,
        f * out,
        d * spec.kv_subspaces * spec.kv_rank,
    ]


def _stage_tensors(manifest: Manifest, stage: int) -> tuple[list[int], list[int]]:
    """Values per tensor of `stage`: (hidden matrices, the rest: norm gains, embedding,
    head); Muon treats the two differently."""
    spec, last = manifest.model, manifest.num_stages - 1
    last_start = manifest.stage_layers(last).start
    hidden, other = [], []
    for i in manifest.stage_layers(stage):
        hidden += _block_matrices(spec, constrained=not manifest.dense and i < last_start)
        other += [spec.d_model, spec.d_model]  # the block's two norm gains
        if spec.kv_rank and spec.kv_tokens:
            other.append(spec.vocab_size * spec.d_model)  # the mixture's token table
    if stage == 0:
        other.append(spec.vocab_size * (spec.d_model if manifest.dense else spec.subspace_rank))
    if stage == last:
        other += [spec.d_model, spec.d_model * spec.vocab_size]  # final norm and head
    return hidden, other


def _stage_params(manifest: Manifest, stage: int) -> tuple[int, int]:
    """(hidden-matrix, other) parameter counts of `stage`."""
    hidden, other = _stage_tensors(manifest, stage)
    return sum(hidden), sum(other)


def _largest_tensor(manifest: Manifest, stage: int) -> int:
    """Values in the stage's largest parameter tensor (what an in-backward step holds)."""
    return max(max(tensors, default=0) for tensors in _stage_tensors(manifest, stage))


def stage_param_count(manifest: Manifest, stage: int) -> int:
    """Trainable parameters of `stage`, computed from the manifest alone."""
    return sum(_stage_params(manifest, stage))


def _activation_floats_per_token(manifest: Manifest, stage: int, cp_degree: int = 1) -> float:
    """Values autograd keeps per token for backward (counted from torch's saved tensors).

    With context parallelism (c > 1) a member keeps its own tokens' values (1/c of the
    sequence) plus, for keys and values, the whole sequence's: their source, K and V,
    and with a mixture of subspaces its coefficients and choices."""
    spec, last = manifest.model, manifest.num_stages - 1
    d, kv = spec.d_model, spec.n_kv_heads * spec.head_dim
    # Per block: norm inputs/outputs and linear inputs (9 d), K and V (2 kv), the
    # attention log-sum-exp (one per head), two RMS scales, and four ffn-wide SwiGLU tensors.
    per_block = 9 * d + 2 * kv + spec.n_heads + 2 + 4 * spec.ffn_dim
    # A mixture runs in a cell, and alone only when it compresses every token's sources.
    mixture = spec.kv_mixture_alone or (cp_degree > 1 and spec.kv_rank > 0)
    if cp_degree > 1 or mixture:
        # Whole-sequence part: the K/V source, K and V; a mixture adds its coefficients
        # spread over the subspaces and the (int64) choice index, 2 floats' worth each.
        whole = d + 2 * kv
        if mixture:
            whole += spec.kv_subspaces * spec.kv_rank + 2 * spec.kv_rank
        if mixture and spec.kv_tokens:
            # A token table: z minus its token's row is kept for the projection, and
            # the whole sequence's (int64) token ids for the lookup's backward.
            per_block += d
            whole += 2
        per_block = (per_block - whole) / cp_degree + whole
    floats = per_block * len(manifest.stage_layers(stage))
    if stage == last:
        floats += (3 * d + 1 + spec.vocab_size) / cp_degree  # final norm, head in, log-softmax
    return floats


def stage_memory_bytes(
    manifest: Manifest,
    stage: int,
    *,
    optimizer: str = "adamw",
    dtype_bytes: int = 4,
    in_flight: int = 1,
    cp_degree: int = 1,
    optimizer_states: str = "fp32",
    optimizer_step: str = "after-backward",
) -> dict[str, int]:
    """Memory to serve `stage` and train it with DiLoCo, by part, and the totals.

    What the stage worker holds on its device (`device_bytes`): the master weights,
    the forward's copy of them (weight versions, node/worker.py), the gradients on
    that copy, the optimizer state, and at the peak either the activations of
    `in_flight` micro-batches of micro_batch x seq_len tokens whose autograd graphs
    are kept until their backward, or the step's temporaries (the gradients summed
    into the masters, one weight copy, and the optimizer's scratch, about two of the
    largest tensor; measured by bench/memory.py where the step is the peak): the two
    never coexist, the larger counts. With `optimizer_step` `in-backward` each
    parameter steps as soon as its gradient is ready: the gradients and the step's
    temporaries are a few of the largest tensor, held beside the activations of the
    backward under way. With `cp_degree` c > 1 activations are one
    member's share of a cell (token ids: its chunk). The outer anchor and momentum
    (`outer_bytes`) live on the host; `total_bytes` = device_bytes + outer_bytes.
    `bench/memory.py` checks device_bytes against torch's allocations.
    """
    if optimizer not in ("adamw", "muon"):
        raise ValueError(f"optimizer must be adamw or muon, got {optimizer!r}")
    spec = manifest.model
    hidden, other = _stage_params(manifest, stage)
    params = hidden + other
    # AdamW keeps two moments; Muon keeps one momentum for hidden matrices, AdamW the rest.
    adam_values = params if optimizer == "adamw" else other
    muon_values = params - adam_values
    tokens = manifest.inner.micro_batch * spec.seq_len * in_flight
    token_ids = 8 * tokens * ((stage == 0) + (stage == manifest.num_stages - 1)) // cp_degree
    activations = (
        int(_activation_floats_per_token(manifest, stage, cp_degree) * tokens) * dtype_bytes
    )
    buffers = spec.seq_len * spec.head_dim  # RoPE cos and sin tables
    if not manifest.dense:
        buffers += 2 * spec.d_model * spec.subspace_rank + spec.vocab_size * spec.d_model
    weights = params * dtype_bytes
    in_backward = optimizer_step == "in-backward"
    largest = _largest_tensor(manifest, stage) * dtype_bytes
    out = {
        "params": params,
        "param_bytes": weights,
        "version_bytes": weights,
        "grad_bytes": largest if in_backward else weights,
        "optimizer_bytes": adam_state_bytes(adam_values, optimizer_states, dtype_bytes)
        + muon_values * dtype_bytes,
        "activation_bytes": activations + token_ids,
        "step_bytes": _IN_BACKWARD_SCRATCH * largest if in_backward else weights + 2 * largest,
        "buffer_bytes": buffers * 4,  # always float32
        # DiLoCo anchor + outer momentum, float32 on the host; overlapped rounds also keep the
        # weights at the round's end and at the eager step while the mixes run (rounds.py)
        "outer_bytes": (4 if manifest.outer.overlap else 2) * params * 4,
    }
    out["device_bytes"] = (
        out["param_bytes"]
        + out["version_bytes"]
        + out["grad_bytes"]
        + out["optimizer_bytes"]
        + (
            out["activation_bytes"] + out["step_bytes"]
            if in_backward
            else max(out["activation_bytes"], out["step_bytes"])
        )
        + out["buffer_bytes"]
    )
    out["total_bytes"] = out["device_bytes"] + out["outer_bytes"]
    return out


_IN_BACKWARD_SCRATCH = 4
"""An in-backward step's temporaries, in largest tensors: the float32 gradient, the moments
it updates (dequantized, for 8-bit states) and the update."""


def stage_device_bytes(
    manifest: Manifest, stage: int, mode: OptimizerMode = PLAIN, in_flight: int = 1
) -> int:
    """What the stage's device holds at its peak with `in_flight` autograd graphs kept.

    One graph is the least a worker can train with: past its graph budget it keeps a
    micro-batch's input only and recomputes the forward at backward time, one at a time
    (`graph_budget`), so a stage fits a device that holds it with one graph."""
    return stage_memory_bytes(
        manifest,
        stage,
        optimizer=manifest.inner.optimizer,
        in_flight=in_flight,
        optimizer_states=mode.states,
        optimizer_step=mode.step,
    )["device_bytes"]


MEMORY_HEADROOM = 0.9
"""Share of a device's free memory a stage plans to use (the allocator's fragmentation,
kernels' workspaces and the CUDA context take the rest)."""


def graph_budget(
    manifest: Manifest,
    stage: int,
    free_bytes: int | None,
    mode: OptimizerMode = PLAIN,
    *,
    most: int,
) -> int:
    """How many micro-batches' autograd graphs a worker keeps before it recomputes (the
    worker's `max_graphs`): as many as fit the free memory beside the weights, optimizer
    and the one graph a recompute builds, at most `most`; `most` when memory is not probed."""
    if free_bytes is None:
        return most
    one = stage_device_bytes(manifest, stage, mode, in_flight=1)
    two = stage_device_bytes(manifest, stage, mode, in_flight=2)
    per_graph = max(1, two - one)
    room = MEMORY_HEADROOM * free_bytes - one  # `one`: the recompute's graph, always needed
    return max(0, min(most, int(room // per_graph)))


def heads_in_flight(spec: InnerSpec) -> int:
    """Micro-batches a head keeps in flight unless told (`--max-in-flight 0`): one inner
    step's worth, so no gradient lands more than a step late; two steps' worth when the
    manifest turns on weight prediction, which is there to correct that staleness (with
    the Muon optimizer 4 in flight ended within 0.4% of 2 on tiny: docs/benchmarks.md)."""
    per_step = spec.local_batch // spec.micro_batch
    return 2 * per_step if spec.weight_prediction else per_step


def default_in_flight(manifest: Manifest, stage: int) -> int:
    """Micro-batches whose graphs a stage keeps at once with the daemons' defaults: what a
    head keeps in flight (`heads_in_flight`); the last stage keeps none past its backward."""
    if stage == manifest.num_stages - 1:
        return 1
    return heads_in_flight(manifest.inner)


def adam_state_bytes(values: int, states: str = "fp32", dtype_bytes: int = 4) -> int:
    """Bytes of AdamW's two moments for `values` parameters: `fp32` (dtype_bytes each) or
    `8bit` (one byte each and a float32 scale per block of 256: optim.AdamW8bit)."""
    if states == "8bit":
        return 2 * (values + 4 * math.ceil(values / 256))
    return 2 * values * dtype_bytes


def does_not_fit(
    manifest: Manifest,
    stage: int,
    device: str,
    free_bytes: int | None,
    mode: OptimizerMode = PLAIN,
) -> str | None:
    """Why `stage` cannot be held on a device with `free_bytes` free (None: fits, or the
    device's memory is not probed)."""
    if free_bytes is None:
        return None
    need = stage_device_bytes(manifest, stage, mode)
    if need <= MEMORY_HEADROOM * free_bytes:
        return None
    return (
        f"stage {stage} needs about {need / 2**30:.2f} GiB on {device} (with one micro-batch's "
        f"activations), which has {free_bytes / 2**30:.2f} GiB free ({MEMORY_HEADROOM:.0%} "
        "usable): free the device, pick a smaller stage with --stage, or compute on the CPU "
        "with --device cpu"
    )


def stages_that_fit(
    manifest: Manifest, free_bytes: int | None, mode: OptimizerMode = PLAIN
) -> list[int] | None:
    """The stages a device with `free_bytes` free can hold (None: every stage, the
    device's memory not being probed)."""
    if free_bytes is None:
        return None
    return [
        s
        for s in range(manifest.num_stages)
        if does_not_fit(manifest, s, "", free_bytes, mode) is None
    ]
