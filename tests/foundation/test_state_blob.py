"""The joiner's strict decoder of a replica's state (protocol/state_blob.py)."""

import os
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agora_node.node.outer_state import OuterState
from agora_node.protocol import state_blob
from agora_node.protocol.state_blob import StateFormatError, decode, encode

pytestmark = pytest.mark.timeout(60)

N = 37


def _state(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, generator=g), torch.randn(N, generator=g)


def test_round_trip_and_digests_match_the_outer_state():
    module = torch.nn.Linear(6, 5)  # 35 weights + 5 biases
    outer = OuterState(module, lr=0.7, momentum=0.9)
    outer.momentum = torch.randn(outer.numel)
    outer.round = 7
    got = decode(encode(outer.round, outer.anchor, outer.momentum), outer.numel)
    assert got.round == 7
    assert torch.equal(got.anchor, outer.anchor) and torch.equal(got.momentum, outer.momentum)
    assert got.digests() == (outer.digest(), outer.digest(with_momentum=True))
    no_momentum = decode(encode(3, outer.anchor, None), outer.numel)
    assert no_momentum.momentum is None and no_momentum.digests() == (outer.digest(), None)


def test_the_bound_is_known_before_reading():
    anchor, momentum = _state()
    assert len(encode(1, anchor, momentum)) == state_blob.max_bytes(N)


def _corrupt(kind: str) -> bytes:
    anchor, momentum = _state()
    blob = encode(2, anchor, momentum)
    header = state_blob.HEADER_BYTES
    if kind == "magic":
        return b"XXXXXXXX" + blob[8:]
    if kind == "numel":
        return encode(2, torch.zeros(N + 1), torch.zeros(N + 1))
    if kind == "truncated":
        return blob[:-1]
    if kind == "trailing":
        return blob + b"\0\0\0\0"
    if kind == "flags":
        return blob[: header - 1] + b"\x02" + blob[header:]
    if kind == "round":
        return struct.pack("<8sqQB", state_blob.MAGIC, -1, N, 1) + blob[header:]
    if kind == "nan":
        anchor[3] = float("nan")
        return encode(2, anchor, momentum)
    if kind == "inf-momentum":
        momentum[-1] = float("inf")
        return encode(2, anchor, momentum)
    if kind == "empty":
        return b""
    if kind == "pickle":
        import io

        buf = io.BytesIO()
        torch.save({"model": {}}, buf)  # the previous format: not accepted
        return buf.getvalue()
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    [
        "magic",
        "numel",
        "truncated",
        "trailing",
        "flags",
        "round",
        "nan",
        "inf-momentum",
        "empty",
        "pickle",
    ],
)
def test_malformed_states_are_refused(kind):
    with pytest.raises(StateFormatError):
        decode(_corrupt(kind), N)


_VALID = encode(5, *_state(1))


@st.composite
def _blobs(draw) -> bytes:
    how = draw(st.sampled_from(["random", "flip", "splice", "header"]))
    if how == "random":
        return draw(st.binary(max_size=2 * state_blob.max_bytes(N)))
    data = bytearray(_VALID)
    if how == "flip":
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
        return bytes(data)
    if how == "splice":
        a = draw(st.integers(0, len(data)))
        b = draw(st.integers(a, len(data)))
        return bytes(data[:a]) + draw(st.binary(max_size=64)) + bytes(data[b:])
    fields = draw(
        st.tuples(
            st.integers(-(2**63), 2**63 - 1),
            st.integers(0, 2**64 - 1),
            st.integers(0, 255),
        )
    )
    return struct.pack("<8sqQB", state_blob.MAGIC, *fields) + bytes(data[state_blob.HEADER_BYTES :])


@settings(
    max_examples=max(500, int(os.environ.get("AGORA_FUZZ_EXAMPLES", 0))),  # tests/fuzz/mutations.py
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(_blobs())
def test_fuzzed_states_never_crash_the_decoder(blob):
    try:
        got = decode(blob, N)
    except StateFormatError:
        return
    # Whatever passes is exactly well formed: right size, finite values.
    assert got.anchor.shape == (N,) and got.anchor.dtype == torch.float32
    assert torch.isfinite(got.anchor).all()
    assert got.momentum is None or (
        got.momentum.shape == (N,) and torch.isfinite(got.momentum).all()
    )
    assert 0 <= got.round <= state_blob.MAX_ROUND
