"""Where a stage's wall time goes (node/waits.py), from samples and the rounds' total."""

import pytest

from agora_node.node.waits import Waits, describe

pytestmark = pytest.mark.timeout(30)


def test_samples_split_the_interval_and_outer_comes_from_the_rounds_total():
    now = [100.0]
    waits = Waits(clock=lambda: now[0])
    assert waits.take(blocked_total_s=5.0) == {}  # nothing sampled yet: no split
    for computing, awaiting in [(True, True)] * 4 + [(False, True)] * 5 + [(False, False)]:
        waits.sample(computing=computing, awaiting=awaiting)
    now[0] = 110.0
    split = waits.take(blocked_total_s=6.0)  # 1 s of the 10 s blocked in an outer round
    assert split == pytest.approx({"compute": 0.4, "downstream": 0.5, "idle": 0.1, "outer": 0.1})
    assert waits.last == split
    assert (
        describe(split, stage=1)
        == "compute 40% downstream 50% upstream 10%, outer rounds blocked 10%"
    )
    assert describe(split, stage=0).endswith("idle 10%, outer rounds blocked 10%")
    now[0] = 120.0
    waits.sample(computing=False, awaiting=False)
    assert waits.take(blocked_total_s=6.0) == {"compute": 0, "downstream": 0, "idle": 1, "outer": 0}
