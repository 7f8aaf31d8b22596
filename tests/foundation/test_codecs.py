"""The codec registry: names, wire ids, lookup by name, and everyone using the same list."""

import dataclasses

import pytest

from agora_node.protocol.codecs import (
    CODEC_NAMES,
    DENSE_CODEC_NAMES,
    Codec,
    UnknownCodecError,
    from_name,
)
from agora_node.protocol.manifest import ManifestError, OuterSpec

pytestmark = pytest.mark.timeout(60)


def test_names_and_wire_ids_are_pinned():
    # Wire ids are in every frame; names are in manifests (hence run ids) and flags.
    assert CODEC_NAMES == ("fp32", "bf16", "int8", "int4", "topk4")
    assert {c.label: int(c) for c in Codec} == {
        "fp32": 1,
        "bf16": 2,
        "int8": 3,
        "int4": 4,
        "topk4": 5,
    }
    assert DENSE_CODEC_NAMES == ("fp32", "bf16", "int8", "int4")


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_from_name_round_trips(name: str):
    assert from_name(name).label == name


def test_every_codec_has_a_name():
    assert {from_name(n) for n in CODEC_NAMES} == set(Codec)


@pytest.mark.parametrize("bad", ["int2", "INT8", "", None, ["int8"]])
def test_from_name_rejects_with_the_valid_list(bad):
    with pytest.raises(UnknownCodecError) as info:
        from_name(bad)
    assert isinstance(info.value, ValueError)
    assert info.value.name == bad
    assert "fp32, bf16, int8, int4, topk4" in str(info.value)
    with pytest.raises(UnknownCodecError, match=r"^--activation-codec must be one of"):
        from_name(bad, what="--activation-codec")


def test_every_consumer_takes_the_registry_names():
    from agora_node.compression import ActivationCodec
    from agora_node.node.outer_state import OuterConfig

    for name in CODEC_NAMES:
        assert OuterConfig(codec=name).delta_format().part is from_name(name)
        assert dataclasses.replace(OuterSpec(), codec=name).codec == name
    for name in DENSE_CODEC_NAMES:  # activations and anchors keep every value
        assert ActivationCodec(mode=name).mode == name
        assert OuterConfig(anchor_codec=name).anchor_format().part is from_name(name)
    with pytest.raises(ValueError, match="activation mode must be one of fp32, bf16, int8, int4,"):
        ActivationCodec(mode="topk4")
    with pytest.raises(
        ValueError, match="outer anchor_codec must be one of fp32, bf16, int8, int4,"
    ):
        OuterConfig(anchor_codec="topk4")
    with pytest.raises(ValueError, match="activation mode must be one of fp32"):
        ActivationCodec(mode="int2")
    with pytest.raises(ValueError, match="outer anchor_codec must be one of fp32"):
        OuterConfig(anchor_codec="int2")
    with pytest.raises(
        ManifestError, match="outer.codec.*must be one of fp32, bf16, int8, int4, topk4"
    ):
        OuterSpec(codec="int2")


def test_the_manifest_names_the_anchor_codec_and_auto_keeps_run_ids_and_the_old_default():
    from agora_node.node.outer_state import OuterConfig
    from agora_node.stages.manifest_files import load_manifest

    tiny = load_manifest("tiny")
    assert tiny.outer.anchor_codec == "auto" and b"anchor_codec" not in tiny.canonical_bytes()
    for codec, anchors in (("int8", Codec.BF16), ("int4", Codec.BF16), ("fp32", Codec.FP32)):
        outer = dataclasses.replace(tiny.outer, codec=codec)
        assert (
            OuterConfig.from_manifest(dataclasses.replace(tiny, outer=outer)).anchor_format().part
            is anchors
        )
    for name in DENSE_CODEC_NAMES:
        m = dataclasses.replace(tiny, outer=dataclasses.replace(tiny.outer, anchor_codec=name))
        assert OuterConfig.from_manifest(m).anchor_format().part is from_name(name)
        if name == "bf16":  # what auto means with tiny's int8: the same wire, the same run
            assert m.run_id == tiny.run_id and m.outer.anchor_codec == "bf16"  # kept as written
        else:  # members of one run agree on their anchors' wire
            assert m.run_id != tiny.run_id
    fp32 = dataclasses.replace(tiny.outer, codec="fp32")
    named = dataclasses.replace(tiny, outer=dataclasses.replace(fp32, anchor_codec="fp32"))
    assert named.run_id == dataclasses.replace(tiny, outer=fp32).run_id
    with pytest.raises(ManifestError, match="outer.anchor_codec.*must be auto or one of fp32"):
        dataclasses.replace(tiny.outer, anchor_codec="topk4")


def test_unsent_in_the_weights_is_a_manifest_choice_that_keeps_old_run_ids():
    from agora_node.node.outer_state import OuterConfig
    from agora_node.stages.manifest_files import load_manifest

    tiny = load_manifest("tiny")
    assert tiny.outer.unsent == "feedback" and b"unsent" not in tiny.canonical_bytes()
    assert OuterConfig.from_manifest(tiny).unsent == "feedback"
    for codec in ("int8", "int4", "topk4"):
        outer = dataclasses.replace(tiny.outer, codec=codec, unsent="weights")
        m = dataclasses.replace(tiny, outer=outer)
        assert OuterConfig.from_manifest(m).unsent == "weights"
        assert (
            m.run_id
            != dataclasses.replace(tiny, outer=dataclasses.replace(outer, unsent="feedback")).run_id
        )
    for codec, rank in (("fp32", 0), ("bf16", 0), ("int8", 4)):  # nothing left out to keep
        with pytest.raises(ManifestError, match="outer.unsent.*needs a codec with error feedback"):
            dataclasses.replace(tiny.outer, codec=codec, rank=rank, unsent="weights")
        with pytest.raises(ValueError, match="unsent = weights needs a codec with error feedback"):
            OuterConfig(codec=codec, rank=rank, unsent="weights")
    with pytest.raises(ManifestError, match="outer.unsent.*must be one of feedback, weights"):
        dataclasses.replace(tiny.outer, unsent="anchor")
    with pytest.raises(ValueError, match="unsent must be one of"):
        OuterConfig(unsent="anchor")


def test_low_rank_factors_take_a_dense_codec_and_a_rank_of_at_least_zero():
    from agora_node.node.outer_state import OuterConfig

    for name in DENSE_CODEC_NAMES:
        assert OuterSpec(codec=name, rank=4).rank == 4
        assert OuterConfig(codec=name, rank=4).factor_format().part is from_name(name)
    with pytest.raises(ManifestError, match="outer.codec.*with outer.rank > 0 must be one of"):
        OuterSpec(codec="topk4", rank=4)
    with pytest.raises(ValueError, match="outer codec with rank > 0 must be one of fp32"):
        OuterConfig(codec="topk4", rank=4)
    for bad in (-1, 1.5, True):
        with pytest.raises(ManifestError, match="outer.rank"):
            OuterSpec(rank=bad)
