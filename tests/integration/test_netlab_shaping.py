"""The network lab's link shaping (tests/netlab.py, `NetLab.shape`): a host's uplink and
downlink each go through a kernel token bucket, which holds back a burst sent faster
than its rate. No daemons: a UDP burst from one namespace to another."""

from __future__ import annotations

import pytest

from tests.netlab import NetLab

pytestmark = [pytest.mark.netlab, pytest.mark.timeout(120)]

BLAST = (
    "import socket\n"
    "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
    "for _ in range({count}):\n"
    "    s.sendto(bytes(1400), ('{to}', 9))\n"
)


def _blast(lab: NetLab, host, to: str, count: int = 2000) -> None:  # noqa: ANN001
    """About 2.8 MB of UDP from `host` to `to`, as fast as the socket takes it."""
    lab.run_in(host, "python3", "-c", BLAST.format(count=count, to=to))


@pytest.mark.parametrize("behind_nat", [False, True])
def test_a_shaped_host_sends_and_receives_through_its_token_buckets(
    lab: NetLab, behind_nat: bool
) -> None:
    """What leaves the host goes through its uplink's bucket (behind a NAT too), what
    comes to it through its downlink's; unshaped hosts have none."""
    home = lab.behind_nat("home") if behind_nat else lab.public("home")
    peer = lab.public("peer")
    lab.shape(home, up_mbit=8, down_mbit=16)
    _blast(lab, home, peer.ip)
    up = lab.shaper_counts(home)["up"]
    # the burst (2.8 MB, written as fast as the socket takes it) went through the
    # uplink's bucket, which had to hold it back: UDP senders block on a full queue
    assert up["sent_bytes"] >= 1_000_000 and up["overlimits"] > 0, up
    with pytest.raises(RuntimeError, match="not shaped"):
        lab.shaper_counts(peer)
    if behind_nat:
        lab.unshape(home)
        with pytest.raises(RuntimeError, match="not shaped"):
            lab.shaper_counts(home)
    if not behind_nat:  # (a NAT router passes in only what the inside opened)
        _blast(lab, peer, home.ip)
        down = lab.shaper_counts(home)["down"]
        # the peer's own uplink is free: the burst meets the bucket at the switch, which
        # passes its rate (and a 200 ms queue) and drops the rest, as a home link would
        # (how much it passed depends on how fast the burst came: the machine's load)
        assert 0 < down["sent_bytes"] < 2_000 * 1400 and down["dropped"] > 0, down
