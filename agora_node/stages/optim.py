"""Inner optimizers: AdamW (default) and Muon, with a linear warm-up.

Muon orthogonalizes the momentum of each hidden weight matrix with a few
Newton-Schulz iterations; embeddings, the head and norm gains keep AdamW, as
Muon is meant for hidden matrices only. Published results show it tolerates the
one-step gradient delay of an asynchronous pipeline far better than AdamW.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import Tensor, nn

from agora_node.protocol.manifest import InnerSpec
from agora_node.stages.device import OPTIMIZER_STATES, OPTIMIZER_STEPS

log = logging.getLogger(__name__)

# Coefficients of the quintic iteration that pushes singular values towards 1 fast
# (they need not converge exactly; roughly uniform in [0.7, 1.2] is what matters).
_NS_COEFFS = (3.4445, -4.7750, 2.0315)


def orthogonalize(g: Tensor, steps: int = 5) -> Tensor:
    """Approximate U V^T of g = U S V^T by Newton-Schulz iterations (in bf16 on CPU is slow: fp32)."""
    a, b, c = _NS_COEFFS
    x = g / (g.norm() + 1e-7)
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.t()
    for _ in range(steps):
        gram = x @ x.t()
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.t() if transposed else x


class Muon(torch.optim.Optimizer):
    """Momentum + orthogonalized update for 2-D weights; decoupled weight decay."""

    def __init__(
        self, params, lr: float, momentum: float = 0.95, weight_decay: float = 0.0
    ) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch signature
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                update = orthogonalize(p.grad.add(buf, alpha=group["momentum"]))  # Nesterov
                scale = max(1.0, p.shape[0] / p.shape[1]) ** 0.5
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"] * scale)


_BLOCK = 256
_FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_blockwise(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (any shape) -> (float8 e4m3 codes [numel], float32 scale per block of 256 values).

    A block's absmax maps to the largest finite code; 3 mantissa bits keep each value to
    within about 6% of itself across the block's range (not a fixed step, as int8 would)."""
    flat = x.detach().reshape(-1).float()
    pad = (-flat.numel()) % _BLOCK
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, _BLOCK)
    scale = blocks.abs().amax(dim=1).clamp_min(1e-30) / _FP8_MAX
    codes = (blocks / scale[:, None]).to(torch.float8_e4m3fn).reshape(-1)[: flat.numel()]
    return codes, scale


def dequantize_blockwise(codes: Tensor, scale: Tensor, like: Tensor) -> Tensor:
    pad = (-codes.numel()) % _BLOCK
    values = torch.nn.functional.pad(codes.float(), (0, pad)).view(-1, _BLOCK) * scale[:, None]
    return values.reshape(-1)[: codes.numel()].view_as(like)


class AdamW8bit(torch.optim.Optimizer):
    """AdamW whose two moments are held in 8 bits (float8 e4m3, a float32 scale per block
    of 256): 2.03 bytes of state per parameter instead of 8. The second moment is stored as
    its square root, which halves its dynamic range. Each step dequantizes, updates in
    float32 exactly as AdamW does, and quantizes again."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):  # noqa: ANN001
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def load_state_dict(self, state_dict: dict) -> None:
        """torch casts floating-point state to its parameter's dtype on load: the float8
        codes would come back as float32, four times the memory this optimizer is chosen
        to save (until the next step re-quantized them). Cast back (exact: every value
        is a float8 one)."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("m_codes", "r_codes"):
                if key in state:
                    state[key] = state[key].to(torch.float8_e4m3fn)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch signature
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    zeros = torch.zeros_like(p, dtype=torch.float32)
                    state["m_codes"], state["m_scale"] = quantize_blockwise(zeros)
                    state["r_codes"], state["r_scale"] = quantize_blockwise(zeros)
                state["step"] += 1
                g = p.grad.float()
                m = dequantize_blockwise(state["m_codes"], state["m_scale"], g)
                v = dequantize_blockwise(state["r_codes"], state["r_scale"], g).square_()
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                t = state["step"]
                denom = (v / (1 - beta2**t)).sqrt_().add_(group["eps"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.addcdiv_(m, denom, value=-group["lr"] / (1 - beta1**t))
                state["m_codes"], state["m_scale"] = quantize_blockwise(m)
                state["r_codes"], state["r_scale"] = quantize_blockwise(v.sqrt_())


def lag_beta1(beta1: float, lag: float) -> float:
    """The first-moment decay that keeps a stage's total momentum at `beta1` when its
    gradients land `lag` steps late. Asynchrony acts as momentum (Mitliagkas et al.,
    "Asynchrony begets momentum", 2016): a delay of tau steps is about an implicit
    momentum of tau / (1 + tau), and momenta compose as 1 - (1 - a)(1 - b)."""
    return max(0.0, 1.0 - (1.0 - beta1) * (1.0 + max(0.0, lag)))


class InnerOptimizer:
    """The optimizer(s) of one stage behind one step()/zero_grad()/state_dict() surface."""

    def __init__(
        self,
        module: nn.Module,
        spec: InnerSpec,
        states: str = "fp32",
        when: str = "after-backward",
    ) -> None:
        """`states`: how AdamW's moments are held, `fp32` or `8bit` (AdamW8bit); `when`:
        `after-backward` (step() steps every parameter at once) or `in-backward` (one
        optimizer per parameter, so that step_param() can update each as soon as its
        gradient is ready). Both are a node's own memory choices (`--optimizer-states`,
        `--optimizer-step`), not the run's: replicas mix weights, never optimizer state."""
        if states not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer states must be one of {', '.join(OPTIMIZER_STATES)}")
        if when not in OPTIMIZER_STEPS:
            raise ValueError(f"optimizer step must be one of {', '.join(OPTIMIZER_STEPS)}")
        if when == "in-backward" and (why := in_backward_refusal(spec)) is not None:
            raise ValueError(why)
        self.spec, self.states, self.when = spec, states, when
        self.steps = 0
        self.skipped = 0
        """Steps skipped because the gradient norm was not finite (in-backward: tensors)."""
        self._norm_sq, self._clip_factor = 0.0, 1.0  # in-backward's one-step-late clipping
        decay, no_decay, hidden = [], [], []
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            table = name.endswith("kv_mix.tokens")  # a lookup table, not a hidden matrix
            in_a_block = "blocks" in name.split(".")  # a stage's, or the reference's stages'
            if spec.optimizer == "muon" and p.ndim == 2 and in_a_block and not table:
                hidden.append(p)
            elif p.ndim >= 2:
                decay.append(p)
            else:
                no_decay.append(p)
        self.params = decay + no_decay + hidden
        betas = (spec.beta1, spec.beta2)

        def adamw(groups: list[dict]) -> torch.optim.Optimizer:
            if states == "8bit":
                return AdamW8bit(groups, lr=spec.lr, betas=betas)
            return torch.optim.AdamW(groups, lr=spec.lr, betas=betas, foreach=True)

        def muon(params: list[Tensor]) -> torch.optim.Optimizer:
            # Muon's update has unit spectral norm per matrix: its lr is an absolute step size.
            return Muon(params, lr=0.02, weight_decay=spec.weight_decay)

        decays = [(decay, spec.weight_decay), (no_decay, 0.0)]
        if when == "after-backward":
            self.optimizers: list[torch.optim.Optimizer] = [
                adamw([{"params": ps, "weight_decay": wd} for ps, wd in decays])
            ]
            if hidden:
                self.optimizers.append(muon(hidden))
        else:  # one optimizer per parameter, in the same order as self.params
            self.optimizers = [
                adamw([{"params": [p], "weight_decay": wd}]) for ps, wd in decays for p in ps
            ] + [muon([p]) for p in hidden]
        self._base_lrs = [[g["lr"] for g in o.param_groups] for o in self.optimizers]
        self._by_param = {
            p: (opt, base)
            for opt, base in zip(self.optimizers, self._base_lrs, strict=True)
            for g in opt.param_groups
            for p in g["params"]
        }
        """The optimizer that steps each parameter and its groups' base lrs (keyed by the
        tensor's identity)."""

    def set_beta1(self, beta1: float) -> None:
        """AdamW's first-moment decay from the next step on (lag_beta1); Muon keeps its own."""
        for opt in self.optimizers:
            if isinstance(opt, Muon):
                continue
            for group in opt.param_groups:
                group["betas"] = (beta1, group["betas"][1])

    def lr_scale(self) -> float:
        warmup = self.spec.warmup_steps
        return min(1.0, (self.steps + 1) / warmup) if warmup else 1.0

    def step(self) -> float:
        """Clip, step every optimizer at the warm-up-scaled lr; returns the gradient norm.
        In-backward: steps the parameters whose gradients are still held (those that came
        while steps were held) and ends the step."""
        if self.when == "in-backward":
            for p in self.params:
                if p.grad is not None:
                    self.step_param(p, p.grad)
            return self.finish_step()
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.spec.grad_clip)
        if not math.isfinite(float(norm)):
            # an overflow somewhere in the accumulated micro-batches (a peer's finite but
            # huge activation or gradient can cause one): skip rather than write NaN weights
            self.skipped += 1
            return float(norm)
        scale = self.lr_scale()
        for opt, base in zip(self.optimizers, self._base_lrs, strict=True):
            for group, lr in zip(opt.param_groups, base, strict=True):
                group["lr"] = lr * scale
            opt.step()
        self.steps += 1
        return float(norm)

    def step_param(self, param: Tensor, grad: Tensor) -> bool:
        """In-backward: update one parameter with its gradient now, at the lr of the step
        under way (`finish_step` ends the step). The step's whole gradient norm is not known
        yet, so clipping is one step late: the gradient is scaled by the factor the last
        step's norm called for, and no tensor's norm may exceed `grad_clip` (a bound that
        holds from the first step, whatever a peer sent). Whenever no clipping is due, the
        update is step()'s exactly. A non-finite gradient leaves the parameter as it was
        and is counted in `skipped`."""
        norm = float(grad.norm())
        if not math.isfinite(norm):
            self.skipped += 1
            return False
        self._norm_sq += norm * norm
        factor = min(self._clip_factor, self.spec.grad_clip / (norm + 1e-6))
        if factor < 1:
            grad = grad * factor
        opt, base = self._by_param[param]
        for group, lr in zip(opt.param_groups, base, strict=True):
            group["lr"] = lr * self.lr_scale()
        param.grad = grad
        try:
            opt.step()
        finally:
            param.grad = None
        return True

    def finish_step(self) -> float:
        """In-backward: every parameter of the step was updated (step_param); sets the next
        step's clipping factor from this step's norm, which it returns."""
        norm = math.sqrt(self._norm_sq)
        self._norm_sq = 0.0
        self._clip_factor = min(1.0, self.spec.grad_clip / (norm + 1e-6))
        self.steps += 1
        return norm

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return {
            "steps": self.steps,
            "states": self.states,
            "when": self.when,
            "optimizers": [o.state_dict() for o in self.optimizers],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint's optimizer; one saved with other `states` (the node's
        --optimizer-states changed) keeps its step count and starts its moments afresh."""
        self.steps = int(state["steps"])
        saved = (state.get("states", "fp32"), state.get("when", "after-backward"))
        if saved != (self.states, self.when):
            log.warning(
                "optimizer moments were saved as %s stepped %s, this node holds %s stepped "
                "%s: starting them afresh",
                *saved,
                self.states,
                self.when,
            )
            return
        for opt, s in zip(self.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(s)


def in_backward_refusal(spec: InnerSpec) -> str | None:
    """Why `--optimizer-step in-backward` cannot train a run with inner settings `spec`
    (one that accumulates micro-batches), or None when it can."""
    if spec.weight_prediction:
        return (
            "--optimizer-step in-backward steps each parameter inside the backward, where "
            "weight prediction (inner.weight_prediction in the manifest) cannot see the "
            "step's move; use --optimizer-step after-backward"
        )
    if spec.local_batch == spec.micro_batch:
        return None
    return (
        f"--optimizer-step in-backward steps after every micro-batch, but this run "
        f"accumulates {spec.local_batch // spec.micro_batch} micro-batches (local_batch "
        f"{spec.local_batch}, micro_batch {spec.micro_batch}) per inner step: the summed "
        "gradients must all be held there; use --optimizer-step after-backward"
    )
