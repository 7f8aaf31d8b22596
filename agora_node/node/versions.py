"""Weight versions of a stage: the copies forwards run on, and weight prediction.

PipeDream-2BW style. Micro-batches interleave: an inner optimizer step can land between
a micro-batch's forward and its backward. Forwards therefore run on a *version copy* of
the weights (functional_call), never on the master parameters the optimizer updates in
place. A step sums the gradients that finished on every live copy into the master,
steps, and publishes a fresh copy; a micro-batch still in flight keeps the copy its
forward used (its graph references it) and its gradient lands in the next step, late.
Nothing is recomputed with mixed weights and no graph sees an in-place update.

Weight prediction: a gradient computed on version v lands in a step `lag` steps after
the one that made v, so it is a gradient at weights the master has already moved away
from. With prediction the published copy is not the master but the master extrapolated
along its last inner step by the lag this stage measures (copy = master + lag x (master -
master before the step)), so forwards run closer to the weights their gradient will be
applied to. Weights written any other way than by an inner step (an outer step, a loaded
state, an adopted anchor) clear the move: nothing to extrapolate.

Chosen by bench/staleness.py (docs/benchmarks.md, "Weight prediction"): extrapolating each
forward by its own lead instead (the steps before its gradient lands, from its place in
the stage's queue) was measured on 2026-12-03 and was no better where it matters (with
Muon at 3-4 in flight the two rules ended within 0.2% of each other; on AdamW mixed),
while it holds one more copy of the weights per lead in use; the mean lag is kept.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

Hook = Callable[[str], Callable[[Tensor], None]]


class WeightVersions:
    """The version copies of one stage's weights (worker thread only)."""

    def __init__(
        self,
        stage: nn.Module,
        trainable: dict[str, Tensor],
        *,
        predict: bool,
        on_grad: Hook | None = None,
    ) -> None:
        """`stage`: the module whose parameters are the masters; `trainable`: those the
        optimizer steps; `on_grad`: per trainable name, a hook to call when a backward has
        accumulated a copy's gradient (the optimizer in backward), or None."""
        self._stage, self._trainable = stage, trainable
        self.predict, self._on_grad = predict, on_grad
        self.number = 0
        self.current: dict[str, Tensor] = {}
        """The copy new forwards run on (extrapolated when predicting)."""
        self._move: dict[str, Tensor] | None = None
        """master - master before the last inner step (prediction only)."""
        self._with_grads: dict[int, dict[str, Tensor]] = {}
        """Copies holding gradients not yet stepped, by version (one copy per version)."""
        self._finished_on: dict[int, tuple[int, int]] = {}
        """Micro-batches, and their tokens, whose gradients each of those copies holds."""
        self.lag = 0.0
        """Steps a gradient lands after the step its forward's version came from (a moving
        average over finished micro-batches): 0 when every forward sees the latest step.
        Measured with or without prediction (the status page shows it)."""
        self.publish(0)

    @torch.no_grad()
    def publish(self, number: int, *, moved_from: list[Tensor] | None = None) -> None:
        """New forwards run on version `number` of the weights. `moved_from`: the trainable
        weights before the inner step that made it (what prediction extrapolates along);
        None for weights written any other way."""
        self.number = number
        self._move = None
        if moved_from is not None:
            self._move = {
                name: p.detach() - before
                for (name, p), before in zip(self._trainable.items(), moved_from, strict=True)
            }
        steps = self.lag if self._move is not None else 0.0
        self.current = self._copy(steps)

    def before_step(self) -> list[Tensor] | None:
        """What `publish(moved_from=...)` needs after the step: the trainable weights now,
        when predicting."""
        return [p.detach().clone() for p in self._trainable.values()] if self.predict else None

    @torch.no_grad()
    def _copy(self, steps: float) -> dict[str, Tensor]:
        """Copies of the stage's weights (+ steps * the last move) that forwards can run on."""
        params = {}
        for name, p in self._stage.named_parameters():
            copy = p.detach().clone()
            if steps and name in self._move:
                copy.add_(self._move[name], alpha=steps)
            params[name] = copy.requires_grad_(True)
        if self._on_grad is not None:
            for name, copy in params.items():
                if name in self._trainable:
                    copy.register_post_accumulate_grad_hook(self._on_grad(name))
        return params

    def finished(self, number: int, params: dict[str, Tensor], tokens: int) -> None:
        """A backward of `tokens` tokens on copy `params` of version `number` left its
        gradients there."""
        self._with_grads[number] = params
        count, held = self._finished_on.get(number, (0, 0))
        self._finished_on[number] = (count + 1, held + tokens)
        self.lag = 0.9 * self.lag + 0.1 * (self.number - number)

    def drop(self, number: int, params: dict[str, Tensor]) -> tuple[int, int]:
        """Let go of every gradient on copy `params` of version `number` (a backward failed
        part way on it); returns how many finished micro-batches' gradients went with them,
        and their tokens."""
        for p in params.values():
            p.grad = None
        if self._with_grads.get(number) is params:
            del self._with_grads[number]
        return self._finished_on.pop(number, (0, 0))

    def gather(self, masters: dict[str, Tensor]) -> None:
        """Sum the gradients held on every copy into the masters' .grad; the copies let go."""
        for params in self._with_grads.values():
            for name, p in params.items():
                if p.grad is None:
                    continue
                master = masters[name]
                master.grad = p.grad.clone() if master.grad is None else master.grad.add_(p.grad)
                p.grad = None
        self._with_grads.clear()
        self._finished_on.clear()

    def drop_grads(self) -> int:
        """Let go of every gradient not yet stepped; returns their micro-batches' tokens."""
        tokens = sum(held for _, held in self._finished_on.values())
        self._with_grads.clear()
        self._finished_on.clear()
        return tokens

    def held(self, number: int) -> dict[str, Tensor]:
        """The copy of version `number` holding gradients (tests compare them)."""
        return self._with_grads[number]
