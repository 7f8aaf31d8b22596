"""The small pure pieces: Lifeguard maths, the gossip queue, replay window, settings."""

from __future__ import annotations

import pytest

from agora_node.comms.membership.dissemination import GossipQueue
from agora_node.comms.membership.lifeguard import Awareness, Suspicion
from agora_node.comms.membership.replay import ReplayGuard
from agora_node.comms.membership.settings import MembershipSettings
from agora_node.comms.membership.timers import TimerQueue

pytestmark = pytest.mark.timeout(10)


def test_awareness_stretches_timeouts_within_bounds() -> None:
    health = Awareness(max_multiplier=4)
    assert health.scale(0.5) == 0.5
    health.apply(10)
    assert health.score == 3 and health.scale(0.5) == 2.0
    health.apply(-10)
    assert health.score == 0


def test_suspicion_timeout_falls_from_max_to_min_with_confirmations() -> None:
    s = Suspicion("x", 0, start=100.0, low=2.0, high=12.0, expected=3, accusers={"a"})
    timeouts = [s.timeout()]
    for accuser in ("b", "c", "d"):
        assert s.confirm(accuser)
        timeouts.append(s.timeout())
    assert timeouts[0] == 12.0 and timeouts[-1] == 2.0
    assert timeouts == sorted(timeouts, reverse=True) and len(set(timeouts)) == 4
    assert not s.confirm("e") and not s.confirm("b")  # enough, or already counted
    assert s.deadline == 102.0


def test_suspicion_without_expected_confirmations_uses_the_minimum() -> None:
    s = Suspicion("x", 0, start=0.0, low=2.0, high=12.0, expected=0, accusers={"a"})
    assert s.timeout() == 2.0


def test_gossip_queue_bounds_retransmissions_and_prefers_fresh_news() -> None:
    queue = GossipQueue()
    queue.push("a", b"A")
    queue.push("b", b"B")
    assert sorted(queue.take(2, limit=3)) == [b"A", b"B"]
    queue.push("c", b"C")
    assert queue.take(1, limit=3) == [b"C"]  # least sent first
    queue.push("a", b"A2")  # newer news about a replaces the old
    taken = [queue.take(8, limit=3) for _ in range(4)]
    assert sorted(taken[0]) == [b"A2", b"B", b"C"] and taken[-1] == []
    assert len(queue) == 0


def test_replay_guard_accepts_each_sequence_number_once_within_a_window() -> None:
    guard = ReplayGuard(window=8)
    assert guard.accept("p", 10)
    assert not guard.accept("p", 10)
    assert guard.accept("p", 8)  # reordered, still inside the window
    assert not guard.accept("p", 8)
    assert guard.accept("p", 20)
    assert not guard.accept("p", 12)  # fell out of the window
    assert guard.accept("q", 1)  # per sender


def test_timer_queue_skips_cancelled_timers() -> None:
    timers = TimerQueue()
    first = timers.add(1.0, 0, "a")
    timers.add(2.0, 1, "b")
    first.cancel()
    assert timers.next_deadline() == 2.0
    assert [t.key for t in timers.pop_due(5.0)] == ["b"]
    assert timers.next_deadline() == float("inf")


def test_settings_validate_and_scale_with_cluster_size() -> None:
    s = MembershipSettings()
    low, high = s.suspicion_bounds(1000)
    assert low == pytest.approx(s.suspicion_mult * 3 * s.probe_interval_s)
    assert high == pytest.approx(low * s.suspicion_max_mult)
    assert s.retransmit_limit(1000) == s.retransmit_mult * 4
    assert s.push_pull_period(10) == s.push_pull_interval_s < s.push_pull_period(1000)
    with pytest.raises(ValueError):
        MembershipSettings(probe_interval_s=0.5, probe_timeout_s=0.5)
    assert MembershipSettings.memberlist_lan().probe_interval_s == 1.0
