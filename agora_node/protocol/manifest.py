"""The run manifest: what every peer of a run must agree on.

A manifest is TOML with five tables (`run`, `model`, `stages`, `data`, `inner`,
`outer`). Its canonical form (sorted-key compact JSON of the resolved values)
is hashed into the run id, which prefixes every DHT key, so peers of different
runs or versions never mix. Validation errors name the field, the value and what
would be valid, as one line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import tomllib
from dataclasses import dataclass, field
from typing import Any

from agora_node.protocol.codecs import CODEC_NAMES, DENSE_CODEC_NAMES

MANIFEST_VERSION = 1
BUILTIN_MANIFESTS = ("tiny", "demo", "bench", "gpu-1b", "long", "cells")
BUILTIN_DATA_PREFIX = "builtin:"
BUILTIN_CORPORA = ("tinyshakespeare",)
OPTIMIZERS = ("adamw", "muon")
TOKENIZERS = ("bytes",)  # or a path ending in .json (HF tokenizers)
DATA_FORMATS = ("text", "jsonl")
AGGREGATIONS = ("centered_clip", "trimmed_mean", "mean")
KV_COMPRESS = ("all", "remote")
UNSENT = ("feedback", "weights")
# Fields added after manifest version 1 with a default: left out of the canonical form
# (and so of the run id) while they hold it, so existing runs keep their ids.
DEFAULT_MIN_COSINE = 0.1
"""Reducers refuse a pseudo-gradient part whose cosine with the others' median is at most
this: honest ones measured on tiny were never below 0.64, a random direction is about
1/sqrt(numel) (docs/security.md, "Flagging and bans")."""
CANONICAL_DEFAULTS = {
    ("outer", "aggregation"): "centered_clip",
    ("outer", "min_cosine"): DEFAULT_MIN_COSINE,
    ("outer", "overlap"): False,
    ("outer", "rank"): 0,
    ("outer", "anchor_codec"): "auto",
    ("outer", "unsent"): "feedback",
    ("inner", "weight_prediction"): False,
    ("model", "cp_degree"): 1,
    ("model", "kv_rank"): 0,
    ("model", "kv_subspaces"): 4,
    ("model", "kv_tokens"): False,
    ("model", "kv_compress"): "all",
}


class ManifestError(ValueError):
    """A manifest that cannot define a run. The message is one line."""


def _fail(name: str, value: Any, expected: str) -> None:
    raise ManifestError(f"manifest field {name} = {value!r} is invalid: {expected}")


def _positive(obj: Any, table: str, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            _fail(f"{table}.{name}", value, "must be a positive number")


@dataclass(kw_only=True, frozen=True)
class RunSpec:
    name: str = "unnamed"
    """Human-readable name; part of the hash, so two runs never share keys by accident."""
    seed: int = 0
    """Seeds the basis U, the fixed embedding table and every layer's initialization
    (0 <= seed < 2**63: torch.manual_seed's range)."""

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            _fail("run.seed", self.seed, "must be an integer")
        if not 0 <= self.seed < 2**63:
            _fail("run.seed", self.seed, "must be between 0 and 2**63 - 1")


@dataclass(kw_only=True, frozen=True)
class ModelSpec:
    d_model: int = 256
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 704
    vocab_size: int = 256
    seq_len: int = 128
    subspace_rank: int = 32
    """k: stage-boundary activations live in a k-dim subspace; 0 means dense."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    cp_degree: int = 1
    """c: peers of a stage that split each sequence (context parallelism); 1 = off."""
    kv_rank: int = 0
    """r: keys and values come from a rank-r mixture of subspaces of their input; 0 = dense."""
    kv_subspaces: int = 4
    """How many learned rank-r bases each block's mixture chooses from (per token)."""
    kv_tokens: bool = False
    """With a mixture: each block also learns a table of one d-vector per token id; K/V
    sources are compressed after subtracting their token's row and rebuilt by adding it
    back, so the token's own part is not squeezed into rank r (its id travels, 1-4 bytes)."""
    kv_compress: str = "all"
    """Which K/V sources go through the mixture: "all" (every token's, alone too: the
    compression is part of the model) or "remote" (only what a cell member receives from
    the others; its own tokens' K and V come from z itself, which never crosses the wire,
    so a peer alone trains the dense model)."""

    def __post_init__(self) -> None:
        _positive(self, "model", "d_model", "n_layers", "n_heads", "n_kv_heads")
        _positive(self, "model", "ffn_dim", "vocab_size", "seq_len", "rope_theta", "norm_eps")
        if self.d_model % self.n_heads:
            _fail("model.n_heads", self.n_heads, f"must divide d_model={self.d_model}")
        if self.n_heads % self.n_kv_heads:
            _fail("model.n_kv_heads", self.n_kv_heads, f"must divide n_heads={self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            _fail("model.n_heads", self.n_heads, "head dim d_model/n_heads must be even (RoPE)")
        if not isinstance(self.subspace_rank, int) or not 0 <= self.subspace_rank <= self.d_model:
            _fail("model.subspace_rank", self.subspace_rank, f"must be 0 (dense) .. {self.d_model}")
        if not isinstance(self.cp_degree, int) or not 1 <= self.cp_degree <= self.seq_len // 2:
            _fail(
                "model.cp_degree", self.cp_degree, f"must be 1 .. seq_len/2 = {self.seq_len // 2}"
            )
        if not isinstance(self.kv_rank, int) or not 0 <= self.kv_rank <= self.d_model:
            _fail("model.kv_rank", self.kv_rank, f"must be 0 (dense) .. {self.d_model}")
        if not isinstance(self.kv_subspaces, int) or not 1 <= self.kv_subspaces <= 256:
            _fail("model.kv_subspaces", self.kv_subspaces, "must be 1 .. 256 (one byte a token)")
        if not isinstance(self.kv_tokens, bool):
            _fail("model.kv_tokens", self.kv_tokens, "must be true or false")
        if self.kv_tokens and not self.kv_rank:
            _fail("model.kv_tokens", self.kv_tokens, "needs kv_rank > 0 (a mixture to go with)")
        if self.kv_compress not in KV_COMPRESS:
            _fail("model.kv_compress", self.kv_compress, f"must be one of {KV_COMPRESS}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_mixture_alone(self) -> bool:
        """Whether a peer alone (no cell) runs the K/V mixture: only when it compresses
        every token's sources (kv_compress = "all"); a cell member runs it either way."""
        return bool(self.kv_rank) and self.kv_compress == "all"


@dataclass(kw_only=True, frozen=True)
class StageSpec:
    count: int = 4
    """S: number of pipeline stages."""
    layers: tuple[int, ...] = ()
    """Layers per stage; empty means n_layers split evenly."""


@dataclass(kw_only=True, frozen=True)
class DataSpec:
    source: str = "builtin:tinyshakespeare"
    """A path to a text/JSONL file, or builtin:<name> for a corpus shipped in the package."""
    format: str = "text"
    tokenizer: str = "bytes"
    """`bytes` (UTF-8 bytes, vocab 256) or a path to a local HF `tokenizer.json`."""
    val_fraction: float = 0.05
    jsonl_field: str = "text"

    def __post_init__(self) -> None:
        if self.format not in DATA_FORMATS:
            _fail("data.format", self.format, f"must be one of {', '.join(DATA_FORMATS)}")
        if self.tokenizer not in TOKENIZERS and not self.tokenizer.endswith(".json"):
            _fail("data.tokenizer", self.tokenizer, "must be 'bytes' or a path to tokenizer.json")
        if not 0 < self.val_fraction < 0.5:
            _fail("data.val_fraction", self.val_fraction, "must be in (0, 0.5)")
        if self.source.startswith(BUILTIN_DATA_PREFIX):
            name = self.source[len(BUILTIN_DATA_PREFIX) :]
            if name not in BUILTIN_CORPORA:
                _fail("data.source", self.source, f"builtin corpora are {BUILTIN_CORPORA}")

    def local_files(self) -> list[str]:
        """The fields naming a file of the machine that reads them ("data.source = '...'"):
        a source other than a built-in corpus, a tokenizer other than `bytes`."""
        named = []
        if not self.source.startswith(BUILTIN_DATA_PREFIX):
            named.append(f"data.source = {self.source!r}")
        if self.tokenizer != "bytes":  # every other tokenizer is a tokenizer.json path
            named.append(f"data.tokenizer = {self.tokenizer!r}")
        return named


@dataclass(kw_only=True, frozen=True)
class InnerSpec:
    optimizer: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    warmup_steps: int = 20
    grad_clip: float = 1.0
    micro_batch: int = 8
    """Sequences per micro-batch (the unit that travels between stages)."""
    local_batch: int = 16
    """Sequences accumulated before an inner optimizer step; a multiple of micro_batch."""
    weight_prediction: bool = False
    """Forwards run on the weights extrapolated along the last inner step by the lag this
    stage measures between a forward and the step its gradient lands in
    (node/versions.py), instead of on the latest weights: staleness corrected, not
    tolerated. Heads then keep two inner steps' worth in flight by default."""

    def __post_init__(self) -> None:
        if not isinstance(self.weight_prediction, bool):
            _fail("inner.weight_prediction", self.weight_prediction, "must be true or false")
        if self.optimizer not in OPTIMIZERS:
            _fail("inner.optimizer", self.optimizer, f"must be one of {', '.join(OPTIMIZERS)}")
        _positive(self, "inner", "lr", "grad_clip", "micro_batch", "local_batch")
        if self.local_batch % self.micro_batch:
            _fail(
                "inner.local_batch",
                self.local_batch,
                f"must be a multiple of micro_batch={self.micro_batch}",
            )
        if self.weight_decay < 0 or self.warmup_steps < 0:
            _fail(
                "inner.weight_decay/warmup_steps",
                (self.weight_decay, self.warmup_steps),
                "must be >= 0",
            )
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                _fail(f"inner.{name}", getattr(self, name), "must be in [0, 1)")


@dataclass(kw_only=True, frozen=True)
class OuterSpec:
    inner_steps: int = 50
    """H: inner steps between outer steps."""
    lr: float = 0.7
    momentum: float = 0.9
    group_size: int = 4
    """Replicas mixed per round; 0 means everyone (plain DiLoCo)."""
    codec: str = "int8"
    """Pseudo-gradient encoding on the wire."""
    aggregation: str = "centered_clip"
    """How a span's reducer combines the contributions: robust by default (docs/security.md)."""
    min_cosine: float = DEFAULT_MIN_COSINE
    """A reducer refuses a pseudo-gradient part whose cosine with the median of the others'
    (3+ parts) is at most this; -1 turns the check off. Run-wide: a span's owner and its
    witness must refuse the same parts."""
    overlap: bool = False
    """Run each round's mixes while the next round's inner steps go on, then swap in the
    new anchor plus the inner progress made meanwhile (node/rounds.py); false: inner
    steps wait for the round."""
    rank: int = 0
    """0: pseudo-gradients travel whole (in `codec`). r > 0: each weight matrix travels as
    two rank-r factors in two mixes, with error feedback (node/lowrank.py); `codec` must
    then be a dense one (fp32, bf16, int8 or int4) and encodes the factors."""
    anchor_codec: str = "auto"
    """How anchors travel when a group mixes them (gossip every round; a group of everyone
    only when its digests differ): a dense codec, or "auto": fp32 when `codec` is fp32,
    else bf16 (naming the codec auto resolves to gives auto's run id). int8 moved
    21-23% fewer bytes than bf16 for gossip_int8 at the same loss (docs/benchmarks.md,
    "Anchors in int8")."""

    unsent: str = "feedback"
    """Where what a compressed pseudo-gradient part leaves out goes. "feedback": into the
    next round's part (error feedback; the weights restart from the new anchor). "weights":
    it stays in the replica's weights, which restart from the new anchor less it, so the
    next pseudo-gradient holds it again and the inner steps go on from where they got to.
    The anchors stay identical; each replica's weights differ from them by what it has not
    sent. Needs a codec with error feedback (int8, int4, topk4) and rank 0. With topk4 at
    H = 50 it took the sparse codec from 28% behind fp32 DiLoCo to 1.9% behind after 12
    rounds (each replica's own weights); the anchors, which hold only what was sent, fell
    far behind (docs/benchmarks.md, "What a part leaves out, kept in the weights")."""

    def auto_anchor_codec(self) -> str:
        """What anchor_codec "auto" means with this codec."""
        return "fp32" if self.codec == "fp32" else "bf16"

    def __post_init__(self) -> None:
        _positive(self, "outer", "inner_steps", "lr")
        if not isinstance(self.overlap, bool):
            _fail("outer.overlap", self.overlap, "must be true or false")
        if not -1 <= self.min_cosine < 1:
            _fail("outer.min_cosine", self.min_cosine, "must be in [-1, 1) (-1: off)")
        if self.aggregation not in AGGREGATIONS:
            _fail(
                "outer.aggregation",
                self.aggregation,
                f"must be one of {', '.join(AGGREGATIONS)}",
            )
        if not 0 <= self.momentum < 1:
            _fail("outer.momentum", self.momentum, "must be in [0, 1)")
        if self.group_size < 0:
            _fail("outer.group_size", self.group_size, "must be >= 0 (0 = everyone)")
        if self.codec not in CODEC_NAMES:
            _fail("outer.codec", self.codec, f"must be one of {', '.join(CODEC_NAMES)}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            _fail("outer.rank", self.rank, "must be an integer >= 0 (0: whole pseudo-gradients)")
        if self.anchor_codec != "auto" and self.anchor_codec not in DENSE_CODEC_NAMES:
            _fail(
                "outer.anchor_codec",
                self.anchor_codec,
                f"must be auto or one of {', '.join(DENSE_CODEC_NAMES)}",
            )
        if self.unsent not in UNSENT:
            _fail("outer.unsent", self.unsent, f"must be one of {', '.join(UNSENT)}")
        if self.unsent == "weights" and (self.rank or self.codec in ("fp32", "bf16")):
            _fail(
                "outer.unsent",
                self.unsent,
                "needs a codec with error feedback (int8, int4, topk4) and outer.rank = 0",
            )
        if self.rank and self.codec not in DENSE_CODEC_NAMES:
            _fail(
                "outer.codec",
                self.codec,
                f"with outer.rank > 0 must be one of {', '.join(DENSE_CODEC_NAMES)}",
            )


@dataclass(kw_only=True, frozen=True)
class Manifest:
    run: RunSpec = field(default_factory=RunSpec)
    model: ModelSpec = field(default_factory=ModelSpec)
    stages: StageSpec = field(default_factory=StageSpec)
    data: DataSpec = field(default_factory=DataSpec)
    inner: InnerSpec = field(default_factory=InnerSpec)
    outer: OuterSpec = field(default_factory=OuterSpec)
    version: int = MANIFEST_VERSION

    def __post_init__(self) -> None:
        if self.version != MANIFEST_VERSION:
            _fail(
                "version",
                self.version,
                f"this agora-node speaks manifest version {MANIFEST_VERSION}",
            )
        count, n_layers = self.stages.count, self.model.n_layers
        if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
            _fail("stages.count", count, "must be a positive integer")
        if count > n_layers:
            _fail("stages.count", count, f"must be <= model.n_layers={n_layers}")
        if self.stages.layers:
            layers = self.stages.layers
            if len(layers) != count or any(n <= 0 for n in layers) or sum(layers) != n_layers:
                _fail(
                    "stages.layers",
                    list(layers),
                    f"need {count} positive counts summing to {n_layers}",
                )
        elif n_layers % count:
            _fail(
                "stages.count",
                count,
                f"must divide model.n_layers={n_layers} (or give stages.layers)",
            )

    # ---- derived -----------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return self.stages.count

    @property
    def dense(self) -> bool:
        return self.model.subspace_rank == 0

    def stage_layers(self, stage: int) -> range:
        """Global indices of the transformer blocks that `stage` holds."""
        if not 0 <= stage < self.num_stages:
            raise ManifestError(
                f"stage {stage} does not exist: valid stages are 0..{self.num_stages - 1}"
            )
        counts = self.stages.layers or (self.model.n_layers // self.num_stages,) * self.num_stages
        start = sum(counts[:stage])
        return range(start, start + counts[stage])

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["stages"]["layers"] = list(self.stages.layers)
        return out

    def canonical_bytes(self) -> bytes:
        out = self.to_dict()
        if self.outer.anchor_codec == self.outer.auto_anchor_codec():
            out["outer"]["anchor_codec"] = "auto"  # the same bytes on the wire: the same run
        for (table, name), default in CANONICAL_DEFAULTS.items():
            if out[table].get(name) == default:
                del out[table][name]
        return json.dumps(out, sort_keys=True, separators=(",", ":")).encode()

    @property
    def run_id(self) -> str:
        """Content hash of the canonical form; prefixes every DHT key of this run."""
        return hashlib.sha256(self.canonical_bytes()).hexdigest()[:16]

    def to_toml(self) -> str:
        return dumps_toml(self.to_dict())


_TABLES = {
    "run": RunSpec,
    "model": ModelSpec,
    "stages": StageSpec,
    "data": DataSpec,
    "inner": InnerSpec,
    "outer": OuterSpec,
}


def manifest_from_dict(raw: dict[str, Any]) -> Manifest:
    """Build and validate a Manifest; unknown tables or fields are errors (typos must not pass)."""
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "version":
            kwargs["version"] = value
            continue
        spec = _TABLES.get(key)
        if spec is None:
            _fail(key, "...", f"unknown table; valid tables are {', '.join(_TABLES)}")
        if not isinstance(value, dict):
            _fail(key, value, "must be a table")
        known = {f.name: f for f in dataclasses.fields(spec)}
        for name, item in value.items():
            if name not in known:
                _fail(f"{key}.{name}", item, f"unknown field; valid fields are {', '.join(known)}")
            _check_type(f"{key}.{name}", item, known[name].type)
        if key == "stages" and "layers" in value:
            value = {**value, "layers": tuple(value["layers"])}
        try:
            kwargs[key] = spec(**value)
        except TypeError as exc:  # defensive: dataclass signature mismatch
            raise ManifestError(f"manifest table [{key}] is invalid: {exc}") from None
    return Manifest(**kwargs)


def _check_type(name: str, value: Any, annotation: str) -> None:
    expect = {"int": int, "float": (int, float), "str": str, "tuple[int, ...]": list}.get(
        annotation
    )
    if expect is None:
        return
    if isinstance(value, bool) or not isinstance(value, expect):
        _fail(name, value, f"must be of type {annotation}")
    if isinstance(value, float) and not math.isfinite(value):  # TOML and JSON both allow them
        _fail(name, value, "must be a finite number")
    if annotation == "tuple[int, ...]" and not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        _fail(name, value, "must be a list of integers")


def parse_manifest(text: str, origin: str = "<string>") -> Manifest:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{origin}: malformed TOML: {exc}") from None
    return manifest_from_dict(raw)


def manifest_from_canonical(data: bytes) -> Manifest:
    """Inverse of canonical_bytes (used when a manifest is fetched from the swarm)."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ManifestError(f"manifest from the swarm is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ManifestError("manifest from the swarm is not a table")
    return manifest_from_dict(raw)


def dumps_toml(data: dict[str, Any]) -> str:
    """Minimal TOML writer for manifest dicts (scalars and lists inside one level of tables)."""
    lines = [f"version = {_toml_value(data['version'])}"] if "version" in data else []
    for table, values in data.items():
        if table == "version":
            continue
        lines += ["", f"[{table}]"]
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic strings
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")
