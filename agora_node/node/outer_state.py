"""The settings and the state of one replica's outer steps (outer.py runs the rounds).

- `OuterConfig`: learning rate, momentum, group size and the codecs of the two mixes,
  from the manifest (`from_manifest`) or set directly by tests and benchmarks.
- `OuterState`: the anchor (the weights after the last outer step, but for what stays
  unsent with `unsent = "weights"`), the outer momentum and the
  round counter, as flat float32 vectors on the host, and the Nesterov outer step.
- `Weights`: where a round reads and writes the replica's weights (the stage worker's
  frozen view in the daemon, `ModuleWeights` elsewhere).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from agora_node.comms.collective import AggregationSpec, Deadlines, MatchmakingConfig, WireFormat
from agora_node.comms.collective.payload import ROTATION_SEEDS
from agora_node.protocol.codecs import CODEC_NAMES, DENSE_CODEC_NAMES, Codec, from_name
from agora_node.protocol.manifest import UNSENT, Manifest
from agora_node.stages.flat import host_flat, write_flat


@dataclass(frozen=True, kw_only=True)
class OuterConfig:
    lr: float = 0.7
    momentum: float = 0.9
    group_size: int = 4
    """Replicas per group (at least; 0 = everyone, plain DiLoCo)."""
    codec: str = "int8"
    """Pseudo-gradient parts on the wire (error feedback on for quantized codecs)."""
    result_codec: str | None = None
    """Mixed spans on the wire; default int8 after int8/int4, else the same as `codec`
    (topk4 results: the top 1/64 of each block of the mix)."""
    anchor_codec: str | None = None
    """Anchors on the wire; default fp32 with fp32 deltas, else bf16 (weights quantize badly)."""
    rank: int = 0
    """0: pseudo-gradients travel whole. r > 0: as rank-r factors of each weight matrix in
    two mixes (lowrank.py), encoded with `codec` (a dense one), no error feedback on the
    factors (the factorization keeps its own residual)."""
    unsent: str = "feedback"
    """"feedback": what a compressed part leaves out is added to the next round's part.
    "weights": it stays in this replica's weights (written as the new anchor less it), and
    the encoder keeps no residual (manifest `outer.unsent`)."""
    mix_momentum: bool = False
    """Also average the outer momentum in the anchor mix. It did not lower validation loss in
    bench/diloco.py (docs/outer.md), so it is off here; the daemon turns it on
    (from_manifest) because replicas whose momenta drifted apart never agree again without it."""
    consensus: float | None = None
    """None: the outer step starts from the anchor group's mean (the anchor is replaced by
    it). A number g: it starts from the replica's own anchor and the pull toward the mean,
    (anchor - mean) * g / lr, joins the pseudo-gradient in the momentum (NoLoCo-style).
    With one group of everyone both agree. An ablation (bench/diloco.py `--consensus`):
    over three sequences of gossip groups it did no better than adopting the mean
    (docs/benchmarks.md), so nothing sets it."""
    block: int = 256
    rotation_seed: int | None = 0
    aggregation: AggregationSpec = field(default_factory=AggregationSpec)
    verify_results: bool = False
    """Check each span's result against a second reducer before adopting it (verify.py):
    every part travels twice. The daemon turns it on (from_manifest); every member of
    a group must agree on it."""
    deadlines: Deadlines = field(default_factory=Deadlines)
    matchmaking: MatchmakingConfig = field(default_factory=MatchmakingConfig)

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"outer rank must be >= 0, not {self.rank}")
        if self.rotation_seed not in ROTATION_SEEDS:  # peers refuse frames rotated otherwise
            raise ValueError(f"rotation_seed must be one of {ROTATION_SEEDS} (payload.py)")
        if self.unsent not in UNSENT:
            raise ValueError(f"unsent must be one of {UNSENT}, not {self.unsent!r}")
        if self.unsent == "weights" and (self.rank or not from_name(self.codec).is_quantized):
            raise ValueError("unsent = weights needs a codec with error feedback and rank 0")
        if self.rank:
            from_name(self.codec, what="outer codec with rank > 0", allowed=DENSE_CODEC_NAMES)
        for name in ("codec", "result_codec", "anchor_codec"):
            value = getattr(self, name)
            if value is not None:  # anchors are weights: every value of them counts
                allowed = DENSE_CODEC_NAMES if name == "anchor_codec" else CODEC_NAMES
                from_name(value, what=f"outer {name}", allowed=allowed)

    @classmethod
    def from_manifest(cls, manifest: Manifest, **overrides: Any) -> OuterConfig:
        """The manifest's outer settings; `overrides` replace any field (tests, benches)."""
        o = manifest.outer
        cap = float(o.inner_steps * manifest.inner.local_batch * manifest.model.seq_len)
        fields = {
            "lr": o.lr,
            "momentum": o.momentum,
            "group_size": o.group_size,
            "codec": o.codec,
            "rank": o.rank,
            "anchor_codec": None if o.anchor_codec == "auto" else o.anchor_codec,
            "unsent": o.unsent,
            "verify_results": True,
            # Replicas whose momenta drifted apart (one mixed a round alone, e.g. at
            # start-up) otherwise never hold equal anchors again; mixing the momentum
            # with the anchor, which only happens when their digests differ, repairs it.
            "mix_momentum": True,
        }
        fields.update(overrides)
        aggregation = fields.get(
            "aggregation", AggregationSpec(method=o.aggregation, min_cosine=o.min_cosine)
        )
        fields["aggregation"] = replace(aggregation, max_weight=min(cap, aggregation.max_weight))
        return cls(**fields)

    def delta_format(self) -> WireFormat:
        part = from_name(self.codec)
        # A sparse part's mixed result stays sparse (the top of the mix); dense parts' go int8.
        default = Codec.INT8 if part.is_quantized and not part.is_sparse else part
        result = from_name(self.result_codec) if self.result_codec else default
        sparse = part.is_sparse or result.is_sparse  # a rotation would spread the top values
        return WireFormat(
            part=part,
            result=result,
            block=self.block,
            seed=None if sparse else self.rotation_seed,
            error_feedback=part.is_quantized,
        )

    def factor_format(self) -> WireFormat:
        """Both mixes of a low-rank round: the factors (and the whole vectors) in `codec`,
        results too, without error feedback (what they leave out of a matrix is in the
        factorization's residual; a factor's positions mean something else every round)."""
        codec = from_name(self.codec)
        return WireFormat(part=codec, result=codec, block=self.block, seed=self.rotation_seed)

    def anchor_format(self) -> WireFormat:
        default = Codec.FP32 if self.codec == "fp32" else Codec.BF16
        codec = from_name(self.anchor_codec) if self.anchor_codec else default
        return WireFormat(part=codec, result=codec, block=self.block, seed=self.rotation_seed)


NORM_CHUNK = 1 << 22
"""Values per chunk of `flat_norm` (float64 copies of a chunk, never of a whole stage)."""


def flat_norm(x: Tensor, minus: Tensor | None = None) -> float:
    """The L2 norm of a (flat) tensor, or of `x - minus`, accumulated in float64 a chunk at
    a time: exact enough for a stage's billions of values, finite up to float32's limit,
    and no stage-sized copy."""
    flat = x.reshape(-1)
    other = None if minus is None else minus.reshape(-1)
    total = 0.0
    for lo in range(0, flat.numel(), NORM_CHUNK):
        chunk = flat[lo : lo + NORM_CHUNK]
        if other is not None:
            chunk = chunk - other[lo : lo + NORM_CHUNK]
        total += float(torch.linalg.vector_norm(chunk, dtype=torch.float64)) ** 2
    return math.sqrt(total)


def within(other: Tensor, own: Tensor, radius: float) -> tuple[Tensor | None, float]:
    """`other` moved straight toward `own` until it is at most `radius` from it (L2), and
    how far it was; None when it is not finite. In chunks: a stage-sized copy is made only
    when it has to move."""
    flat, mine = other.reshape(-1), own.reshape(-1)
    total = 0.0
    for lo in range(0, flat.numel(), NORM_CHUNK):
        gap = flat[lo : lo + NORM_CHUNK].double() - mine[lo : lo + NORM_CHUNK].double()
        total += float(torch.linalg.vector_norm(gap)) ** 2
    far = math.sqrt(total)
    if not math.isfinite(far):
        return None, far
    if far <= radius:
        return other, far
    scale = radius / far
    moved = mine.float().clone()
    for lo in range(0, flat.numel(), NORM_CHUNK):
        hi = lo + NORM_CHUNK
        moved[lo:hi] += (flat[lo:hi].float() - mine[lo:hi]) * scale
    return moved.view_as(other), far


class OuterState:
    """Anchor, outer momentum and round counter of one replica's parameters."""

    def __init__(self, module: nn.Module, *, lr: float, momentum: float) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.lr, self.mu = lr, momentum
        self.anchor = self.weights()
        self.momentum = torch.zeros_like(self.anchor)
        self.round = 0
        """The stage's round this replica takes part in next."""
        self.anchor_round = 0
        """The round counter the anchor was made at: behind `round` after a catch-up
        (rounds.py jumps the counter, not the anchor), so that what a replica attests
        names the round that produced its anchor, never a later one."""
        self.warming = False
        self.rebuilding = 0
        """Rounds left until a momentum that started again from zero holds about what a
        running replica's does (1 / (1 - momentum) rounds): a joiner whose momentum was not
        attested, a replica reset to its weights. Meanwhile its own steps are smaller than
        its group's, and measuring the group by them cut honest pulls (outer.py)."""

    def restart_momentum(self) -> None:
        """The momentum starts again from zero (`rebuilding` counts the rounds it takes)."""
        self.momentum = torch.zeros_like(self.anchor)
        self.rebuilding = math.ceil(1 / max(1 - self.mu, 1e-3))

    @property
    def numel(self) -> int:
        return self.anchor.numel()

    def weights(self) -> Tensor:
        """The parameters as one flat float32 vector on the host, where the outer state
        lives whatever the stage's device."""
        return host_flat(self.params)

    def pseudo_gradient(self) -> Tensor:
        """delta = anchor - weights: how far the inner steps moved (a descent direction)."""
        return self.anchor - self.weights()

    @torch.no_grad()
    def step(
        self,
        mixed_delta: Tensor,
        mixed_anchor: Tensor | None = None,
        mixed_momentum: Tensor | None = None,
        consensus: float | None = None,
    ) -> Tensor:
        """Nesterov outer step from the (mixed) anchor; returns the new anchor, which the
        caller writes into the weights. Touches no parameter.

        consensus (OuterConfig.consensus): step from the own anchor instead, with the pull
        toward the mixed anchor folded into the momentum's gradient."""
        grad, base = mixed_delta, self.anchor
        if mixed_anchor is not None and consensus is None:
            base = mixed_anchor.float()
        elif mixed_anchor is not None:
            grad = mixed_delta + (self.anchor - mixed_anchor.float()) * (consensus / self.lr)
        start = self.momentum if mixed_momentum is None else mixed_momentum.float()
        # out of place, assigned together: a snapshot taken meanwhile on the event loop (a
        # checkpoint while a cancelled round's step runs on in its thread) reads the old
        # pair, whole, or the new one
        momentum = torch.add(grad, start, alpha=self.mu)
        anchor = base - self.lr * (grad + self.mu * momentum)
        self.anchor, self.momentum = anchor, momentum
        self.rebuilding = max(0, self.rebuilding - 1)
        self.round += 1
        self.anchor_round = self.round
        self.warming = False
        return self.anchor

    @torch.no_grad()
    def preview(self, delta: Tensor) -> Tensor:
        """The anchor `step(delta)` would make from this replica's own anchor and momentum,
        changing nothing: where an overlapped round's inner steps go on from while the
        mixes run (an eager outer step with the replica's own pseudo-gradient)."""
        momentum = self.momentum * self.mu + delta
        return self.anchor - self.lr * (delta + self.mu * momentum)

    def preview_from(self, weights: Tensor) -> Tensor:
        """`preview` of the pseudo-gradient that ends at `weights` (stage-sized: the daemon
        calls it on a thread)."""
        return self.preview(self.anchor - weights)

    def apply(
        self,
        mixed_delta: Tensor,
        mixed_anchor: Tensor | None = None,
        mixed_momentum: Tensor | None = None,
        consensus: float | None = None,
    ) -> None:
        """`step`, then the weights := the new anchor (a module outside any stage worker)."""
        self.load_weights(self.step(mixed_delta, mixed_anchor, mixed_momentum, consensus))

    @torch.no_grad()
    def load_weights(self, flat: Tensor) -> None:
        write_flat(self.params, flat)

    def mixed_state(self, with_momentum: bool) -> Tensor:
        """What the anchor mix averages: the anchor, and the momentum after it if asked."""
        return torch.cat([self.anchor, self.momentum]) if with_momentum else self.anchor

    def digest(self, with_momentum: bool = False) -> str:
        return hashlib.sha256(self.mixed_state(with_momentum).numpy().tobytes()).hexdigest()[:32]

    def state_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "anchor_round": self.anchor_round,
            "anchor": self.anchor.clone(),
            "momentum": self.momentum.clone(),
        }

    def load_state_dict(self, state: dict[str, Any], *, warming: bool = True) -> None:
        """Adopt a peer's outer state (the module's weights are loaded by the caller)."""
        anchor, momentum = state["anchor"].float(), state["momentum"].float()
        if anchor.shape != self.anchor.shape or momentum.shape != self.anchor.shape:
            raise ValueError(f"outer state has {anchor.numel()} values, this stage {self.numel}")
        self.anchor, self.momentum = anchor.clone(), momentum.clone()
        self.round = int(state["round"])
        self.anchor_round = min(self.round, int(state.get("anchor_round", self.round)))
        self.warming = warming
        if not bool(self.momentum.any()):  # not attested, so reset by the joiner
            self.restart_momentum()
        else:
            self.rebuilding = 0


class Weights(Protocol):
    """Where the outer step reads and writes the replica's weights (flat float32).

    The daemon passes its stage worker's (`StageWorker.frozen`), so the weights are
    written on the worker thread only; tests and benchmarks use `ModuleWeights`."""

    async def read(self) -> Tensor: ...

    async def write(self, flat: Tensor) -> None: ...


class ModuleWeights:
    """A module that no stage worker owns: read and written from a helper thread."""

    def __init__(self, state: OuterState) -> None:
        self.state = state

    async def read(self) -> Tensor:
        return await asyncio.to_thread(self.state.weights)

    async def write(self, flat: Tensor) -> None:
        await asyncio.to_thread(self.state.load_weights, flat)
