"""Context parallelism inside a stage: a cell of c peers splits each sequence.

Every member of a cell holds the same stage weights and a share of each sequence's
tokens (the zig-zag layout: the sequence is cut into 2c pieces and member m holds
pieces m and 2c-1-m, so causal attention work is balanced). Queries, the MLP and
the residual stream stay local; for attention each member needs keys and values of
the whole sequence, so the members send each other the activation that produces K and
V (z = attn_norm(x)) and each computes K, V with its own (identical) weights; in
backward every member sends back the gradient its queries put on each other member's
z. Parameter gradients summed over the members equal the single-peer gradients.

Overlap: a member posts its z (`post_sources`) and attends to its own keys while the
others' travel, then to theirs, and the two parts merge exactly by log-sum-exp
(stages/attention.py: `attend_part`, `merge_parts`). Backward runs in the reverse order of recording: the
gradients for the others' z are posted first and travel while the member's own part's
backward runs.

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
and lies in the same document (stages/attention.py `attention_mask`).

The exchange between members is an `Exchange` (an all-to-all of tensors); the
frames it sends are checked on receipt (kv_frames.py): a frame of the wrong layer,
member, length, rank or dtype is refused with a code. `LocalCell` runs a cell's
members as threads of one process (tests, benchmarks); comms/cell_link.py runs them
over libp2p.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from agora_node.stages.kv_frames import (
    KIND_DENSE,
    KIND_GRAD,
    KIND_MIXTURE,
    FramedExchange,
    KVExpect,
    PostedFrames,
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


# ---- the exchange between cell members ---------------------------------------------


class LocalCell:
    """The members of one cell as threads of this process (tests and benchmarks).

    `latency_s` (benchmarks) emulates a link: what a member posts can be read that
    long after it was posted, so work done between posting and waiting hides it."""

    def __init__(self, size: int, timeout_s: float = 60.0, latency_s: float = 0.0) -> None:
        self.size, self.latency_s = size, latency_s
        self._barrier = threading.Barrier(size, timeout=timeout_s)
        self._slots: list[list[Tensor] | None] = [None] * size
        self._posted_at = [0.0] * size

    def member(self, rank: int) -> LocalExchange:
        return LocalExchange(self, rank)


@dataclass
class LocalExchange:
    cell: LocalCell
    rank: int
    bytes_sent: int = 0
    wait_s: float = 0.0
    """Seconds spent waiting for the other members' sends (after posting its own)."""

    @property
    def size(self) -> int:
        return self.cell.size

    def all_to_all(self, sends: list[Tensor]) -> list[Tensor]:
        return self.post(sends).wait()

    def post(self, sends: list[Tensor]) -> LocalExchange:
        if len(sends) != self.size:
            raise ValueError(f"all_to_all needs one tensor per member ({self.size})")
        self.bytes_sent += sum(
            t.numel() * t.element_size() for j, t in enumerate(sends) if j != self.rank
        )
        self.cell._slots[self.rank] = [t.detach().clone() for t in sends]
        self.cell._posted_at[self.rank] = time.monotonic()
        return self  # one exchange at a time per member: its own handle

    def wait(self) -> list[Tensor]:
        cell, started = self.cell, time.monotonic()
        cell._barrier.wait()  # every member has posted
        if cell.latency_s:
            others = [at for j, at in enumerate(cell._posted_at) if j != self.rank]
            time.sleep(max(0.0, max(others) + cell.latency_s - time.monotonic()))
        got = [cell._slots[src][self.rank] for src in range(self.size)]
        cell._barrier.wait()  # nobody refills a slot before every member has read
        self.wait_s += time.monotonic() - started
        return got


# ---- the exchange of K/V sources, and of their gradients in backward ---------------


@dataclass
class CellContext:
    """What attention needs to run as one member of a cell, for one micro-batch."""

    layout: ChunkLayout
    exchange: FramedExchange
    dense_dtype: torch.dtype = torch.float32
    """Precision of a dense exchange (bf16 rounds z in the model, as the wire does)."""
    overlap: bool = True
    """Attend to the member's own keys while the others' K/V sources travel (and, in
    backward, while the gradients for theirs travel). False waits first: the same
    result, for measuring what the overlap hides."""

    @property
    def member(self) -> int:
        return self.exchange.rank

    @property
    def positions(self) -> Tensor:
        return self.layout.positions(self.member)

    def lengths(self) -> list[int]:
        return [self.layout.length(m) for m in range(self.layout.size)]

    def others(self) -> list[int]:
        return [m for m in range(self.layout.size) if m != self.member]

    @property
    def remote_positions(self) -> Tensor:
        """Global positions the other members hold, in member order."""
        return torch.cat([self.layout.positions(m) for m in self.others()])


@dataclass(eq=False)
class _SourceLink:
    """One layer's exchange of K/V sources between this member and the others: what
    it posted, and (backward) the gradients it posted back."""

    cell: CellContext
    layer: int
    kind: int
    dtype: torch.dtype
    num_subspaces: int
    vocab: int
    width: int = 0
    batch: int = 0
    _sources: PostedFrames | None = None
    _grads: PostedFrames | None = None

    def post(self, values: Tensor, choice: Tensor | None, tokens: Tensor | None) -> None:
        self.batch, _, self.width = values.shape
        frame = encode_kv_frame(
            layer=self.layer,
            member=self.cell.member,
            kind=self.kind,
            values=values.detach().to(self.dtype).cpu(),
            choice=None if choice is None else choice.cpu(),
            tokens=None if tokens is None else tokens.cpu(),
            vocab=self.vocab,
        )
        me = self.cell.member
        frames = [b"" if j == me else frame for j in range(self.cell.layout.size)]
        self._sources = self.cell.exchange.post_frames(frames)

    def receive(self, device: torch.device) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The others' values (and choices, token ids), concatenated in member order."""
        cell, lengths = self.cell, self.cell.lengths()
        expects = [
            KVExpect(self.layer, src, self.kind, self.batch, lengths[src], self.width,
                     self.dtype, self.vocab)
            for src in range(cell.layout.size)
        ]  # fmt: skip
        got = [g for g in self._sources.collect(expects, self.num_subspaces) if g is not None]
        self._sources = None
        values, choice, tokens = (
            None if got[0][i] is None else torch.cat([g[i] for g in got], dim=1).to(device)
            for i in range(3)
        )
        return values, choice, tokens

    def post_grads(self, grad: Tensor) -> None:
        """Send each other member the gradient this member's queries put on its values."""
        cell = self.cell
        lengths = cell.lengths()
        pieces = iter(torch.split(grad.float().cpu(), [lengths[m] for m in cell.others()], 1))
        frames = [
            b""
            if j == cell.member
            else encode_kv_frame(
                layer=self.layer, member=cell.member, kind=KIND_GRAD,
                values=next(pieces).contiguous(),
            )
            for j in range(cell.layout.size)
        ]  # fmt: skip
        self._grads = cell.exchange.post_frames(frames)

    def collect_grads(self, like: Tensor, device: torch.device) -> Tensor:
        """The sum of the gradients the others' queries put on this member's values."""
        cell = self.cell
        n = cell.layout.length(cell.member)
        expects = [
            KVExpect(self.layer, src, KIND_GRAD, self.batch, n, self.width, torch.float32)
            for src in range(cell.layout.size)
        ]
        got = self._grads.collect(expects)
        self._grads = None
        total = torch.zeros(like.shape, dtype=torch.float32)
        for item in got:
            if item is not None:
                total += item[0]
        return total.to(device, like.dtype)


class _SendSources(torch.autograd.Function):
    """Forward: post this member's K/V source values to the others and return a ticket
    (an empty tensor) that `_ReceiveSources` takes. Backward: the gradients the others'
    queries put on these values (posted back by `_ReceiveSources.backward`). Autograd
    runs this member's own attention backward in between: it was recorded later."""

    @staticmethod
    def forward(ctx, values: Tensor, choice, tokens, link: _SourceLink):  # noqa: ANN001
        link.post(values, choice, tokens)
        ctx.link, ctx.like = link, values.new_empty(values.shape, device="meta")
        return values.new_empty(0)

    @staticmethod
    def backward(ctx, _ticket: Tensor):
        return ctx.link.collect_grads(ctx.like, _ticket.device), None, None, None


class _ReceiveSources(torch.autograd.Function):
    """Forward: wait for the others' values. Backward: post each its gradient."""

    @staticmethod
    def forward(ctx, ticket: Tensor, link: _SourceLink):
        values, choice, tokens = link.receive(ticket.device)
        ctx.link = link
        for side in (choice, tokens):
            if side is not None:
                ctx.mark_non_differentiable(side)
        return values.to(ticket.dtype), choice, tokens

    @staticmethod
    def backward(ctx, grad: Tensor, _choice, _tokens):  # noqa: ANN001
        ctx.link.post_grads(grad)
        return grad.new_zeros(0), None


@dataclass(eq=False)
class PostedSources:
    """A member's K/V sources for one layer: its own at once, the others' once they came."""

    own: Tensor
    """[B, n_me, d] the source of K and V at the member's own positions."""
    cell: CellContext
    _ticket: Tensor
    _link: _SourceLink
    _decode: object
    """Received (values, choice, ids) -> [B, T - n_me, d]."""

    def receive(self) -> Tensor:
        """[B, T - n_me, d] the sources at the other members' positions
        (`cell.remote_positions`); blocks until their frames are here."""
        values, choice, tokens = _ReceiveSources.apply(self._ticket, self._link)
        return self._decode(values, choice, tokens)


def post_sources(
    z: Tensor,
    mixture: SubspaceMixture | None,
    cell: CellContext,
    layer: int,
    tokens: Tensor | None = None,
    remote_only: bool = False,
) -> PostedSources:
    """Send what the other members need of z for their K and V (z at the wire's dense
    precision, or its mixture coefficients and choices, and the token ids with a token
    table) and return this member's own sources; the others' come with `receive`.
    With `remote_only` (kv_compress = "remote") a member's own sources are z itself."""
    if mixture is None:  # a dense exchange, at the wire's precision
        z = round_through(z, cell.dense_dtype)
        link = _SourceLink(cell, layer, KIND_DENSE, cell.dense_dtype, 0, 0)
        ticket = _SendSources.apply(z, None, None, link)
        return PostedSources(z, cell, ticket, link, lambda v, c, t: v)
    coeffs, choice = mixture.encode(z, tokens)
    ids = tokens if mixture.tokens is not None else None
    link = _SourceLink(cell, layer, KIND_MIXTURE, torch.bfloat16, mixture.count, mixture.vocab)
    ticket = _SendSources.apply(coeffs, choice, ids, link)
    own = z if remote_only else mixture.decode(coeffs, choice, ids)
    return PostedSources(own, cell, ticket, link, mixture.decode)


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
    tokens: Tensor | None = None,
    remote_only: bool = False,
) -> Tensor:
    """What a peer alone computes K and V from: z itself, or (kv_compress = "all") its
    mixture reconstruction. `tokens` are the ids of z's tokens. (A cell member's come
    from `post_sources`.)"""
    if mixture is None or remote_only:
        return z  # nothing the model compresses
    coeffs, choice = mixture.encode(z, tokens)
    return mixture.decode(coeffs, choice, tokens if mixture.tokens is not None else None)
