"""Run manifest: round trip, stable hash, one-line errors naming the field."""

import pytest

from agora_node.node.cli import main
from agora_node.protocol.manifest import (
    BUILTIN_MANIFESTS,
    ManifestError,
    manifest_from_canonical,
    parse_manifest,
)
from agora_node.stages.manifest_files import check_data_available, load_manifest

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("name", BUILTIN_MANIFESTS)
def test_builtin_manifests_round_trip(name):
    m = load_manifest(name)
    assert parse_manifest(m.to_toml()) == m
    assert manifest_from_canonical(m.canonical_bytes()) == m
    assert parse_manifest(m.to_toml()).run_id == m.run_id


def test_run_id_is_stable_and_content_addressed():
    m = load_manifest("tiny")
    # Pinned: a change of the canonical form or of tiny.toml must be deliberate
    # (it splits the swarm between versions).
    assert m.run_id == "0bffbd3c9b56f14d"
    changed = parse_manifest(m.to_toml().replace("seed = 1234", "seed = 1235"))
    assert changed.run_id != m.run_id
    # Key order and formatting do not matter, only content.
    text = "[run]\nseed = 1234\nname = 'tiny'\n" + m.to_toml().split("[model]", 1)[1].join(
        ["[model]", ""]
    )
    assert parse_manifest(text).run_id == m.run_id


def _edit(old: str, new: str) -> str:
    text = load_manifest("tiny").to_toml()
    assert old in text
    return text.replace(old, new)


INVALID = [
    ("d_model = 256", "d_model = -256", "model.d_model"),
    ("n_layers = 8", "n_layers = 0", "model.n_layers"),
    ("seq_len = 128", "seq_len = 0", "model.seq_len"),
    ("count = 4", "count = 3", "stages.count"),
    ("layers = []", "layers = [3, 3, 1, 1, 0]", "stages.layers"),
    ("subspace_rank = 32", "subspace_rank = 300", "model.subspace_rank"),
    ('optimizer = "adamw"', 'optimizer = "sgd"', "inner.optimizer"),
    ('source = "builtin:tinyshakespeare"', 'source = "builtin:nope"', "data.source"),
    ("micro_batch = 8", "micro_batch = 5", "inner.local_batch"),
    ("n_kv_heads = 4", "n_kv_heads = 3", "model.n_kv_heads"),
    ("lr = 0.3", 'lr = "fast"', "outer.lr"),
    ("[outer]", "[outer]\nspeed = 3", "outer.speed"),
    ('anchor_codec = "auto"', 'anchor_codec = "topk4"', "outer.anchor_codec"),
    # TOML has nan and inf; a run that trains on them diverges or crashes every joiner
    ("lr = 0.003", "lr = nan", "inner.lr"),
    ("lr = 0.3", "lr = inf", "outer.lr"),
    ("grad_clip = 1.0", "grad_clip = nan", "inner.grad_clip"),
    ("weight_decay = 0.1", "weight_decay = -nan", "inner.weight_decay"),
    ("norm_eps = 1e-05", "norm_eps = inf", "model.norm_eps"),
    # train-local seeded torch with it and crashed with a traceback (Overflow)
    ("seed = 1234", "seed = 99999999999999999999", "run.seed"),
    ("seed = 1234", "seed = -1", "run.seed"),
]


@pytest.mark.parametrize(("old", "new", "field"), INVALID)
def test_invalid_field_is_named_in_one_line(old, new, field):
    with pytest.raises(ManifestError) as info:
        parse_manifest(_edit(old, new))
    message = str(info.value)
    assert field in message and "\n" not in message


def test_a_manifest_from_the_swarm_with_nan_is_refused():
    """JSON as Python reads it has NaN too: a bootstrap's canonical bytes are checked the same."""
    raw = load_manifest("tiny").canonical_bytes().replace(b'"lr":0.3', b'"lr":NaN')
    assert b"NaN" in raw
    with pytest.raises(ManifestError, match="outer.lr.*finite"):
        manifest_from_canonical(raw)


def test_malformed_toml_is_one_line():
    with pytest.raises(ManifestError, match="malformed TOML") as info:
        parse_manifest("[model\nd_model = 3")
    assert "\n" not in str(info.value)


def test_missing_data_file():
    m = parse_manifest(_edit('source = "builtin:tinyshakespeare"', 'source = "/nonexistent/x.txt"'))
    with pytest.raises(ManifestError, match="data.source.*file not found"):
        check_data_available(m)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("d_model = 256", "d_model = 0"),
        ("count = 4", "count = 3"),
        ("subspace_rank = 32", "subspace_rank = 257"),
        ('optimizer = "adamw"', 'optimizer = "lion"'),
        ('source = "builtin:tinyshakespeare"', 'source = "/nonexistent/x.txt"'),
        ("[model]", "[model\n"),
    ],
)
def test_cli_exit_code_2_and_one_line(tmp_path, capsys, old, new):
    path = tmp_path / "m.toml"
    path.write_text(_edit(old, new))
    assert main(["manifest", "check", "--check-data", "--manifest", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("agora-node: error:") and "\n" not in err and "Traceback" not in err


def test_cli_unknown_manifest_name(capsys):
    assert main(["train-local", "--manifest", "nope-not-a-file"]) == 2
    assert "not found" in capsys.readouterr().err


def test_stage_layers_cover_model():
    m = load_manifest("gpu-1b")
    layers = [i for s in range(m.num_stages) for i in m.stage_layers(s)]
    assert layers == list(range(m.model.n_layers))
    with pytest.raises(ManifestError, match="stage 6 does not exist"):
        m.stage_layers(6)


def test_outer_aggregation_is_robust_by_default_validated_and_hashed_only_when_set():
    m = load_manifest("tiny")
    assert m.outer.aggregation == "centered_clip"
    assert b"aggregation" not in m.canonical_bytes()  # existing run ids stay (pinned above)
    for method in ("trimmed_mean", "mean"):
        other = parse_manifest(m.to_toml().replace('"centered_clip"', f'"{method}"'))
        assert other.outer.aggregation == method
        assert other.run_id != m.run_id  # peers that aggregate differently do not mix
        assert manifest_from_canonical(other.canonical_bytes()) == other
    with pytest.raises(ManifestError, match=r"outer\.aggregation.*centered_clip, trimmed_mean"):
        parse_manifest(m.to_toml().replace('"centered_clip"', '"median"'))


def test_outer_min_cosine_is_on_by_default_validated_and_hashed_only_when_set():
    from agora_node.node.outer_state import OuterConfig

    m = load_manifest("tiny")
    assert m.outer.min_cosine == 0.1 == OuterConfig.from_manifest(m).aggregation.min_cosine
    assert b"min_cosine" not in m.canonical_bytes()  # existing run ids stay (pinned above)
    off = parse_manifest(m.to_toml().replace("min_cosine = 0.1", "min_cosine = -1.0"))
    assert off.outer.min_cosine == -1.0 and off.run_id != m.run_id
    assert OuterConfig.from_manifest(off).aggregation.min_cosine == -1.0
    assert manifest_from_canonical(off.canonical_bytes()) == off
    with pytest.raises(ManifestError, match=r"outer\.min_cosine"):
        parse_manifest(m.to_toml().replace("min_cosine = 0.1", "min_cosine = 1.5"))


def test_inner_weight_prediction_is_off_by_default_validated_and_hashed_only_when_set():
    from agora_node.stages.optim import in_backward_refusal

    m = load_manifest("tiny")
    assert m.inner.weight_prediction is False
    assert b"weight_prediction" not in m.canonical_bytes()  # run ids stay (pinned above)
    text = m.to_toml()
    assert "weight_prediction = false" in text
    on = parse_manifest(text.replace("weight_prediction = false", "weight_prediction = true"))
    assert on.inner.weight_prediction is True and on.run_id != m.run_id
    assert manifest_from_canonical(on.canonical_bytes()) == on
    with pytest.raises(ManifestError, match=r"inner\.weight_prediction"):
        parse_manifest(text.replace("weight_prediction = false", "weight_prediction = 1"))
    # the optimizer step inside the backward leaves no step for the prediction to read
    assert "weight prediction" in in_backward_refusal(on.inner)
