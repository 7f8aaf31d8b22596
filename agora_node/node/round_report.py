"""What one outer round did, as the replica saw it: `RoundReport`, built from the round's
two mixes by `round_report`, and `round_summary`, the part the status page lists."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from agora_node.comms.collective import Outcome, RoundView


@dataclass
class RoundReport:
    round: int
    participants: int
    anchor_group: tuple[str, ...]
    delta_group: tuple[str, ...]
    anchor_mixed: bool
    consistent: bool
    failed_peers: list[str]
    rejected: dict[str, int]
    bytes_sent: int
    bytes_received: int
    seconds_blocked: float
    """end_round's wall time: what the inner loop waited for."""
    seconds_waiting_prep: float
    """Part of it spent waiting for matchmaking / the anchor mix to finish."""
    deadline: float
    """Worst-case duration of the blocking mix under failures."""
    delta_norm: float
    mixed_norm: float
    clip_radius: float | None
    """Root of the sum of squared CenteredClip radii of the spans this replica reduced."""
    repaired_spans: int
    """Spans whose owner failed and that this replica re-reduced as a backup."""
    outliers: list[str] = field(default_factory=list)
    """Members whose contribution this replica refused, as a reducer, for its norm."""
    direction_outliers: list[str] = field(default_factory=list)
    """Members whose contribution this replica refused, as a reducer, for its direction."""
    replayed: list[str] = field(default_factory=list)
    """Members whose delta part repeated one they sent in an earlier round (replay.py)."""
    mismatched: list[str] = field(default_factory=list)
    """Span owners whose result failed the witness check (verify.py); not adopted."""
    checked_spans: int = 0
    """Spans fetched from their owner whose result the witness confirmed."""
    unchecked_spans: int = 0
    """Results adopted unchecked: their witness did not answer."""
    late_spans: int = 0
    """Spans adopted from a backup owner because their first owner was late or gone."""
    mismatch_witnesses: list[str] = field(default_factory=list)
    """Witnesses of those spans (other than this replica): either side may have lied."""
    equivocated: list[str] = field(default_factory=list)
    """Members that signed two parts for one span, one for its owner and one for its
    witness (proofs.py): the failed check was theirs."""
    excluded: list[str] = field(default_factory=list)
    """Participants left out of the round: a majority of the entries named them banned."""
    ignored: list[str] = field(default_factory=list)
    """Members whose parts this replica, as a reducer, dropped: it had banned them."""
    bounded: list[str] = field(default_factory=list)
    """What this replica's own bounds cut of the group's results (outer_bounds.py): a mixed
    delta refused for the own, an anchor pull shortened. A liar in its group, or a group
    far from it."""


def round_summary(report: RoundReport, at: float | None = None) -> dict[str, Any]:
    """What the status page lists of one round: who mixed, what it cost, whether the
    results agreed (`consistent`), and the peers this replica had to distrust."""
    return {
        "round": report.round,
        "at": time.time() if at is None else at,
        "participants": report.participants,
        "group": list(report.delta_group),
        "anchor_mixed": report.anchor_mixed,
        "consistent": report.consistent,
        "bytes_sent": report.bytes_sent,
        "bytes_received": report.bytes_received,
        "seconds_blocked": report.seconds_blocked,
        "failed_peers": list(report.failed_peers),
        "outliers": list(report.outliers),
        "direction_outliers": list(report.direction_outliers),
        "replayed": list(report.replayed),
        "mismatched": list(report.mismatched),
        "equivocated": list(report.equivocated),
        "bounded": list(report.bounded),
    }


def round_report(
    round_no: int,
    view: RoundView,
    group_size: int,
    mixes: tuple[Outcome | None, ...],
    norms: tuple[float, float],
    times: tuple[float, float, float],
) -> RoundReport:
    """What one round did, from its mixes' outcomes (`mixes`: the anchor mix's, then the
    delta mix's, or a low-rank round's two), `norms` (of the own and the mixed delta) and `times`
    (monotonic start of end_round, seconds waiting for the round's preparation,
    worst-case deadline)."""
    anchor, *deltas = mixes
    delta_norm, mixed_norm = norms
    started, waited, deadline = times
    outcomes = [o for o in mixes if o is not None]
    radii = [r for o in deltas if o is not None for r in o.stats.clip_radii]
    rejected: dict[str, int] = {}
    for o in outcomes:
        for reason, count in o.stats.rejected.items():
            rejected[reason] = rejected.get(reason, 0) + count
    return RoundReport(
        round=round_no,
        participants=len(view.entries),
        anchor_group=view.group("anchor", group_size),
        delta_group=view.group("delta", group_size),
        anchor_mixed=anchor is not None,
        consistent=all(o.consistent for o in outcomes),
        failed_peers=sorted({p for o in outcomes for p in o.stats.failed_peers}),
        rejected=rejected,
        bytes_sent=sum(o.stats.bytes_sent for o in outcomes),
        bytes_received=sum(o.stats.bytes_received for o in outcomes),
        seconds_blocked=time.monotonic() - started,
        seconds_waiting_prep=waited,
        deadline=deadline,
        delta_norm=delta_norm,
        mixed_norm=mixed_norm,
        clip_radius=math.sqrt(sum(r * r for r in radii)) if radii else None,
        repaired_spans=sum(o.stats.repaired_spans for o in outcomes),
        outliers=sorted({p for o in outcomes for p in o.stats.outliers}),
        direction_outliers=sorted({p for o in outcomes for p in o.stats.direction_outliers}),
        replayed=sorted({p for o in outcomes for p in o.stats.replayed}),
        mismatched=sorted({p for o in outcomes for p in o.stats.mismatched}),
        checked_spans=sum(o.stats.checked_spans for o in outcomes),
        unchecked_spans=sum(o.stats.unchecked_spans for o in outcomes),
        late_spans=sum(o.stats.late_spans for o in outcomes),
        mismatch_witnesses=sorted({p for o in outcomes for p in o.stats.mismatch_witnesses}),
        equivocated=sorted({p for o in outcomes for p in o.stats.equivocated}),
        excluded=list(view.excluded),
        ignored=sorted({p for o in outcomes for p in o.stats.ignored}),
    )
