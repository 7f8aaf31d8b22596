"""The handlers' guard without a network: token bucket, admission, deadlines, counts."""

from __future__ import annotations

import asyncio

import pytest

from agora_node.comms import guard as guard_module
from agora_node.comms.guard import Guard, Limits, Reason, Refused, TokenBucket
from tests.node.clock import Clock

pytestmark = pytest.mark.timeout(30)


def test_token_bucket_allows_a_burst_then_the_rate() -> None:
    bucket = TokenBucket(rate=2.0, burst=3, now=0.0)
    assert [bucket.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert not bucket.take(0.4)  # 0.8 of a token refilled
    assert bucket.take(0.5) and not bucket.take(0.5)
    assert [bucket.take(100.0) for _ in range(4)] == [True, True, True, False]  # capped at burst


def test_token_bucket_is_not_refilled_by_a_clock_going_back() -> None:
    bucket = TokenBucket(rate=1.0, burst=1, now=10.0)
    assert bucket.take(10.0)
    assert not bucket.take(5.0) and not bucket.take(10.5)
    assert bucket.take(11.0)


def test_admission_caps_streams_globally_and_per_peer_and_counts_refusals() -> None:
    seen = []
    g = Guard(
        "forward",
        Limits(max_streams=3, max_streams_per_peer=2, rate_per_s=100, burst=100),
        on_refuse=lambda protocol, reason: seen.append((protocol, reason)),
    )
    g.admit("a")
    g.admit("a")
    with pytest.raises(Refused) as info:
        g.admit("a")
    assert info.value.reason == Reason.PEER_STREAMS
    g.admit("b")
    with pytest.raises(Refused) as info:
        g.admit("c")
    assert info.value.reason == Reason.BUSY
    g.release("a")
    g.admit("c")  # a slot freed
    assert (g.active, g.streams_of("a"), g.streams_of("c")) == (3, 1, 1)
    assert dict(g.refused) == {"peer_streams": 1, "busy": 1}
    assert seen == [("forward", "peer_streams"), ("forward", "busy")]


def test_a_flood_from_one_peer_is_refused_by_rate_while_others_are_served() -> None:
    clock = Clock()
    g = Guard("membership", Limits(rate_per_s=5, burst=5), clock=clock)

    def attempt(peer: str) -> bool:
        try:
            g.admit(peer)
        except Refused:
            return False
        g.release(peer)
        return True

    assert sum(attempt("flood") for _ in range(50)) == 5
    assert attempt("honest")
    clock.now += 1.0
    assert sum(attempt("flood") for _ in range(50)) == 5
    assert g.refused == {"rate": 90}


def test_rate_state_is_bounded_in_peers(monkeypatch) -> None:
    monkeypatch.setattr(guard_module, "MAX_TRACKED_PEERS", 16)
    g = Guard("state", Limits(rate_per_s=1, burst=1))
    for n in range(100):
        g.admit(f"peer-{n}")
        g.release(f"peer-{n}")
    assert len(g._buckets) == 16 and g.active == 0 and not g._streams


async def test_the_overall_deadline_cuts_and_counts() -> None:
    g = Guard("state", Limits(deadline_s=0.05))
    with pytest.raises(Refused) as info:
        async with g.serving("a"):
            await asyncio.sleep(5)
    assert info.value.reason == Reason.DEADLINE and g.refused == {"deadline": 1}
    assert g.active == 0  # the slot is released


async def test_a_handlers_own_timeout_is_not_taken_for_the_deadline() -> None:
    g = Guard("state", Limits(deadline_s=5))
    with pytest.raises(TimeoutError):
        async with g.serving("a"):
            await asyncio.wait_for(asyncio.sleep(5), 0.01)
    assert not g.refused


async def test_read_and_drain_deadlines_grow_with_the_bytes() -> None:
    limits = Limits(read_deadline_s=0.05, drain_deadline_s=0.05, min_bytes_per_s=1000)
    assert limits.read_s(1000) == pytest.approx(1.05)
    g = Guard("forward", limits)
    with pytest.raises(Refused) as info:
        await g.read(asyncio.sleep(5))
    assert info.value.reason == Reason.READ_DEADLINE
    assert await g.read(asyncio.sleep(0.2, "body"), nbytes=500) == "body"  # 0.55 s allowed
    with pytest.raises(Refused) as info:
        await g.drain(asyncio.sleep(5), nbytes=10)
    assert info.value.reason == Reason.DRAIN_DEADLINE
    with pytest.raises(Refused) as info:
        g.check_size(11, 10)
    assert info.value.reason == Reason.OVERSIZED
    assert g.refused == {"read_deadline": 1, "drain_deadline": 1, "oversized": 1}


@pytest.mark.parametrize(
    "bad",
    [{"max_streams": 0}, {"rate_per_s": 0}, {"burst": 0.5}, {"deadline_s": float("nan")}],
)
def test_limits_are_validated(bad) -> None:
    with pytest.raises(ValueError):
        Limits(**bad)
