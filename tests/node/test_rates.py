"""RateWindow: sums over the last span, per own second and per wall second."""

import pytest

from agora_node.node.rates import RateWindow
from tests.node.clock import Clock

pytestmark = pytest.mark.timeout(30)


def test_per_second_divides_sums_not_averages_ratios():
    clock = Clock()
    w = RateWindow(60, clock)
    w.add(1000, 0.1)  # 10,000/s
    w.add(1000, 0.9)  # ~1,111/s; the pair together did 2,000 in 1 s
    assert w.per_second() == pytest.approx(2000)


def test_old_events_leave_the_window_and_a_draining_one_keeps_its_last_rate():
    clock = Clock()
    w = RateWindow(60, clock)
    for _ in range(8):
        w.add(500, 1.0)
    clock.now += 30
    for _ in range(8):
        w.add(300, 1.0)
    assert w.per_second() == pytest.approx(400)
    clock.now += 40  # the first eight are 70 s old
    assert w.per_second() == pytest.approx(300)
    clock.now += 10
    for _ in range(3):  # the node goes idle: a few last micro-batches, on a quieter machine
        w.add(900, 1.0)
    clock.now += 25  # the eight at 300 left: the last eight events measure it
    assert w.per_second() == pytest.approx((5 * 300 + 3 * 900) / 8)
    clock.now += 100  # nothing left: an idle node keeps its measured speed
    assert w.per_second() == pytest.approx((5 * 300 + 3 * 900) / 8)
    assert w.per_wall_second() == 0


def test_a_lightly_loaded_node_keeps_measuring():
    """One micro-batch every 9 s: a rate frozen at the first one (50) was announced for
    good, the node never holding 8 events in a minute."""
    clock = Clock()
    w = RateWindow(60, clock)
    w.add(50, 1.0)
    for _ in range(60):
        clock.now += 9
        w.add(111, 1.0)
    assert w.per_second() == pytest.approx(111)


def test_per_wall_second_counts_from_creation_then_the_span():
    clock = Clock()
    w = RateWindow(60, clock)
    clock.now += 10
    w.add(5.0)
    assert w.per_wall_second() == pytest.approx(0.5)  # 10 s old, not a full span
    clock.now += 40
    w.add(5.0)
    assert w.per_wall_second() == pytest.approx(10 / 50)
    clock.now += 25  # the first event is 65 s old and fell out; the span is 60 s
    assert w.per_wall_second() == pytest.approx(5 / 60)


def test_span_must_be_positive():
    with pytest.raises(ValueError, match="span_s"):
        RateWindow(0)
