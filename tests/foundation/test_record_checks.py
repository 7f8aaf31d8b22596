"""Record numbers, freshness and the run pointer: what a stranger's signed value may not say.

Every value here is correctly signed by its own key, so only the range, finiteness
and freshness checks stand between it and placement/routing.
"""

from __future__ import annotations

import json
import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agora_node.protocol.identity import Identity
from agora_node.protocol.records import (
    MAX_CLOCK_SKEW_S,
    MAX_QUEUE,
    MAX_RECORD_TTL_S,
    MAX_STEP,
    MAX_TOKENS,
    NodeRecord,
    RecordError,
    RecordLimits,
    RunPointer,
    verify_record,
    verify_run_pointer,
)
from agora_node.stages.manifest_files import load_manifest

pytestmark = pytest.mark.timeout(60)

ME = Identity.generate()
NOW = 1_800_000_000.0
TINY = load_manifest("tiny")
LIMITS = RecordLimits.for_manifest(TINY)
VALID = {
    "run_id": "r",
    "peer_id": ME.peer_id,
    "stage": 1,
    "state": "active",
    "throughput": 5000.0,
    "queue": 2,
    "version": "0.1.0",
    "inner_step": 10,
    "outer_step": 1,
    "tokens_seen": 10_240,
    "pinned": 0,
    "addrs": [],
    "issued_at": NOW - 1.0,
    "ttl": 15.0,
}


def raw_signed(body: dict, identity: Identity = ME) -> dict[str, bytes]:
    """Sign whatever JSON (NaN and Infinity included) as a hostile peer would."""
    data = json.dumps(body, allow_nan=True).encode()
    return {"r": data, "s": identity.sign(data)}


def check(body: dict, **kwargs) -> NodeRecord:
    args = {"run_id": "r", "peer_id": ME.peer_id, "limits": LIMITS, "now": NOW, **kwargs}
    return verify_record(raw_signed(body), **args)


def reason(body: dict, **kwargs) -> str:
    with pytest.raises(RecordError) as info:
        check(body, **kwargs)
    return info.value.reason


def test_an_honest_record_passes_and_carries_its_ttl():
    record = check(VALID)
    assert record.ttl == 15.0 and record.throughput == 5000.0
    # A record from a peer that predates the ttl field gets the default lifetime.
    old = {k: v for k, v in VALID.items() if k != "ttl"}
    assert check(old).ttl == 15.0
    # Our own records sign what they announce, ttl included.
    own = NodeRecord(run_id="r", peer_id=ME.peer_id, stage=0, ttl=6.0)
    assert verify_record(own.sign(ME), run_id="r", limits=LIMITS).ttl == 6.0


@pytest.mark.parametrize(
    "field,value,label",
    [
        ("throughput", math.inf, "nonfinite"),
        ("throughput", -math.inf, "nonfinite"),
        ("throughput", math.nan, "nonfinite"),
        ("throughput", 1e300, "range"),
        ("throughput", -1.0, "range"),
        ("throughput", 10**400, "range"),
        ("queue", -1, "range"),
        ("queue", MAX_QUEUE + 1, "range"),
        ("stage", 4, "range"),  # tiny has stages 0..3
        ("stage", -1, "range"),
        ("inner_step", -5, "range"),
        ("inner_step", MAX_STEP + 1, "range"),
        ("outer_step", 10**18, "range"),
        ("tokens_seen", MAX_TOKENS + 1, "range"),
        ("tokens_seen", -1, "range"),
        ("pinned", 2, "range"),
        ("utilization", 1.5, "range"),
        ("utilization", -0.1, "range"),
        ("utilization", math.nan, "nonfinite"),
        ("pinned", -1, "range"),
        ("ttl", 0, "range"),
        ("ttl", MAX_RECORD_TTL_S + 1, "range"),
        ("ttl", math.inf, "nonfinite"),
        ("issued_at", math.nan, "nonfinite"),
        ("issued_at", NOW - 15.0 - MAX_CLOCK_SKEW_S - 1, "stale"),
        ("issued_at", NOW - 3600, "stale"),
        ("issued_at", NOW + MAX_CLOCK_SKEW_S + 1, "future"),
        ("issued_at", 1e300, "range"),
    ],
)
def test_each_impossible_number_is_refused_with_its_label(field, value, label):
    assert reason({**VALID, field: value}) == label


def test_non_finite_numbers_in_unknown_fields_and_overflowing_literals_are_refused():
    assert reason({**VALID, "future_field": math.nan}) == "nonfinite"
    data = json.dumps(VALID).replace('"throughput": 5000.0', '"throughput": 1e999').encode()
    with pytest.raises(RecordError) as info:
        verify_record({"r": data, "s": ME.sign(data)}, run_id="r", limits=LIMITS, now=NOW)
    assert info.value.reason == "nonfinite"


def test_freshness_follows_the_records_own_ttl_within_the_skew():
    assert check({**VALID, "issued_at": NOW - 15.0 - MAX_CLOCK_SKEW_S + 0.5})
    assert check({**VALID, "issued_at": NOW + MAX_CLOCK_SKEW_S - 0.5})
    long_lived = {**VALID, "ttl": 120.0, "issued_at": NOW - 100.0}
    assert check(long_lived)
    assert reason({**long_lived, "ttl": 60.0}) == "stale"


def test_throughput_bound_comes_from_the_manifest_and_physics():
    # tiny: 2 layers of width 256 per stage; a 10 PFLOP/s node cannot beat 1e16 / (12 d^2 L).
    cap = 1e16 / (12 * 256 * 256 * 2)
    assert LIMITS.max_throughput == pytest.approx((cap,) * 4)
    assert check({**VALID, "throughput": cap * 0.99})
    assert reason({**VALID, "throughput": cap * 1.01}) == "range"
    # Far above anything a 2-core CPU node measures on tiny (thousands of tokens/s).
    assert cap > 1e6


def test_a_node_never_signs_a_number_others_refuse():
    with pytest.raises(ValueError):
        NodeRecord(run_id="r", peer_id=ME.peer_id, stage=0, throughput=math.inf).sign(ME)


# ---- hostile records, generated ---------------------------------------------------------

_NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 2, -1, 10**400, 2**53, 2**40 + 1, 1e300, -0.0, 5e-324]),
)
_VALUES = st.one_of(
    _NUMBERS,
    st.booleans(),
    st.none(),
    st.text(max_size=8),
    st.lists(st.text(max_size=4), max_size=3),
    st.sampled_from(["active", "joining", "leaving", "warming", "r", ME.peer_id]),
)
_NUMERIC = ("stage", "throughput", "queue", "inner_step", "outer_step", "tokens_seen", "pinned")
_BOUNDS = {
    "stage": (0, TINY.num_stages - 1),
    "queue": (0, MAX_QUEUE),
    "inner_step": (0, MAX_STEP),
    "outer_step": (0, MAX_STEP),
    "tokens_seen": (0, MAX_TOKENS),
    "pinned": (0, 1),
    "ttl": (0, MAX_RECORD_TTL_S),
}


def _in_range(record: NodeRecord) -> bool:
    """The oracle, written apart from RecordLimits.check: what an accepted record must satisfy."""
    for name, (low, high) in _BOUNDS.items():
        value = getattr(record, name)
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if not low <= value <= high:
            return False
    t = record.throughput
    if not (math.isfinite(t) and 0 <= t <= LIMITS.max_throughput[record.stage]):
        return False
    if record.ttl <= 0 or not math.isfinite(record.issued_at):
        return False
    if not NOW - record.ttl - MAX_CLOCK_SKEW_S <= record.issued_at <= NOW + MAX_CLOCK_SKEW_S:
        return False
    return all(not (isinstance(v, float) and not math.isfinite(v)) for v in record.extra.values())


_FIELDS = [*_NUMERIC, "issued_at", "ttl"]


def _build(parts) -> dict:
    (f1, v1), (f2, v2), shift, extra = parts
    body = {**VALID, f1: v1, f2: v2}  # hostile numbers in known fields
    if shift is not None:
        body["issued_at"] = NOW + shift  # replayed or post-dated
    if extra is not None:
        key, value = extra
        if value is _DROP:
            body.pop(key, None)
        else:
            body[key] = value  # any field, known or not, with any JSON value
    return body


_DROP = object()
_CHANGE = st.tuples(st.sampled_from(_FIELDS), _NUMBERS)
hostile_bodies = st.tuples(
    _CHANGE,
    _CHANGE,
    st.none() | st.floats(-4000, 4000, allow_nan=False),
    st.none() | st.tuples(st.sampled_from([*VALID, "x"]), _VALUES | st.just(_DROP)),
).map(_build)


# About 15 s on one busy core of the shared 2-core machine (10^4 signed records).
@pytest.mark.timeout(60)
@settings(
    max_examples=2_500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
@given(hostile_bodies)
def test_thousands_of_hostile_records_never_crash_and_never_pass_out_of_range(body):
    try:
        record = check(body)
    except RecordError:
        return  # refused, with a label; anything else propagates and fails
    assert _in_range(record), body


# ---- the run pointer --------------------------------------------------------------------


def _pointer(**fields) -> RunPointer:
    base = {"run_id": "abcd", "name": "tiny", "publisher": ME.peer_id, "issued_at": NOW}
    return RunPointer(**{**base, **fields})


def test_a_signed_run_pointer_verifies_and_binds_run_id_name_and_time():
    good = _pointer().sign(ME)
    assert verify_run_pointer(good, subkey="abcd", now=NOW).name == "tiny"
    other = Identity.generate()
    cases = [
        ("not", b"tiny"),  # what main stores today: an unsigned name
        ("record", good, {"subkey": "efgh"}),
        ("signature", {**good, "s": other.sign(good["r"])}),
        ("signature", {"r": good["r"].replace(b'"tiny"', b'"evil"'), "s": good["s"]}),
        ("stale", _pointer(issued_at=NOW - 200).sign(ME)),
        ("future", _pointer(issued_at=NOW + 60).sign(ME)),
        ("range", _pointer(ttl=10_000).sign(ME)),
        ("range", _pointer(name="x" * 500).sign(ME)),
        ("nonfinite", raw_signed({**json.loads(good["r"]), "issued_at": math.inf})),
        ("field", raw_signed({**json.loads(good["r"]), "extra": 1})),
    ]
    for label, value, *overrides in cases:
        kwargs = {"subkey": "abcd", "now": NOW, **(overrides[0] if overrides else {})}
        with pytest.raises(RecordError) as info:
            verify_run_pointer(value, **kwargs)
        assert info.value.reason == label, (label, str(info.value))


def test_real_time_default_clock_is_used_when_now_is_not_given():
    record = NodeRecord(run_id="r", peer_id=ME.peer_id, stage=0, issued_at=time.time() - 3600)
    with pytest.raises(RecordError) as info:
        verify_record(record.sign(ME), run_id="r")
    assert info.value.reason == "stale"
