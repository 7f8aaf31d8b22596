"""Data: tokenizers, corpora, and the deterministic map sample id -> token window.

The corpus is tokenized once into one packed token array, documents back to
back, with their start offsets recorded. The last `val_fraction` of tokens is
the validation split; windows of seq_len + 1 tokens are cut at a stride of
seq_len inside each split, so train and validation never share a token and
sample i is the same window on every peer and every call.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from agora_node.protocol.manifest import BUILTIN_DATA_PREFIX, DataSpec, Manifest, ManifestError
from agora_node.stages.manifest_files import check_data_available


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to download."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local HF `tokenizer.json` (needs the optional `tokenizers` package)."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ManifestError(
                f"data.tokenizer = {path!r} needs the 'tokenizers' package: pip install tokenizers"
            ) from None
        self._tok = Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


def head_data_missing(manifest: Manifest, *, local: bool = True) -> str | None:
    """Why this machine cannot serve stage 0 of `manifest`, in one line; None if it can.

    Only stage 0 reads the run's corpus (and tokenizes it): a node without the files the
    manifest names, or without the `tokenizers` package its tokenizer needs, can serve
    the other stages. `local`: the operator gave the manifest (`--manifest`); one read
    from the swarm may name only the built-in corpus and tokenizers, not this machine's
    files (a stranger's manifest with data.source = /proc/self/environ had a head send
    that file's bytes, as token ids, to the next stages). Looks at the file system:
    call it off the event loop."""
    if not local:
        named = manifest.data.local_files()
        if named:
            return (
                f"stage 0 would read this machine's file ({', '.join(named)}), named by the"
                " swarm's manifest, not by this node's operator: give the run's manifest"
                " with --manifest to serve it"
            )
    try:
        check_data_available(manifest)
    except ManifestError as exc:
        reason = str(exc)
    else:
        tokenizer = manifest.data.tokenizer
        if tokenizer == "bytes" or importlib.util.find_spec("tokenizers") is not None:
            return None
        reason = f"data.tokenizer = {tokenizer!r} needs the 'tokenizers' package"
    return f"stage 0 reads the run's data, which this machine lacks ({reason})"


def load_tokenizer(spec: DataSpec) -> ByteTokenizer | HFTokenizer:
    return ByteTokenizer() if spec.tokenizer == "bytes" else HFTokenizer(spec.tokenizer)


def _read_documents(spec: DataSpec) -> list[str]:
    if spec.source.startswith(BUILTIN_DATA_PREFIX):
        name = spec.source[len(BUILTIN_DATA_PREFIX) :]
        text = resources.files("agora_node.stages").joinpath(f"corpus/{name}.txt").read_text()
        return [text]
    path = Path(spec.source)
    if not path.is_file():
        raise ManifestError(
            f"manifest field data.source = {spec.source!r} is invalid: file not found"
        )
    if spec.format == "text":
        return [path.read_text(encoding="utf-8", errors="replace")]
    docs = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                docs.append(str(json.loads(line)[spec.jsonl_field]))
            except (ValueError, KeyError, TypeError) as exc:
                raise ManifestError(
                    f"{path}:{lineno}: not a JSON object with field {spec.jsonl_field!r} ({exc})"
                ) from None
    return docs


@dataclass(frozen=True)
class Corpus:
    tokens: np.ndarray
    """All documents' tokens, packed back to back (int32)."""
    doc_starts: np.ndarray
    """Offset of each document's first token in `tokens`."""


@lru_cache(maxsize=4)
def load_corpus(spec: DataSpec) -> Corpus:
    tokenizer = load_tokenizer(spec)
    pieces, starts, offset = [], [], 0
    for doc in _read_documents(spec):
        ids = np.asarray(tokenizer.encode(doc), dtype=np.int32)
        starts.append(offset)
        pieces.append(ids)
        offset += len(ids)
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    return Corpus(tokens=tokens, doc_starts=np.asarray(starts, dtype=np.int64))


def document_ids(seq_len: int, doc_starts: torch.Tensor | None) -> torch.Tensor:
    """[seq_len] index of the document each position belongs to (0 when no starts given)."""
    ids = torch.zeros(seq_len, dtype=torch.long)
    if doc_starts is not None and len(doc_starts):
        marks = torch.zeros(seq_len, dtype=torch.long)
        inside = doc_starts[(doc_starts > 0) & (doc_starts < seq_len)]
        marks[inside] = 1
        ids = marks.cumsum(0)
    return ids


def check_documents(docs: torch.Tensor, batch: int, seq_len: int) -> None:
    """Refuse (ValueError) document ids that are not what `document_ids` makes: [batch,
    seq_len], 0 at the first position, each next position the same document or the next."""
    if tuple(docs.shape) != (batch, seq_len):
        raise ValueError(f"document ids of shape {list(docs.shape)}, not [{batch}, {seq_len}]")
    if docs.numel() and (bool((docs[:, 0] != 0).any()) or not _steps_of_one(docs)):
        raise ValueError("document ids must start at 0 and grow by 0 or 1 per position")


def _steps_of_one(docs: torch.Tensor) -> bool:
    steps = docs[:, 1:] - docs[:, :-1]
    return bool(((steps == 0) | (steps == 1)).all())


@dataclass(frozen=True)
class TokenBatch:
    """A micro-batch's token rows and, for packed sequences, each input's document.

    `ids` [B, seq_len + 1]: inputs are [:, :-1], targets [:, 1:]. `docs` [B, seq_len]
    (`document_ids` of each row's inputs) or None: every row is one document, and
    attention is plain causal. Attention never crosses a document boundary."""

    ids: torch.Tensor
    docs: torch.Tensor | None = None

    @staticmethod
    def of(tokens: torch.Tensor | TokenBatch) -> TokenBatch:
        """A bare [B, seq_len + 1] tensor of ids is a batch of one document per row."""
        return tokens if isinstance(tokens, TokenBatch) else TokenBatch(tokens)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def inputs(self) -> torch.Tensor:
        return self.ids[:, :-1]

    @property
    def targets(self) -> torch.Tensor:
        return self.ids[:, 1:]

    def to(self, device: torch.device | str) -> TokenBatch:
        docs = None if self.docs is None else self.docs.to(device)
        return TokenBatch(self.ids.to(device), docs)


@dataclass(frozen=True)
class Sample:
    sample_id: int
    tokens: torch.Tensor
    """seq_len + 1 token ids (int64): inputs are [:-1], targets [1:]."""
    doc_starts: torch.Tensor
    """Positions inside the window where a new document begins (packed sequences)."""


class TokenWindows:
    """Deterministic windows of one split ('train' or 'val') of a run's corpus."""

    def __init__(self, manifest: Manifest, split: str) -> None:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', not {split!r}")
        self.seq_len = manifest.model.seq_len
        self.seed = manifest.run.seed
        corpus = load_corpus(manifest.data)
        vocab = manifest.model.vocab_size
        if corpus.tokens.size and int(corpus.tokens.max()) >= vocab:
            raise ManifestError(
                f"manifest field model.vocab_size = {vocab} is invalid: the tokenizer "
                f"produces ids up to {int(corpus.tokens.max())}"
            )
        n = len(corpus.tokens)
        cut = int(n * (1 - manifest.data.val_fraction))
        self.begin, self.end = (0, cut) if split == "train" else (cut, n)
        self.tokens = corpus.tokens
        self.doc_starts = corpus.doc_starts
        self.num_samples = max(0, (self.end - self.begin - 1) // self.seq_len)
        if self.num_samples == 0:
            raise ManifestError(
                f"manifest field data.source = {manifest.data.source!r} is invalid: "
                f"its {split} split has fewer than seq_len + 1 = {self.seq_len + 1} tokens"
            )

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, sample_id: int) -> Sample:
        if not 0 <= sample_id < self.num_samples:
            raise IndexError(f"sample id {sample_id} outside 0..{self.num_samples - 1}")
        start = self.begin + sample_id * self.seq_len
        stop = start + self.seq_len + 1
        window = torch.from_numpy(self.tokens[start:stop].astype(np.int64))
        lo, hi = np.searchsorted(self.doc_starts, [start, stop])
        starts = torch.from_numpy((self.doc_starts[lo:hi] - start).astype(np.int64))
        return Sample(sample_id, window, starts)

    def batch(self, sample_ids: list[int]) -> TokenBatch:
        """The windows' token rows, with their documents when a document starts inside
        one of them (None otherwise: plain causal attention, the fast path)."""
        samples = [self.sample(i) for i in sample_ids]
        ids = torch.stack([s.tokens for s in samples])
        docs = torch.stack([document_ids(self.seq_len, s.doc_starts) for s in samples])
        return TokenBatch(ids, docs if bool(docs.any()) else None)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """A permutation of sample ids that every peer computes identically."""
        rng = np.random.default_rng([self.seed, epoch])
        return rng.permutation(self.num_samples)

    def fixed_subset(self, count: int) -> list[int]:
        """Evenly spaced sample ids: a fixed validation set independent of the node."""
        count = min(count, self.num_samples)
        return [int(i) for i in np.linspace(0, self.num_samples - 1, count).round()]
