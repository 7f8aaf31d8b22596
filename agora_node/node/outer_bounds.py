"""What a replica takes from its group's mixes in an outer round, bounded by its own steps
(`bound_mixes`, used by `OuterLoop.end_round`).

A group's robust rules need three or more parts: with two (a stage of two, the
manifests' groups of two, or one counting member beside warming ones) a liar's part
moves the mean as far as it likes (its -1e37 made every weight infinite for good).
Nothing makes two members robust; what an honest replica can do is bound how far
the other moves it in a round, measured in its own steps:

- the mixed pseudo-gradient must be finite and at most `MIX_NORM_RATIO` (10) times
  this replica's own delta (scaled up by `cap / tokens` when it processed fewer
  tokens than a full round can): honest pseudo-gradients of a round start from one
  anchor and take as many steps at one learning rate, so their norms differ by far
  less (a reducer refuses a part above 10x its span's median on the same reasoning,
  and a mean of parts is no longer than the longest). Else its own delta is used;
- the mixed anchor may pull this replica's anchor at most `ANCHOR_PULL_STEPS` (2)
  of its own outer steps (lr x (|own delta| + momentum x |own momentum|): how far
  its own step can move the anchor this round), the mixed momentum as far in its
  own units; a longer pull is cut to that length, in its direction. Honest anchors
  differ by about a step (a round mixed alone, groups that mixed apart: none was cut
  in the gossip benchmark); those that drifted further apart (a partition, a
  restart from an old checkpoint) close the gap by that much a round from each side
  instead of at once. A liar in a group of two moves an honest anchor no further a
  round, which is still as far as its training does (two members cannot be made
  robust: the replica only bounds the rate);
- a replica without a finite own delta (no steps) has no measure: it takes neither
  the mixed delta nor the anchor this round.

What was refused or cut is returned as notes, which the caller logs in one warning.
"""

from __future__ import annotations

import math

from torch import Tensor

from agora_node.node.outer_state import OuterState, flat_norm, within

MIX_NORM_RATIO = 10.0
"""A mixed pseudo-gradient longer than this times the own delta (scaled to a full round's
tokens) is refused."""
ANCHOR_PULL_STEPS = 2.0
"""Of this replica's own outer steps, how far a mixed anchor may pull its anchor in one
round."""


def bound_mixes(
    state: OuterState,
    delta: Tensor,
    mixed: Tensor,
    anchor: Tensor | None,
    momentum: Tensor | None,
    shortfall: float,
    carried: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None, list[str]]:
    """(mixed delta, mixed anchor, mixed momentum) as this replica takes them, and notes
    of what was refused or cut. `shortfall`: how many times more tokens a full round
    processes than this replica did (its delta is scaled up by it). `carried`: what
    `delta` holds of earlier rounds (`outer.unsent = "weights"`), left out of the own
    move the bounds are measured by. A non-finite `delta` is zeroed in place."""
    notes: list[str] = []
    own = flat_norm(delta, minus=carried) * shortfall  # a full round's own move
    if not math.isfinite(own):  # its inner steps went wrong: they are not stepped in
        notes.append("stepped without its own delta (not finite)")
        delta.zero_()  # in place: the round's report shows the delta stepped, 0
        own = 0.0
    if not own > 0:
        if mixed is not delta or anchor is not None:
            notes.append("took nothing from its group (no own delta to measure it by)")
        mixed, anchor, momentum = delta, None, None
    if mixed is not delta:
        got = flat_norm(mixed)
        if not (math.isfinite(got) and got <= MIX_NORM_RATIO * own):
            notes.append(f"refused the mixed pseudo-gradient (norm {got:.3g}, own {own:.3g})")
            mixed = delta
    if anchor is not None:
        held = flat_norm(state.momentum)
        if state.rebuilding:  # its momentum started again from zero: a run's, meanwhile
            held = max(held, own / max(1 - state.mu, 1e-3))
        step = own + state.mu * held  # its own step, over lr
        reach = ANCHOR_PULL_STEPS * state.lr * step
        anchor, far = within(anchor, state.anchor, reach)
        if anchor is None:
            notes.append("refused the mixed anchor (not finite)")
            momentum = None
        elif far > reach:
            notes.append(f"cut the mixed anchor's pull from {far:.3g} to {reach:.3g}")
        if momentum is not None:
            momentum, far = within(momentum, state.momentum, ANCHOR_PULL_STEPS * step)
            if momentum is None:
                notes.append("refused the mixed momentum (not finite)")
            elif far > ANCHOR_PULL_STEPS * step:
                notes.append(f"cut the mixed momentum's pull from {far:.3g}")
    return mixed, anchor, momentum, notes
