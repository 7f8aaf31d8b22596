"""The model and how it is cut: a Llama-style decoder built stage by stage.

Every parameter is initialized from a generator seeded by (run seed, parameter
name), and a stage names its blocks by their global index, so stage k built
alone holds exactly the weights the unsplit model would hold there.

Subspace option (Protocol Models): blocks whose output crosses a stage boundary
write their attention and MLP outputs into span(U), U a d x k orthonormal basis
derived from the seed, and the token embedding is a fixed random table T plus a
trainable rank-k part. The residual stream x then satisfies x - T[tok] in
span(U) at every boundary, so it travels as c = (x - T[tok]) U (k values per
token) and is rebuilt exactly; the gradient sent upstream is dL/dx U.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from agora_node.protocol.manifest import Manifest, ModelSpec
from agora_node.stages.attention import PartsMerge, attend_part, masked_attention, merge_parts
from agora_node.stages.context_parallel import (
    CellContext,
    SubspaceMixture,
    init_mixture_bases,
    kv_source,
    post_sources,
)


def seeded_generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def subspace_basis(manifest: Manifest) -> Tensor:
    """U: d x k with orthonormal columns, identical on every peer of the run."""
    d, k = manifest.model.d_model, manifest.model.subspace_rank
    g = seeded_generator(manifest.run.seed, "subspace_basis")
    q, _ = torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64))
    return q.to(torch.float32).contiguous()


def fixed_embedding(manifest: Manifest) -> Tensor:
    """T: the fixed high-rank token table (not trained, recomputed from the seed)."""
    m = manifest.model
    g = seeded_generator(manifest.run.seed, "fixed_embedding")
    return torch.randn(m.vocab_size, m.d_model, generator=g)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(spec: ModelSpec) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / spec.rope_theta ** (torch.arange(0, spec.head_dim, 2).float() / spec.head_dim)
    angles = torch.outer(torch.arange(spec.seq_len).float(), inv_freq)  # [T, hd/2]
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None = None) -> Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of each head by position-dependent angles. x: [B, H, T, hd].

    Positions are 0..T-1 unless given (a context-parallel member's own tokens)."""
    t = x.shape[-2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = (cos[:t], sin[:t]) if positions is None else (cos[positions], sin[positions])
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)


@dataclass(frozen=True)
class AttentionContext:
    """How a stage's attention sees its tokens, when not simply one whole causal sequence.

    `doc_ids` ([seq_len] for every sample, or [batch, seq_len]: the full sequence) keeps
    packed documents apart; `cell`
    makes this stage one member of a context-parallel cell, holding only its
    chunk's tokens (`cell.positions`)."""

    doc_ids: Tensor | None = None
    cell: CellContext | None = None


class Block(nn.Module):
    """Pre-norm decoder block: grouped-query attention with RoPE, then SwiGLU MLP.

    `out_dim` is k when the block's outputs are confined to span(U) (the caller
    multiplies by U^T), d_model otherwise.
    """

    def __init__(self, spec: ModelSpec, out_dim: int) -> None:
        super().__init__()
        d, hd = spec.d_model, spec.head_dim
        self.n_heads, self.n_kv_heads = spec.n_heads, spec.n_kv_heads
        self.attn_norm = RMSNorm(d, spec.norm_eps)
        self.wq = nn.Linear(d, spec.n_heads * hd, bias=False)
        self.wk = nn.Linear(d, spec.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(d, spec.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(spec.n_heads * hd, out_dim, bias=False)
        self.mlp_norm = RMSNorm(d, spec.norm_eps)
        self.w_gate = nn.Linear(d, spec.ffn_dim, bias=False)
        self.w_up = nn.Linear(d, spec.ffn_dim, bias=False)
        self.w_down = nn.Linear(spec.ffn_dim, out_dim, bias=False)
        # Keys and values come from a learned mixture of rank-r subspaces of z (kv_rank > 0).
        self.kv_mix = None
        if spec.kv_rank:
            vocab = spec.vocab_size if spec.kv_tokens else 0
            self.kv_mix = SubspaceMixture(d, spec.kv_rank, spec.kv_subspaces, vocab)
        self.kv_remote_only = spec.kv_compress == "remote"

    def attention(
        self,
        z: Tensor,
        cos: Tensor,
        sin: Tensor,
        context: AttentionContext | None = None,
        layer: int = 0,
        tokens: Tensor | None = None,
    ) -> Tensor:
        b, t, _ = z.shape
        q = self.wq(z).view(b, t, self.n_heads, -1).transpose(1, 2)
        plain = self.kv_mix is None or self.kv_remote_only  # alone, K/V from z itself
        if context is None and plain:  # one whole causal sequence
            k = self.wk(z).view(b, t, self.n_kv_heads, -1).transpose(1, 2)
            v = self.wv(z).view(b, t, self.n_kv_heads, -1).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return self.wo(y.transpose(1, 2).reshape(b, t, -1))
        docs = context.doc_ids if context is not None else None
        cell = context.cell if context is not None else None
        if cell is None:  # alone: a mixture of the whole sequence, or documents apart
            full = kv_source(z, self.kv_mix, tokens, self.kv_remote_only)
            k, v = self.keys_values(full, cos, sin)
            q_pos = torch.arange(t, device=z.device)
            y = masked_attention(apply_rope(q, cos, sin), k, v, q_pos, docs)
            return self.wo(y.transpose(1, 2).reshape(b, t, -1))
        # a cell member: its queries attend to its own keys while the others' K/V sources
        # travel, then to theirs; the two parts merge exactly (log-sum-exp)
        own_pos, q = cell.positions, apply_rope(q, cos, sin, cell.positions)
        posted = post_sources(z, self.kv_mix, cell, layer, tokens, self.kv_remote_only)
        merge = PartsMerge()

        def part(source: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
            k, v = self.keys_values(source, cos, sin, positions)
            return attend_part(q, k, v, own_pos, positions, docs, merge)

        if cell.overlap:
            own = part(posted.own, own_pos)
            remote = part(posted.receive(), cell.remote_positions)
        else:  # wait first (the baseline the overlap is measured against)
            received = posted.receive()
            own = part(posted.own, own_pos)
            remote = part(received, cell.remote_positions)
        y = merge_parts(merge, own, remote)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))

    def keys_values(
        self, source: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """K (rotated to `positions`, 0.. by default) and V of a K/V source [B, n, d]."""
        b, n, _ = source.shape
        k = self.wk(source).view(b, n, self.n_kv_heads, -1).transpose(1, 2)
        v = self.wv(source).view(b, n, self.n_kv_heads, -1).transpose(1, 2)
        return apply_rope(k, cos, sin, positions), v

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        basis_t: Tensor | None,
        context: AttentionContext | None = None,
        layer: int = 0,
        tokens: Tensor | None = None,
    ) -> Tensor:
        h = self.attention(self.attn_norm(x), cos, sin, context, layer, tokens)
        x = x + (h @ basis_t if basis_t is not None else h)
        z = self.mlp_norm(x)
        h = self.w_down(F.silu(self.w_gate(z)) * self.w_up(z))
        return x + (h @ basis_t if basis_t is not None else h)


class _Layers(nn.Module):
    """Shared machinery of a stage and of the unsplit model: buffers, blocks, embedding, head."""

    def __init__(self, manifest: Manifest, layers: range, embed: bool, head: bool) -> None:
        super().__init__()
        spec = manifest.model
        self.manifest = manifest
        self.subspace = not manifest.dense
        last_stage_start = manifest.stage_layers(manifest.num_stages - 1).start
        cos, sin = rope_tables(spec)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if self.subspace:
            u = subspace_basis(manifest)
            self.register_buffer("basis", u, persistent=False)
            self.register_buffer("basis_t", u.t().contiguous(), persistent=False)
            self.register_buffer("fixed_table", fixed_embedding(manifest), persistent=False)
        self.embed = None
        if embed:
            width = spec.subspace_rank if self.subspace else spec.d_model
            self.embed = nn.Embedding(spec.vocab_size, width)
        # Only blocks whose output reaches a stage boundary need the constraint;
        # blocks of the last stage write to the head alone and stay full rank.
        self.constrained = {i: self.subspace and i < last_stage_start for i in layers}
        self.blocks = nn.ModuleDict(
            {
                str(i): Block(spec, spec.subspace_rank if self.constrained[i] else spec.d_model)
                for i in layers
            }
        )
        self.norm = RMSNorm(spec.d_model, spec.norm_eps) if head else None
        self.head = nn.Linear(spec.d_model, spec.vocab_size, bias=False) if head else None
        init_parameters(self, manifest)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        e = self.embed(tokens)
        return self.fixed_table[tokens] + e @ self.basis_t if self.subspace else e

    def run_blocks(
        self, x: Tensor, context: AttentionContext | None = None, tokens: Tensor | None = None
    ) -> Tensor:
        """`tokens`: the ids of x's tokens (a K/V mixture with a token table needs them)."""
        for name, block in self.blocks.items():
            basis_t = self.basis_t if self.constrained[int(name)] else None
            x = block(x, self.rope_cos, self.rope_sin, basis_t, context, int(name), tokens)
        return x

    def logits(self, x: Tensor) -> Tensor:
        return self.head(self.norm(x))


def init_parameters(module: nn.Module, manifest: Manifest) -> None:
    """Deterministic init keyed by parameter name: the same weights wherever the cut falls."""
    n_layers = manifest.model.n_layers
    with torch.no_grad():
        for name, p in module.named_parameters():
            g = seeded_generator(manifest.run.seed, name)
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("kv_mix.tokens"):
                p.zero_()
            elif name.endswith("kv_mix.bases"):
                init_mixture_bases(p, manifest.model.kv_rank, g)
            elif name == "embed.weight":
                p.copy_(torch.randn(p.shape, generator=g) * (0.02 if module.subspace else 1.0))
            else:
                std = 0.02
                if name.endswith(("wo.weight", "w_down.weight")):
                    std = 0.02 / (2 * n_layers) ** 0.5  # GPT-2 style residual scaling
                p.copy_(torch.randn(p.shape, generator=g) * std)


class Stage(_Layers):
    """Pipeline stage `index` of the run: the part of the model one daemon serves.

    forward(x, tokens): stage 0 ignores x and embeds tokens; the last stage
    returns logits; every other stage returns the residual stream.
    """

    def __init__(self, manifest: Manifest, index: int) -> None:
        last = manifest.num_stages - 1
        super().__init__(
            manifest, manifest.stage_layers(index), embed=index == 0, head=index == last
        )
        self.index = index
        self.is_first, self.is_last = index == 0, index == last

    def forward(
        self, x: Tensor | None, tokens: Tensor, context: AttentionContext | None = None
    ) -> Tensor:
        """In a context-parallel cell, x and tokens are this member's chunk only."""
        h = self.embed_tokens(tokens) if self.is_first else x
        h = self.run_blocks(h, context, tokens)
        return self.logits(h) if self.is_last else h

    # ---- the stage boundary -----------------------------------------------------
    @property
    def boundary_width(self) -> int:
        """Values per token that cross a boundary: k with the subspace, d when dense."""
        m = self.manifest.model
        return m.d_model if self.manifest.dense else m.subspace_rank

    def encode_boundary(self, x: Tensor, tokens: Tensor) -> Tensor:
        """Residual stream -> what travels downstream ([B, T, k] coefficients, or x when dense)."""
        if not self.subspace:
            return x
        return (x - self.fixed_table[tokens]) @ self.basis

    def decode_boundary(self, c: Tensor, tokens: Tensor) -> Tensor:
        """Inverse of encode_boundary, exact up to float rounding."""
        if not self.subspace:
            return c
        return self.fixed_table[tokens] + c @ self.basis_t


class Transformer(_Layers):
    """The unsplit model (reference trainer and equivalence tests)."""

    def __init__(self, manifest: Manifest) -> None:
        super().__init__(manifest, range(manifest.model.n_layers), embed=True, head=True)

    def forward(self, tokens: Tensor, context: AttentionContext | None = None) -> Tensor:
        return self.logits(self.run_blocks(self.embed_tokens(tokens), context, tokens))


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_stages(manifest: Manifest) -> list[Stage]:
    return [Stage(manifest, s) for s in range(manifest.num_stages)]


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
