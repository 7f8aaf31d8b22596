"""Router: least expected completion time, load spread, bans with back-off, probing."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agora_node.comms.routing import MIN_SERVICE_SHARE, FailureKind, Router, RouterConfig
from agora_node.protocol.records import NodeState

from .helpers import record

pytestmark = pytest.mark.timeout(60)

TOKENS = 1024


def router(seed: int = 0, **config) -> Router:
    return Router(RouterConfig(tokens_per_item=TOKENS, **config), random.Random(seed))


def announce(r: Router, **throughputs: float) -> None:
    r.update_announced(record(p, 1, throughput=t) for p, t in throughputs.items())


def test_prefers_the_faster_peer_by_announced_throughput() -> None:
    r = router()
    announce(r, slow=1000.0, fast=4000.0)
    assert r.choose(["slow", "fast"], now=0.0) == "fast"
    assert r.expected_time("fast") == pytest.approx(TOKENS / 4000.0)


def test_observed_latency_overrides_announced_throughput() -> None:
    r = router()
    announce(r, a=4000.0, b=1000.0)  # a announces fast but is slow for us (far away)
    for peer, latency in [("a", 3.0), ("b", 0.5)]:
        r.on_sent(peer, 0.0)
        r.on_success(peer, latency, 1.0)
    assert r.choose(["a", "b"], now=2.0) == "b"


def test_latency_is_an_ema() -> None:
    r = router(ema_alpha=0.5)
    for latency in (1.0, 3.0):
        r.on_sent("a", 0.0)
        r.on_success("a", latency, 0.0)
    assert r.item_time("a") == pytest.approx(2.0)


def test_a_peer_slow_once_is_measured_again_after_a_while() -> None:
    """A replica whose first micro-batch was slow (a cold start) was never chosen again,
    so never measured again: one of three replicas of a stage trained 1 micro-batch in 4
    minutes while the others took every one."""
    r = router()
    r.on_sent("cold", 0.0)
    r.on_success("cold", 10.0, now=10.0)  # its first micro-batch: 10 s
    now, chosen = 10.0, []
    while now < 10.0 + 3 * r.config.remeasure_s:  # one sender, one micro-batch at a time
        peer = r.choose(["cold", "warm"], now)
        chosen.append(peer)
        r.on_sent(peer, now)
        now += 0.3
        r.on_success(peer, 0.3, now)  # both answer in 0.3 s now
    assert chosen[0] == "warm"
    first = chosen.index("cold")  # probed again once its sample went stale
    assert 0.3 * first >= r.config.remeasure_s - 0.3
    assert r.item_time("cold") == pytest.approx(0.3)  # the new sample replaced the old
    assert chosen[first + 1 :].count("cold") >= len(chosen[first + 1 :]) // 4  # used again


def test_spreads_load_by_in_flight_counts() -> None:
    r = router()
    announce(r, a=2000.0, b=2000.0, c=1000.0)
    sent = Counter()
    for _ in range(10):
        peer = r.choose(["a", "b", "c"], now=0.0)
        r.on_sent(peer, 0.0)
        sent[peer] += 1
    # Expected time (n + 1) * T: a and b twice as fast as c, so about 4:4:2.
    assert sent["a"] == pytest.approx(4, abs=1) and sent["b"] == pytest.approx(4, abs=1)
    assert 1 <= sent["c"] <= 3


def test_announced_queue_counts() -> None:
    r = router()
    r.update_announced(
        [record("a", 1, throughput=2000.0, queue=5), record("b", 1, throughput=1000.0)]
    )
    assert r.choose(["a", "b"], now=0.0) == "b"  # 6 x 0.5 s vs 1 x 1 s


def test_skips_banned_peers_until_the_ban_ends() -> None:
    r = router(ban_s=2.0)
    announce(r, a=4000.0, b=1000.0)
    r.on_sent("a", 0.0)
    r.on_failure("a", 0.0, FailureKind.ERROR)
    assert r.choose(["a", "b"], now=1.0) == "b"
    assert r.choose(["a"], now=1.9) is None
    assert r.choose(["a", "b"], now=2.0) == "a"


def test_back_off_grows_on_repeated_failures_and_resets_on_success() -> None:
    r = router(ban_s=1.0, max_ban_s=6.0)
    bans = []
    now = 0.0
    for _ in range(5):
        r.on_sent("a", now)
        r.on_failure("a", now, "timeout")
        bans.append(r.snapshot(now)["a"]["banned_for_s"])
        now = r.snapshot()["a"]["banned_until"]
    assert bans == [1.0, 2.0, 4.0, 6.0, 6.0]
    r.on_sent("a", now)
    r.on_success("a", 0.1, now)
    assert r.snapshot(now)["a"]["banned_for_s"] == 0.0
    r.on_sent("a", now)
    r.on_failure("a", now, FailureKind.REJECTED)
    assert r.snapshot(now)["a"]["banned_for_s"] == 1.0


def test_busy_is_a_short_pause_not_a_step_to_a_long_ban() -> None:
    r = router(busy_backoff_s=0.25, ban_s=2.0)
    for t in (0.0, 1.0, 2.0):
        r.on_sent("a", t)
        r.on_failure("a", t, FailureKind.BUSY)
        assert r.snapshot(t)["a"]["banned_for_s"] == 0.25
    assert r.snapshot()["a"]["consecutive_failures"] == 0
    r.on_failure("a", 3.0, FailureKind.ERROR)
    assert r.snapshot(3.0)["a"]["banned_for_s"] == 2.0


def test_new_peers_get_probed() -> None:
    r = router()
    for _ in range(3):
        r.on_sent("old", 0.0)
        r.on_success("old", 0.2, 0.0)
    assert r.choose(["old", "new"], now=1.0) == "new"
    r.on_sent("new", 1.0)
    # Once a probe is out, it is estimated like the best known peer, not better.
    picks = Counter()
    for _ in range(4):
        peer = r.choose(["old", "new"], now=1.0)
        r.on_sent(peer, 1.0)
        picks[peer] += 1
    assert picks["old"] >= 2


def test_with_no_data_at_all_every_peer_is_equal_and_ties_are_random() -> None:
    chosen = {router(seed).choose(["a", "b", "c"], now=0.0) for seed in range(30)}
    assert chosen == {"a", "b", "c"}


def test_exclude_and_unusable_states() -> None:
    r = router()
    r.update_announced(
        [
            record("joining", 1, NodeState.JOINING, throughput=9000.0),
            record("leaving", 1, NodeState.LEAVING, throughput=9000.0),
            record("warming", 1, NodeState.WARMING, throughput=100.0),
            record("active", 1, NodeState.ACTIVE, throughput=200.0),
        ]
    )
    everyone = ["joining", "leaving", "warming", "active"]
    assert r.choose(everyone, now=0.0) == "active"
    assert r.choose(everyone, now=0.0, exclude=["active"]) == "warming"
    assert r.choose(everyone, now=0.0, exclude=["active", "warming"]) is None
    assert r.choose([], now=0.0) is None


def test_snapshot_is_json() -> None:
    r = router()
    announce(r, a=100.0)
    r.on_sent("a", 0.0)
    r.on_failure("a", 0.0, "busy")
    snap = r.snapshot(0.1)
    json.dumps(snap)
    assert snap["a"]["in_flight"] == 0 and snap["a"]["last_failure"] == "busy"


def test_bad_config_and_kinds_are_refused() -> None:
    with pytest.raises(ValueError):
        RouterConfig(tokens_per_item=0)
    with pytest.raises(ValueError):
        router().on_failure("a", 0.0, "exploded")


_events = st.lists(
    st.tuples(
        st.sampled_from(["sent", "ok", "busy", "timeout", "error", "rejected"]),
        st.sampled_from("abcd"),
        st.floats(0.0, 5.0),
    ),
    max_size=40,
)


@given(_events, st.floats(0.0, 100.0), st.sets(st.sampled_from("abcd")))
@settings(max_examples=100, deadline=None)
def test_choice_is_usable_and_has_the_least_expected_time(events, now, exclude) -> None:
    r = router()
    announce(r, a=1000.0, b=2000.0)
    t = 0.0
    for kind, peer, dt in events:
        t += dt
        if kind == "sent":
            r.on_sent(peer, t)
        elif kind == "ok":
            r.on_success(peer, dt, t)
        else:
            r.on_failure(peer, t, kind)
    candidates = list("abcd")
    chosen = r.choose(candidates, now=t + now, exclude=exclude)
    usable = [p for p in candidates if p not in exclude and r.usable(p, t + now)]
    if not usable:
        assert chosen is None
        return
    assert chosen in usable
    default = min((x for p in usable if (x := r.item_time(p)) is not None), default=1.0)
    best = min(r.expected_time(p, default=default, now=t + now) for p in usable)
    assert r.expected_time(chosen, default=default, now=t + now) <= best * (1 + 1e-9)
    assert all(v["in_flight"] >= 0 for v in r.snapshot().values())


def test_routing_does_not_import_hivemind() -> None:
    code = "import sys, agora_node.comms.routing; print('hivemind' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_gpu_peer_and_a_cpu_peer_share_work_in_proportion_to_their_speed() -> None:
    """Heterogeneous replicas of a stage (a GPU node 4x a CPU node): announced rates are
    tokens per compute-second on any device, so the router's first picks follow them,
    and under load the measured latencies keep each busy in proportion to its speed."""
    service = {"gpu": 0.25, "cpu": 1.0}  # seconds per micro-batch when idle
    r = router()
    announce(r, gpu=TOKENS / service["gpu"], cpu=TOKENS / service["cpu"])
    free_at = dict.fromkeys(service, 0.0)  # each peer works its queue one at a time
    done: list[tuple[float, str, float]] = []  # (finish time, peer, sent at)
    sent, window, now = Counter(), 4, 0.0
    for _ in range(400):
        while len(done) >= window:  # the sender keeps `window` micro-batches in flight
            done.sort()
            now, peer, at = done.pop(0)
            r.on_success(peer, now - at, now)
        peer = r.choose(list(service), now=now)
        r.on_sent(peer, now)
        free_at[peer] = max(free_at[peer], now) + service[peer]
        done.append((free_at[peer], peer, now))
        sent[peer] += 1
    share = sent["gpu"] / sum(sent.values())
    assert 0.72 <= share <= 0.88, sent  # speeds 4:1 -> 0.8
    # both stay in use: the slow node is not starved
    assert sent["cpu"] >= 0.12 * sum(sent.values())


def _measured(r: Router, peer: str, latency: float) -> None:
    r.on_sent(peer, 0.0)
    r.on_success(peer, latency, 0.0)


def test_the_round_trip_is_charged_once_not_per_micro_batch_ahead() -> None:
    rtts = {"far": 0.100, "near": 0.005}
    r = Router(RouterConfig(tokens_per_item=TOKENS), random.Random(0), rtt_of=rtts.get)
    _measured(r, "far", 0.150)  # 100 ms of link, 50 ms of compute (and downstream)
    _measured(r, "near", 0.105)  # 5 ms of link, 100 ms of compute
    assert r.item_time("far") == pytest.approx(0.050)
    assert r.choose(["far", "near"], now=1.0) == "near"  # nothing ahead: near is sooner
    for _ in range(3):
        r.on_sent("far", 1.0)
        r.on_sent("near", 1.0)
    # three ahead at each: far 0.1 + 4 x 0.05 = 0.3 s, near 0.005 + 4 x 0.1 = 0.405 s
    assert r.expected_time("far") == pytest.approx(0.300)
    assert r.expected_time("near") == pytest.approx(0.405)
    assert r.choose(["far", "near"], now=1.0) == "far"
    # a router without round trips charges each latency per micro-batch ahead, as before
    blind = Router(RouterConfig(tokens_per_item=TOKENS), random.Random(0))
    for peer, latency in (("far", 0.150), ("near", 0.105)):
        _measured(blind, peer, latency)
        for _ in range(3):
            blind.on_sent(peer, 1.0)
    assert blind.choose(["far", "near"], now=1.0) == "near"


@pytest.mark.parametrize("rtt", [math.nan, math.inf, -1.0, "fast", 10.0])
def test_an_implausible_round_trip_counts_for_nothing_or_is_bounded(rtt) -> None:
    r = Router(RouterConfig(tokens_per_item=TOKENS), random.Random(0), rtt_of=lambda _p: rtt)
    _measured(r, "a", 0.2)
    expected = r.expected_time("a")
    assert math.isfinite(expected)
    if rtt == 10.0:  # longer than the request itself: the service time keeps its floor
        assert r.item_time("a") == pytest.approx(MIN_SERVICE_SHARE * 0.2)
    else:
        assert expected == pytest.approx(0.2)  # nothing in flight, no round trip


def test_a_peer_that_delays_its_probe_answers_gains_a_bounded_share() -> None:
    """It cannot shorten its measured latency, only lengthen its probes' round trip:
    at most its latency x MIN_SERVICE_SHARE per micro-batch ahead."""
    rtts = {"liar": 0.999, "honest": 0.0}
    r = Router(RouterConfig(tokens_per_item=TOKENS), random.Random(0), rtt_of=rtts.get)
    for peer in rtts:
        _measured(r, peer, 0.1)
    sent = Counter()
    for _ in range(50):
        peer = r.choose(list(rtts), now=1.0)
        sent[peer] += 1
        r.on_sent(peer, 1.0)
    assert sent["liar"] <= sent["honest"] / MIN_SERVICE_SHARE + 4
    assert sent["honest"] > 0
