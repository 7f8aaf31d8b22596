"""Stage choice: which pipeline stage a node serves, as pure functions of a snapshot.

The swarm trains at the pace of its slowest stage, so a stage's *capacity* is
what bounds it: the tokens/s its replicas can pass together. A record's
`throughput` is the node's compute rate on the stage it serves: tokens per
compute-second of forward + backward, each micro-batch's tokens counted once
(node/worker.py), so that every stage measures the same tokens and a stage's
capacity is the sum of its replicas' rates. A node's speed is kept as *power* =
rate x cost of its stage (tokens/s it would reach on a stage of mean cost), so
that its capacity on another stage is power / cost of that stage. A replica
whose throughput is not known yet (it just joined) counts as the median known
power, or 1 when nothing is known.

- `choose_stage`: where a joining node goes. All joining nodes visible in the
  snapshot form one batch, ordered by a hash of their peer ids, and each in turn
  takes the stage with the least capacity. Nodes that see the same directory
  therefore agree on the whole assignment and spread out, even when they join
  at the same moment.
- `should_switch`: whether a running node should move, with a margin, the rule
  that a stage keeps one active replica, and one mover per round (elected by
  hash) so that peers with the same view do not all move and swing back.

No I/O here: the daemon feeds these functions and acts on the answer.
"""

from __future__ import annotations

import hashlib
import math
import random
import statistics
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from agora_node.protocol.manifest import Manifest, ModelSpec
from agora_node.protocol.records import NodeRecord, NodeState

Directory = Mapping[int, Sequence[NodeRecord]]
"""Stage -> the records currently visible under that stage's DHT key."""

CostsLike = Manifest | Sequence[float]

_TIE = 1e-9  # relative tolerance under which two capacities count as equal


# ---- compute cost ---------------------------------------------------------------


def _block_flops(spec: ModelSpec, constrained: bool) -> float:
    """Forward FLOPs per token of one decoder block (matmuls + causal attention)."""
    d, kv, f = spec.d_model, spec.n_kv_heads * spec.head_dim, spec.ffn_dim
    out = spec.subspace_rank if constrained else d
    weights = d * d + 2 * d * kv + d * out + 2 * d * f + f * out
    # A constrained block lifts its two k-wide outputs back to d (h @ U^T).
    lift = 2 * spec.subspace_rank * d if constrained else 0
    # A K/V mixture projects z on every basis and lifts the chosen coefficients back
    # (on a peer alone only when it compresses every token's sources; a cell member with
    # kv_compress = "remote" does it too, a few percent of a block that is not counted).
    if spec.kv_mixture_alone:
        lift += 2 * d * spec.kv_subspaces * spec.kv_rank
    # QK^T and AV over on average seq_len/2 earlier positions (causal mask).
    attention = 2 * d * spec.seq_len
    return 2.0 * (weights + lift) + attention


def stage_flops_per_token(manifest: Manifest, stage: int) -> float:
    """Forward FLOPs per token of `stage` (backward costs about twice this everywhere)."""
    spec = manifest.model
    last = manifest.num_stages - 1
    last_start = manifest.stage_layers(last).start
    flops = sum(
        _block_flops(spec, constrained=not manifest.dense and i < last_start)
        for i in manifest.stage_layers(stage)
    )
    if stage == 0 and not manifest.dense:
        flops += 2.0 * spec.subspace_rank * spec.d_model  # trainable rank-k part, lifted to d
    if stage == last:
        flops += 2.0 * spec.d_model * spec.vocab_size  # head; the loss itself is O(vocab)
    return flops


def stage_costs(manifest: Manifest) -> list[float]:
    """Relative compute cost per token of each stage, normalized to mean 1."""
    flops = [stage_flops_per_token(manifest, s) for s in range(manifest.num_stages)]
    mean = sum(flops) / len(flops)
    return [f / mean for f in flops]


def _as_costs(manifest_or_costs: CostsLike) -> list[float]:
    if isinstance(manifest_or_costs, Manifest):
        return stage_costs(manifest_or_costs)
    costs = [float(c) for c in manifest_or_costs]
    if not costs or any(c <= 0 for c in costs):
        raise ValueError(f"stage costs must be positive and non-empty, got {costs}")
    return costs


# ---- the snapshot as replicas ---------------------------------------------------


@dataclass(frozen=True)
class _Replica:
    peer_id: str
    stage: int
    state: str
    power: float | None
    """Tokens/s on a stage of cost 1; None while unknown."""


def directory_from_records(records: Sequence[NodeRecord]) -> dict[int, list[NodeRecord]]:
    """Group records by the stage they announce (a convenience for callers and tests)."""
    out: dict[int, list[NodeRecord]] = {}
    for record in records:
        out.setdefault(record.stage, []).append(record)
    return out


def _power(record: NodeRecord, cost: float) -> float | None:
    """A record's power, None when unknown. Records are range-checked when read
    (records.verify_record); a non-finite or non-positive rate still counts as unknown
    here, so that no record makes its stage look infinitely served."""
    rate = record.throughput
    if isinstance(rate, bool) or not isinstance(rate, int | float):
        return None
    if not math.isfinite(rate) or rate <= 0:
        return None
    power = rate * cost
    return power if math.isfinite(power) and power > 0 else None  # > 0: no underflow


def _replicas(directory: Directory, costs: Sequence[float]) -> dict[str, _Replica]:
    """Live replicas by peer id: leaving nodes dropped, one entry per peer (newest wins)."""
    newest: dict[str, NodeRecord] = {}
    for stage, records in directory.items():
        if not 0 <= stage < len(costs):
            continue  # a stage this manifest does not have
        for r in records:
            if r.stage != stage:
                continue  # stored under another stage's key: stale or misfiled
            if r.state == NodeState.LEAVING:
                continue  # takes no new work and will be gone soon
            if r.peer_id not in newest or r.issued_at > newest[r.peer_id].issued_at:
                newest[r.peer_id] = r
    return {p: _Replica(p, r.stage, r.state, _power(r, costs[r.stage])) for p, r in newest.items()}


def _median_power(replicas: Mapping[str, _Replica]) -> float:
    known = [r.power for r in replicas.values() if r.power is not None]
    return statistics.median(known) if known else 1.0


def _capacities(
    replicas: Sequence[_Replica], costs: Sequence[float], fallback_power: float
) -> list[float]:
    caps = [0.0] * len(costs)
    for r in replicas:
        caps[r.stage] += (r.power if r.power is not None else fallback_power) / costs[r.stage]
    return caps


def _counts(replicas: Sequence[_Replica], n_stages: int) -> list[int]:
    counts = [0] * n_stages
    for r in replicas:
        counts[r.stage] += 1
    return counts


def peer_rank(peer_id: str) -> int:
    """The order in which simultaneous joiners are placed: the same on every peer."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "big")


def _stage_preference(peer_id: str, stage: int) -> int:
    # Per-peer order of stages: tied joiners with different views still spread.
    return int.from_bytes(hashlib.sha256(f"{peer_id}/{stage}".encode()).digest()[:8], "big")


def _least_capacity(
    caps: Sequence[float],
    peer_id: str,
    allowed: Collection[int] | None = None,
    counts: Sequence[int] | None = None,
) -> tuple[int, list[int]]:
    """The stage (of `allowed`, default all) with the least capacity for `peer_id`, and
    every allowed stage tied with it. Among the tied, one with the fewest replicas
    (`counts`) first: capacities of tiny rates can round to 0, and an empty stage is a
    hole in the pipeline whatever the others' rates."""
    stages = range(len(caps)) if allowed is None else sorted(allowed)
    low = min(caps[s] for s in stages)
    tied = [s for s in stages if caps[s] <= low * (1 + _TIE)]  # empty only ties empty
    fewest = min(counts[s] for s in tied) if counts is not None else 0
    candidates = [s for s in tied if counts is None or counts[s] == fewest]
    return min(candidates, key=lambda s: _stage_preference(peer_id, s)), tied


# ---- joining ----------------------------------------------------------------------


@dataclass(frozen=True)
class StageChoice:
    stage: int
    reason: str
    """Why, in one line for the operator."""
    capacity: tuple[float, ...]
    """Per-stage capacity when this node took its slot (tokens/s, or relative units)."""
    replicas: tuple[int, ...]
    """Per-stage replica count when this node took its slot."""


def choose_stage(
    directory: Directory,
    manifest_or_costs: CostsLike,
    peer_id: str,
    *,
    own_throughput: float | None = None,
    can_hold: Collection[int] | None = None,
) -> StageChoice:
    """The stage `peer_id` should serve, as its slot in the greedy fill of all joiners.

    `own_throughput`: tokens/s this node would reach on a stage of mean cost, if
    it knows; else it counts like any joiner. The caller's own record, if the
    snapshot has one, is treated as joining whatever it says. `can_hold`: the
    stages this node's device can hold (default all; `stages_that_fit`); other
    joiners are assumed to hold any stage (their devices are not announced).
    """
    if can_hold is not None and not can_hold:
        raise ValueError("can_hold names no stage")
    costs = _as_costs(manifest_or_costs)
    replicas = _replicas(directory, costs)
    own_power = own_throughput if own_throughput and 0 < own_throughput < math.inf else None
    if own_power is None and peer_id in replicas:
        own_power = replicas[peer_id].power  # e.g. a restarted node's last measurement
    replicas[peer_id] = _Replica(peer_id, 0, NodeState.JOINING.value, own_power)
    fallback = _median_power(replicas)

    fixed = [r for r in replicas.values() if r.state != NodeState.JOINING]
    batch = sorted(
        (r for r in replicas.values() if r.state == NodeState.JOINING),
        key=lambda r: (peer_rank(r.peer_id), r.peer_id),
    )
    caps, counts = _capacities(fixed, costs, fallback), _counts(fixed, len(costs))
    for slot, joiner in enumerate(batch):
        mine = joiner.peer_id == peer_id
        stage, tied = _least_capacity(caps, joiner.peer_id, can_hold if mine else None, counts)
        if mine:
            reason = _choice_reason(stage, tied, caps, counts, slot, len(batch))
            return StageChoice(stage, reason, tuple(caps), tuple(counts))
        caps[stage] += (joiner.power if joiner.power is not None else fallback) / costs[stage]
        counts[stage] += 1
    raise AssertionError("the caller is always in the batch")  # pragma: no cover


def _choice_reason(
    stage: int, tied: list[int], caps: list[float], counts: list[int], slot: int, batch: int
) -> str:
    n = counts[stage]
    reason = (
        f"stage {stage} has the least capacity: {caps[stage]:.3g} ({n} replica{'s' * (n != 1)})"
    )
    if len(tied) > 1:
        reason += f", tied with stage(s) {', '.join(str(s) for s in tied if s != stage)}"
        reason += " (broken by peer id hash)"
    if batch > 1:
        reason += f"; placed {slot + 1} of {batch} nodes joining together"
    return reason


# ---- switching --------------------------------------------------------------------


@dataclass(frozen=True)
class SwitchDecision:
    stage: int | None
    """The stage to move to, or None to stay."""
    reason: str
    bottleneck: float
    """Least stage capacity now."""
    bottleneck_after: float
    """Least stage capacity if this node moved to `stage` (equal to bottleneck when staying)."""


def _close(x: float, y: float) -> bool:
    return abs(x - y) <= _TIE * max(abs(x), abs(y))


def _clear_gain(before: Sequence[float], after: Sequence[float], margin: float) -> bool:
    """Whether capacities `after` beat `before` clearly, comparing them sorted, worst first.

    At the first place where they differ, the stage there must rise by `margin`
    and must have been at the bottleneck (within `margin` of the least). With one
    bottleneck stage this is "the least capacity rises by margin"; with several
    tied (two empty stages, or 4-1-1 replicas) no single move raises the least,
    but lifting one of them is progress. The order is strict, so the reverse of
    a move never looks good, and any sequence of moves ends.
    """
    b, a = sorted(before), sorted(after)
    for x, y in zip(b, a, strict=True):
        if not _close(x, y):
            return y > x and y >= margin * x and x <= margin * b[0]
    return False


def _best_move(
    mover: _Replica,
    active_counts: Sequence[int],
    caps: Sequence[float],
    costs: Sequence[float],
    fallback: float,
    margin: float,
) -> tuple[int, list[float]] | None:
    """The best target for `mover` and the capacities after, if the move clears the rules."""
    if mover.state != NodeState.ACTIVE or active_counts[mover.stage] < 2:
        return None  # only active nodes move, and never a stage's last active replica
    power = mover.power if mover.power is not None else fallback
    best: tuple[int, list[float]] | None = None
    for target in range(len(costs)):
        if target == mover.stage:
            continue
        after = list(caps)
        after[mover.stage] -= power / costs[mover.stage]
        after[target] += power / costs[target]
        if _clear_gain(caps, after, margin) and (best is None or sorted(after) > sorted(best[1])):
            best = (target, after)
    return best


def should_switch(
    directory: Directory,
    costs: CostsLike,
    peer_id: str,
    current_stage: int,
    *,
    margin: float = 1.25,
    movable: Collection[str] | None = None,
    verified: Callable[[str], bool] | None = None,
) -> SwitchDecision:
    """Whether the running node `peer_id` should leave `current_stage`, and for which stage.

    Moves only if the swarm's bottleneck rises by `margin` or more (or, when
    several stages share the bottleneck, one of them does: see `_clear_gain`),
    only if the current stage keeps another active replica, and only if this node is the one
    elected (lowest peer hash) among all nodes for which such a move exists, so
    that peers seeing the same directory move one at a time.

    `verified(peer)`: whether a host is known to run behind that record (a running
    node's SWIM probes answered). Given it, only verified replicas keep a stage from
    losing its last one and only verified nodes stand in the election: a record is one
    signed DHT store, and a stranger's pinned record at a stage had every honest
    replica there leave it, and a record under a key ground to the lowest rank (which
    never moves) stopped every move. Capacity still counts every record. The price:
    nodes that have verified different peers (one that has not yet probed the elected
    node) may both move in one round; the re-check after the random delay
    (`switch_delay`) usually sees the first move, and the last replica rule holds.
    """
    if margin < 1:
        raise ValueError(f"margin must be >= 1, got {margin}")
    costs = _as_costs(costs)
    replicas = _replicas(directory, costs)
    mine = replicas.get(peer_id)
    replicas[peer_id] = _Replica(
        peer_id,
        current_stage,
        mine.state if mine else NodeState.ACTIVE.value,
        mine.power if mine else None,
    )
    fallback = _median_power(replicas)
    everyone = list(replicas.values())
    caps = _capacities(everyone, costs, fallback)

    def real(r: _Replica) -> bool:
        return verified is None or r.peer_id == peer_id or verified(r.peer_id)

    active = _counts([r for r in everyone if r.state == NodeState.ACTIVE and real(r)], len(costs))
    now = min(caps)

    def stay(reason: str) -> SwitchDecision:
        return SwitchDecision(None, reason, now, now)

    if replicas[peer_id].state != NodeState.ACTIVE:
        return stay(f"only active nodes switch (this node is {replicas[peer_id].state})")
    if active[current_stage] < 2:
        return stay(f"this node is the only active replica of stage {current_stage}")
    move = _best_move(replicas[peer_id], active, caps, costs, fallback, margin)
    if move is None:
        return stay(f"no move raises the bottleneck ({now:.3g}) by x{margin:g}")
    # Only nodes that may move take part in the election (pinned nodes never move).
    movers = [
        r.peer_id
        for r in everyone
        if r.peer_id == peer_id
        or (
            (movable is None or r.peer_id in movable)
            and real(r)
            and _best_move(r, active, caps, costs, fallback, margin)
        )
    ]
    elected = min(movers, key=lambda p: (peer_rank(p), p))
    if elected != peer_id:
        return stay(f"peer {elected[:12]} moves first ({len(movers)} could; one per round)")
    target, after = move
    if caps[target] == 0:
        reason = f"stage {target} is empty; stage {current_stage} keeps {active[current_stage] - 1}"
    elif min(after) > now:
        reason = f"moving to stage {target} raises the bottleneck {now:.3g} -> {min(after):.3g}"
    else:
        reason = (
            f"stage {target} is one of the stages at the bottleneck ({now:.3g}); "
            f"moving lifts it to {after[target]:.3g}"
        )
    return SwitchDecision(target, reason, now, min(after))


def switch_delay(
    peer_id: str, rng_or_seed: random.Random | int | None, max_delay_s: float
) -> float:
    """A delay in [0, max_delay_s) before acting on a switch, so that peers do not herd.

    With a seed (or None), the delay is drawn from a generator keyed by the peer id
    as well, so peers sharing a seed still wait different times.
    """
    if max_delay_s <= 0:
        return 0.0
    rng = (
        rng_or_seed
        if isinstance(rng_or_seed, random.Random)
        else random.Random(f"{peer_id}/{rng_or_seed}")
    )
    return rng.uniform(0.0, max_delay_s)
