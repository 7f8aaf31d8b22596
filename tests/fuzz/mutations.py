"""Shared pieces of the fuzz tests: the settings profile and structure-aware mutations.

Every decoder that reads bytes or values from the network gets two kinds of input:
arbitrary bytes, and valid encodings mutated the way a hostile peer would (flipped,
truncated, extended or spliced bytes; header fields replaced by arbitrary values,
huge sizes, NaN and infinities; for checksummed formats, re-sealed so that the
mutation reaches the parser behind the checksum).

`AGORA_FUZZ_EXAMPLES` sets the examples per test: CI runs a few dozen, fixed
(derandomized) so that a failure reproduces; `AGORA_FUZZ_EXAMPLES=10000` is the
full run recorded in docs/security.md ("Fuzzing"), random each time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

_CI_EXAMPLES = 40
EXAMPLES = int(os.environ.get("AGORA_FUZZ_EXAMPLES", _CI_EXAMPLES))
TIMEOUT_S = max(300, EXAMPLES // 4)
"""Per test (pytest-timeout): a hang fails the test; the full run gets a quarter second an example."""

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,  # CPU-loaded CI machines: time is checked by the suite's timeout
    database=None,  # nothing written to .hypothesis
    derandomize="AGORA_FUZZ_EXAMPLES" not in os.environ,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        HealthCheck.function_scoped_fixture,
    ],
)

HUGE_INTS = st.sampled_from(
    [-1, 0, 2**31 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**64, 10**30, 10**400, -(10**400)]
)  # 10**400: JSON allows it; beyond float range, math.isfinite raises on it
ODD_FLOATS = st.sampled_from(
    [float("nan"), float("inf"), float("-inf"), -0.0, 1e-320, 1e308, -1.0, 0.0]
)

# Any JSON value, odd numbers and deep nesting included (json.dumps writes NaN and
# Infinity, which Python's json.loads reads back).
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    HUGE_INTS,
    st.floats(),
    ODD_FLOATS,
    st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def deep_json(depth: int) -> bytes:
    """A document nested `depth` levels deep: json.loads raises RecursionError on it."""
    return b"[" * depth + b"]" * depth


@st.composite
def field_edits(draw: st.DrawFn, valid: dict, extra: Sequence[str] = ()) -> dict:
    """`valid` with some fields replaced by arbitrary JSON values, removed or added."""
    body = dict(valid)
    keys = sorted(body) + list(extra)
    for key in draw(st.lists(st.sampled_from(keys), min_size=1, max_size=3, unique=True)):
        how = draw(st.sampled_from(["value", "value", "drop", "deep"]))
        if how == "drop":
            body.pop(key, None)
        elif how == "deep":
            body[key] = json.loads(deep_json(draw(st.integers(1, 40))))
        else:
            body[key] = draw(json_values)
    return body


@st.composite
def mutated(
    draw: st.DrawFn,
    valid: Sequence[bytes],
    seal: Callable[[bytes], bytes] | None = None,
    max_random: int = 512,
) -> bytes:
    """Arbitrary bytes, or one of `valid` mutated; `seal` (if given) re-seals a mutation
    (fixes its checksum) half the time, as a hostile peer rather than a noisy link would."""
    how = draw(st.sampled_from(["random", "valid", "flip", "set", "truncate", "extend", "splice"]))
    if how == "random":
        return draw(st.binary(max_size=max_random))
    data = bytearray(draw(st.sampled_from(list(valid))))
    if how == "flip" and data:
        for _ in range(draw(st.integers(1, 4))):
            bit = draw(st.integers(0, 8 * len(data) - 1))
            data[bit // 8] ^= 1 << (bit % 8)
    elif how == "set" and data:
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.sampled_from([0, 1, 0x7F, 0xFF]))
    elif how == "truncate":
        del data[draw(st.integers(0, len(data))) :]
    elif how == "extend":
        data += draw(st.binary(min_size=1, max_size=64))
    elif how == "splice":
        a = draw(st.integers(0, len(data)))
        b = draw(st.integers(a, len(data)))
        data[a:b] = draw(st.binary(max_size=32))
    out = bytes(data)
    if seal is not None and how != "valid" and draw(st.booleans()):
        out = seal(out)
    return out
