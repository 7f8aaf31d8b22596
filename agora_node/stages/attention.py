"""Attention with a mask of positions and documents, and attention split over parts of
the keys whose results merge exactly (a context-parallel member's own keys and the
others', stages/context_parallel.py).

A query sees a key only when the key is not later in the sequence and lies in the same
document (`attention_mask`). `masked_attention` attends over all keys at once.
`attend_part` attends over one part of the keys and returns the log-sum-exp with the
output; `merge_parts` combines parts over disjoint keys into the attention over all of
them, forward and backward (each part's backward takes the merged output and
log-sum-exp, as ring attention does): torch's fused CPU kernel where it has one that
returns and takes back the log-sum-exp, plain matmuls on other devices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def attention_mask(q_pos: Tensor, k_pos: Tensor, q_doc: Tensor, k_doc: Tensor) -> Tensor:
    """[Tq, Tk] True where query may attend to key: causal by position, same document.
    With documents per sample (q_doc [B, Tq], k_doc [B, Tk]) the mask is [B, Tq, Tk]."""
    causal = k_pos[None, :] <= q_pos[:, None]
    return causal & (k_doc[..., None, :] == q_doc[..., :, None])


def masked_attention(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, doc_ids: Tensor | None
) -> Tensor:
    """Attention of queries at q_pos over keys of the whole sequence (positions 0..T-1).

    The [Tq, T] mask is built inside a checkpoint: scaled_dot_product_attention keeps a
    float copy of it for backward (as large as the attention weights of one head), so it
    is rebuilt with the attention in backward instead of being held all along."""
    if not torch.is_grad_enabled():
        return _attend_masked(q, k, v, q_pos, doc_ids)
    return checkpoint(_attend_masked, q, k, v, q_pos, doc_ids, use_reentrant=False)


def _attend_masked(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, doc_ids: Tensor | None
) -> Tensor:
    t = k.shape[-2]
    k_pos = torch.arange(t, device=q.device)
    docs = doc_ids if doc_ids is not None else torch.zeros(t, dtype=torch.long, device=q.device)
    q_pos = q_pos.to(q.device)
    mask = attention_mask(q_pos, k_pos, docs[..., q_pos], docs)
    if mask.dim() == 3:  # one mask per sample, the same for every head
        mask = mask[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


# ---- attention in parts, merged by log-sum-exp --------------------------------------


class PartsMerge:
    """The merged output and log-sum-exp of one attention split over key parts: every
    part's backward needs them (filled in by `merge_parts`)."""

    out: Tensor | None = None
    lse: Tensor | None = None


def attend_part(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    doc_ids: Tensor | None,
    merge: PartsMerge,
) -> tuple[Tensor, Tensor]:
    """Queries [B, H, Tq, hd] at q_pos over the keys and values [B, Hkv, Tk, hd] at k_pos
    (causal, within documents): (out, log-sum-exp [B, H, Tq]; -inf where no key is
    visible). Parts over disjoint keys combine with `merge_parts` into the attention
    over all of them, forward and backward, exactly."""
    return _AttendPart.apply(q, k, v, q_pos, k_pos, doc_ids, merge)


def merge_parts(merge: PartsMerge, *parts: tuple[Tensor, Tensor]) -> Tensor:
    """The attention over the union of the parts' keys, [B, H, Tq, hd]."""
    flat = [t for part in parts for t in part]
    return _MergeParts.apply(merge, *flat)


def _part_bias(
    q_pos: Tensor, k_pos: Tensor, doc_ids: Tensor | None, dtype: torch.dtype, device
) -> tuple[Tensor, Tensor]:
    """(additive mask [B or 1, 1, Tq, Tk] with -inf where a key is hidden, visible [.., Tq])."""
    q_pos, k_pos = q_pos.to(device), k_pos.to(device)
    if doc_ids is None:
        visible = k_pos[None, :] <= q_pos[:, None]
    else:
        docs = doc_ids.to(device)
        visible = attention_mask(q_pos, k_pos, docs[..., q_pos], docs[..., k_pos])
    visible = visible if visible.dim() == 3 else visible[None]
    bias = torch.zeros(visible.shape, dtype=dtype, device=device)
    bias = bias.masked_fill(~visible, float("-inf"))[:, None]
    return bias, visible.any(-1)[:, None]


def _fused(q: Tensor) -> bool:
    """Whether torch has a fused attention kernel here that returns the log-sum-exp and
    takes it back in backward (CPU); elsewhere the parts run as plain matmuls."""
    return q.device.type == "cpu" and FUSED_PARTS


FUSED_PARTS = True
"""False runs the plain-matmul parts on CPU too (tests compare the two)."""


def _part_forward(q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    scale = q.shape[-1] ** -0.5
    if _fused(q):  # the fused kernel that also gives the log-sum-exp
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=bias, scale=scale
        )
        return out, lse.float()
    scores = (q @ k.transpose(-2, -1)).float() * scale + bias.float()
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0)[..., None])
    return (probs.to(v.dtype) @ v), lse


def _part_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, bias: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of one part, given the *merged* output and log-sum-exp: with them the
    usual attention backward is the part's share of the whole one's (as in ring
    attention)."""
    scale = q.shape[-1] ** -0.5
    if _fused(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse.to(torch.float32), 0.0, False, attn_mask=bias, scale=scale
        )
    scores = (q @ k.transpose(-2, -1)).float() * scale + bias.float()
    probs = torch.exp(scores - lse[..., None])
    grad_v = probs.to(grad.dtype).transpose(-2, -1) @ grad
    grad_probs = (grad @ v.transpose(-2, -1)).float()
    grad_scores = probs * (grad_probs - (grad.float() * out.float()).sum(-1, keepdim=True))
    grad_q = (grad_scores.to(k.dtype) @ k) * scale
    grad_k = (grad_scores.to(q.dtype).transpose(-2, -1) @ q) * scale
    return grad_q, grad_k, grad_v


def _repeat_heads(t: Tensor, heads: int) -> Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


class _AttendPart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_pos, k_pos, doc_ids, merge):  # noqa: ANN001
        heads = q.shape[1]
        bias, visible = _part_bias(q_pos, k_pos, doc_ids, q.dtype, q.device)
        out, lse = _part_forward(q, _repeat_heads(k.to(q.dtype), heads),
                                 _repeat_heads(v.to(q.dtype), heads), bias)  # fmt: skip
        lse = lse.masked_fill(~visible, float("-inf"))  # the kernel says 0 there
        out = out.masked_fill(~visible[..., None], 0.0)
        ctx.save_for_backward(q, k, v, q_pos, k_pos, doc_ids)
        ctx.merge = merge
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad: Tensor, _lse):  # noqa: ANN001
        q, k, v, q_pos, k_pos, doc_ids = ctx.saved_tensors
        heads, merge = q.shape[1], ctx.merge
        bias, _ = _part_bias(q_pos, k_pos, doc_ids, q.dtype, q.device)  # rebuilt, not kept
        grad_q, grad_k, grad_v = _part_backward(
            grad.to(q.dtype), q, _repeat_heads(k.to(q.dtype), heads),
            _repeat_heads(v.to(q.dtype), heads), merge.out, merge.lse, bias,
        )  # fmt: skip
        group = heads // k.shape[1]
        if group > 1:  # each key/value head served `group` query heads
            grad_k = grad_k.unflatten(1, (k.shape[1], group)).sum(2)
            grad_v = grad_v.unflatten(1, (v.shape[1], group)).sum(2)
        return grad_q, grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None, None


class _MergeParts(torch.autograd.Function):
    """Forward: the parts' outputs weighted by exp(lse_part - lse). Backward: every part
    gets the merged output's gradient whole; its own backward takes the merged output
    and log-sum-exp from `merge`, which together give its exact share."""

    @staticmethod
    def forward(ctx, merge: PartsMerge, *flat: Tensor):
        outs, lses = flat[0::2], flat[1::2]
        lse = lses[0]
        for other in lses[1:]:
            lse = torch.logaddexp(lse, other)
        # laid out [B, Tq, H, hd] in memory: the attention's output projection then reads
        # (and keeps for its backward) this very tensor rather than a copy
        out = sum(
            o.transpose(1, 2).float() * torch.exp(part - lse).transpose(1, 2)[..., None]
            for o, part in zip(outs, lses, strict=True)
        )
        out = out.to(outs[0].dtype).transpose(1, 2)
        # detached (the same storage): the output itself will carry this node as its
        # grad_fn, and the parts' nodes hold `merge`: a cycle through autograd's C++
        # graph, which Python's collector cannot see, would keep every layer's graph
        ctx.parts = len(outs)
        merge.out, merge.lse = out.detach(), lse
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return (None, *[g for _ in range(ctx.parts) for g in (grad, None)])
