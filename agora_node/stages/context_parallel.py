"""Context parallelism inside a stage: a cell of c peers splits each sequence.

Every member of a cell holds the same stage weights and a share of each sequence's
tokens (the zig-zag layout: the sequence is cut into 2c pieces and member m holds
pieces m and 2c-1-m, so causal attention work is balanced). Queries, the MLP and
the residual stream stay local; for attention each member needs keys and values of
the whole sequence, so the members all-gather the activation that produces K and V
(z = attn_norm(x)) and each computes K, V with its own (identical) weights. The
backward of that all-gather is a reduce-scatter: every member sends back the
gradient its queries put on each other member's z. Parameter gradients summed over
the members equal the single-peer gradients.

Compression (Mixtures of Subspaces): with `kv_rank` r > 0, z is replaced *in the
model* by its projection onto one of `kv_subspaces` learned rank-r bases, chosen
per token (the basis that keeps the most of z), and the r coefficients are rounded
to bf16 with a straight-through gradient. The wire then carries r bf16 values and
a one-byte choice per token per layer, and the receiver rebuilds exactly what the
sender used; nothing is lost on the wire that the model did not already drop. With
`kv_compress = "remote"` only what crosses the wire is compressed: a member's own
tokens' K/V come from z itself (the mixture is then a codec the model learns to read,
and a peer alone trains the dense model). With
`kv_tokens` each block also learns one d-vector per token id: the mixture compresses
z minus its token's row and the receiver adds the row back, so what a token is (the
part of z a rank-r subspace cannot hold for a whole vocabulary) costs only its id on
the wire, and the subspaces carry what the context made of it.

Packed sequences: a query sees a key only when it is not later in the sequence
and lies in the same document (stages/data.py `document_ids`).

The exchange between members is an `Exchange` (an all-to-all of tensors); the
frames it sends are checked on receipt (kv_frames.py): a frame of the wrong layer,
member, length, rank or dtype is refused with a code. `LocalCell` runs a cell's
members as threads of one process (tests, benchmarks); comms/cell_link.py runs them
over libp2p.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from agora_node.stages.kv_frames import (
    KIND_DENSE,
    KIND_GRAD,
    KIND_MIXTURE,
    FramedExchange,
    KVExpect,
    encode_kv_frame,
)

# ---- which tokens each member holds ------------------------------------------------


@dataclass(frozen=True)
class ChunkLayout:
    """Zig-zag split of `seq_len` positions over `size` members (uneven lengths allowed)."""

    seq_len: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 1 or self.seq_len < 2 * self.size:
            raise ValueError(
                f"cannot split {self.seq_len} positions over {self.size} members: "
                f"need at least 2 per member"
            )

    def pieces(self) -> list[range]:
        """2c contiguous pieces, as even as possible (the first ones one longer)."""
        n = 2 * self.size
        base, extra = divmod(self.seq_len, n)
        out, start = [], 0
        for i in range(n):
            stop = start + base + (i < extra)
            out.append(range(start, stop))
            start = stop
        return out

    def positions(self, member: int) -> Tensor:
        """Global positions member `member` holds, ascending."""
        if not 0 <= member < self.size:
            raise ValueError(f"member {member} outside 0..{self.size - 1}")
        pieces = self.pieces()
        first, second = pieces[member], pieces[2 * self.size - 1 - member]
        return torch.cat(
            [torch.arange(first.start, first.stop), torch.arange(second.start, second.stop)]
        )

    def length(self, member: int) -> int:
        return len(self.positions(member))

    def take(self, x: Tensor, member: int, dim: int = 1) -> Tensor:
        """Member `member`'s tokens of a full-sequence tensor."""
        return x.index_select(dim, self.positions(member).to(x.device))

    def assemble(self, parts: list[Tensor], dim: int = 1) -> Tensor:
        """The full sequence from every member's part (in member order)."""
        order = torch.cat([self.positions(m) for m in range(self.size)])
        joined = torch.cat(parts, dim=dim)
        return joined.index_select(dim, torch.argsort(order).to(joined.device))


def attention_mask(q_pos: Tensor, k_pos: Tensor, q_doc: Tensor, k_doc: Tensor) -> Tensor:
    """[Tq, Tk] True where query may attend to key: causal by position, same document.
    With documents per sample (q_doc [B, Tq], k_doc [B, Tk]) the mask is [B, Tq, Tk]."""
    causal = k_pos[None, :] <= q_pos[:, None]
    return causal & (k_doc[..., None, :] == q_doc[..., :, None])


# ---- the exchange between cell members ---------------------------------------------


class LocalCell:
    """The members of one cell as threads of this process (tests and benchmarks)."""

    def __init__(self, size: int, timeout_s: float = 60.0) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=timeout_s)
        self._slots: list[list[Tensor] | None] = [None] * size

    def member(self, rank: int) -> LocalExchange:
        return LocalExchange(self, rank)


@dataclass
class LocalExchange:
    cell: LocalCell
    rank: int
    bytes_sent: int = 0

    @property
    def size(self) -> int:
        return self.cell.size

    def all_to_all(self, sends: list[Tensor]) -> list[Tensor]:
        if len(sends) != self.size:
            raise ValueError(f"all_to_all needs one tensor per member ({self.size})")
        self.bytes_sent += sum(
            t.numel() * t.element_size() for j, t in enumerate(sends) if j != self.rank
        )
        self.cell._slots[self.rank] = [t.detach().clone() for t in sends]
        self.cell._barrier.wait()
        got = [self.cell._slots[src][self.rank] for src in range(self.size)]
        self.cell._barrier.wait()  # nobody refills a slot before every member has read
        return got


# ---- the all-gather of K/V sources, and its reduce-scatter backward ---------------


@dataclass
class CellContext:
    """What attention needs to run as one member of a cell, for one micro-batch."""

    layout: ChunkLayout
    exchange: FramedExchange
    dense_dtype: torch.dtype = torch.float32
    """Precision of a dense exchange (bf16 rounds z in the model, as the wire does)."""

    @property
    def member(self) -> int:
        return self.exchange.rank

    @property
    def positions(self) -> Tensor:
        return self.layout.positions(self.member)


class _GatherSources(torch.autograd.Function):
    """Forward: every member's K/V source values (and choices, token ids), concatenated
    in member order. Backward: each member gets back the gradients the others put on
    its values."""

    @staticmethod
    def forward(
        ctx,
        values: Tensor,
        choice: Tensor | None,
        tokens: Tensor | None,
        cell: CellContext,
        layer: int,
        kind: int,
        dtype: torch.dtype,
        num_subspaces: int,
        vocab: int,
    ):
        b, _, width = values.shape
        me, size = cell.member, cell.layout.size
        frame = encode_kv_frame(
            layer=layer,
            member=me,
            kind=kind,
            values=values.detach().to(dtype),
            choice=choice,
            tokens=tokens,
            vocab=vocab,
        )
        expects = [
            KVExpect(layer, src, kind, b, cell.layout.length(src), width, dtype, vocab)
            for src in range(size)
        ]
        got = cell.exchange.exchange_frames(
            [b"" if j == me else frame for j in range(size)], expects, num_subspaces
        )
        parts, choices, ids = [], [], []
        for item in got:
            if item is None:
                parts.append(values.detach())
                choices.append(choice)
                ids.append(tokens)
            else:
                parts.append(item[0].to(values.dtype))
                choices.append(item[1])
                ids.append(item[2])
        ctx.cell, ctx.layer, ctx.width = cell, layer, width
        gathered = torch.cat(parts, dim=1)
        gathered_choice = None if choice is None else torch.cat(choices, dim=1)
        gathered_ids = None if tokens is None else torch.cat(ids, dim=1)
        for side in (gathered_choice, gathered_ids):
            if side is not None:
                ctx.mark_non_differentiable(side)
        return gathered, gathered_choice, gathered_ids

    @staticmethod
    def backward(ctx, grad: Tensor, _grad_choice: Tensor | None, _grad_ids: Tensor | None):
        cell: CellContext = ctx.cell
        me, size, layout = cell.member, cell.layout.size, cell.layout
        lengths = [layout.length(m) for m in range(size)]
        pieces = list(torch.split(grad.contiguous(), lengths, dim=1))
        b = grad.shape[0]
        frames = [
            b""
            if j == me
            else encode_kv_frame(
                layer=ctx.layer, member=me, kind=KIND_GRAD, values=pieces[j].float().contiguous()
            )
            for j in range(size)
        ]
        expects = [
            KVExpect(ctx.layer, src, KIND_GRAD, b, lengths[me], ctx.width, torch.float32)
            for src in range(size)
        ]
        got = cell.exchange.exchange_frames(frames, expects)
        total = pieces[me].clone()
        for item in got:
            if item is not None:
                total += item[0].to(total.dtype)
        return total, None, None, None, None, None, None, None, None


def gather_sources(
    values: Tensor,
    choice: Tensor | None,
    cell: CellContext,
    layer: int,
    dtype: torch.dtype,
    num_subspaces: int = 0,
    tokens: Tensor | None = None,
    vocab: int = 0,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """[B, n_me, w] local values (with their choices and token ids, for a mixture) ->
    [B, seq_len, w] for the whole sequence, in global order."""
    kind = KIND_DENSE if choice is None else KIND_MIXTURE
    gathered, *sides = _GatherSources.apply(
        values, choice, tokens, cell, layer, kind, dtype, num_subspaces, vocab
    )
    lengths = _lengths(cell)
    full, choice_full, ids_full = (
        None if t is None else cell.layout.assemble(list(torch.split(t, lengths, dim=1)))
        for t in (gathered, *sides)
    )
    return full, choice_full, ids_full


def _lengths(cell: CellContext) -> list[int]:
    return [cell.layout.length(m) for m in range(cell.layout.size)]


def round_through(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x rounded to `dtype` and back, with the gradient of the identity (straight-through)."""
    if dtype == x.dtype:
        return x
    return x + (x.detach().to(dtype).to(x.dtype) - x.detach())


# ---- the learned mixture of subspaces -----------------------------------------------


class SubspaceMixture(nn.Module):
    """`count` trainable d x r bases; each token keeps its projection on one of them.

    With `vocab` > 0 (manifest `kv_tokens`) a trainable table holds one d-vector per
    token id (zero at start): the bases then code z minus its token's row, and decoding
    adds the row back."""

    def __init__(self, d_model: int, rank: int, count: int, vocab: int = 0) -> None:
        super().__init__()
        if not 1 <= count <= 256:
            raise ValueError(f"kv_subspaces must be 1..256 (one byte per token), not {count}")
        self.rank, self.count, self.vocab = rank, count, vocab
        self.bases = nn.Parameter(torch.empty(d_model, count * rank))
        self.tokens = nn.Parameter(torch.zeros(vocab, d_model)) if vocab else None

    def encode(self, z: Tensor, tokens: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """z [B, n, d] -> (coefficients [B, n, r] on the bf16 grid, choice [B, n])."""
        if self.tokens is not None:
            z = z - self.tokens[_ids(tokens)]
        proj = (z @ self.bases).unflatten(-1, (self.count, self.rank))
        choice = proj.detach().norm(dim=-1).argmax(dim=-1)
        index = choice[..., None, None].expand(*choice.shape, 1, self.rank)
        coeffs = proj.gather(-2, index).squeeze(-2)
        return round_through(coeffs, torch.bfloat16), choice

    def decode(self, coeffs: Tensor, choice: Tensor, tokens: Tensor | None = None) -> Tensor:
        """(coefficients, choice[, token ids]) -> the reconstruction of z, [B, n, d]."""
        spread = coeffs.new_zeros(*coeffs.shape[:-1], self.count, self.rank)
        index = choice[..., None, None].expand(*choice.shape, 1, self.rank)
        spread = spread.scatter(-2, index, coeffs.unsqueeze(-2))
        out = spread.flatten(-2) @ self.bases.t()
        return out if self.tokens is None else out + self.tokens[_ids(tokens)]


def _ids(tokens: Tensor | None) -> Tensor:
    if tokens is None:
        raise ValueError("this mixture keeps a token table (kv_tokens): it needs the token ids")
    return tokens


def init_mixture_bases(bases: Tensor, rank: int, generator: torch.Generator) -> None:
    """Each d x r block with orthonormal columns: at init a token keeps its best projection."""
    d, total = bases.shape
    for start in range(0, total, rank):
        q, _ = torch.linalg.qr(torch.randn(d, rank, generator=generator, dtype=torch.float64))
        bases[:, start : start + rank] = q.to(bases.dtype)


def kv_source(
    z: Tensor,
    mixture: SubspaceMixture | None,
    cell: CellContext | None,
    layer: int,
    tokens: Tensor | None = None,
    remote_only: bool = False,
) -> Tensor:
    """The activation K and V are computed from, for the whole sequence: [B, T, d].

    Alone (cell None) that is z itself, or its mixture reconstruction. In a cell the
    members all-gather what they send: z (dense) or coefficients and choices (and the
    token ids, with a token table). `tokens` are the ids of z's tokens. With
    `remote_only` (manifest kv_compress = "remote") a member's own positions keep z
    itself and only what it received is the mixture's reconstruction."""
    if cell is None and (mixture is None or remote_only):
        return z  # alone, and nothing the model compresses
    if mixture is None:  # a dense exchange, at the wire's precision
        z = round_through(z, cell.dense_dtype)
        return gather_sources(z, None, cell, layer, cell.dense_dtype)[0]
    coeffs, choice = mixture.encode(z, tokens)
    if mixture.tokens is None:
        tokens = None
    if cell is not None:
        coeffs, choice, tokens = gather_sources(
            coeffs, choice, cell, layer, torch.bfloat16, mixture.count, tokens, mixture.vocab
        )
    full = mixture.decode(coeffs, choice, tokens)
    if remote_only:  # a member's own positions never crossed the wire
        full = full.index_copy(1, cell.positions.to(z.device), z)
    return full


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
