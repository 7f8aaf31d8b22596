"""Data: deterministic sample windows, disjoint splits, packed documents."""

import dataclasses
import json

import pytest
import torch

from agora_node.protocol.manifest import ManifestError
from agora_node.stages.data import ByteTokenizer, TokenWindows, load_corpus
from agora_node.stages.manifest_files import load_manifest

pytestmark = pytest.mark.timeout(60)


def test_same_sample_id_same_tokens():
    m = load_manifest("tiny")
    a, b = TokenWindows(m, "train"), TokenWindows(m, "train")
    for i in (0, 7, len(a) - 1):
        assert torch.equal(a.sample(i).tokens, b.sample(i).tokens)
        assert torch.equal(a.sample(i).tokens, a.sample(i).tokens)
        assert a.sample(i).tokens.shape == (m.model.seq_len + 1,)
    assert (a.epoch_order(3) == b.epoch_order(3)).all()
    assert not (a.epoch_order(3) == a.epoch_order(4)).all()


def test_train_and_validation_never_overlap():
    m = load_manifest("tiny")
    train, val = TokenWindows(m, "train"), TokenWindows(m, "val")
    last_train = train.begin + (len(train) - 1) * train.seq_len + train.seq_len + 1
    assert last_train <= train.end <= val.begin
    assert len(val) > 0 and len(train) > 10 * len(val) // 2
    with pytest.raises(IndexError):
        train.sample(len(train))


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "Thou art — ünïcode"
    assert tok.decode(tok.encode(text)) == text


def test_jsonl_documents_are_packed_with_boundaries(tmp_path):
    path = tmp_path / "docs.jsonl"
    docs = ["a" * 50, "b" * 70, "c" * 300, "d" * 40]
    path.write_text("\n".join(json.dumps({"text": d}) for d in docs))
    m = load_manifest("tiny")
    data = dataclasses.replace(m.data, source=str(path), format="jsonl", val_fraction=0.1)
    model = dataclasses.replace(m.model, seq_len=64)
    m = dataclasses.replace(m, data=data, model=model)
    corpus = load_corpus(m.data)
    assert corpus.doc_starts.tolist() == [0, 50, 120, 420]
    train = TokenWindows(m, "train")
    first = train.sample(0)
    assert first.doc_starts.tolist() == [0, 50]
    assert bytes(first.tokens.tolist()) == b"a" * 50 + b"b" * 15


def test_bad_jsonl_line_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\nnot json\n')
    m = load_manifest("tiny")
    m = dataclasses.replace(m, data=dataclasses.replace(m.data, source=str(path), format="jsonl"))
    with pytest.raises(ManifestError, match="bad.jsonl:2"):
        load_corpus(m.data)
