"""Protocol settings of SWIM + Lifeguard membership, and the timeouts derived from them.

Every interval is in seconds of the injected clock. Values that depend on the
cluster size n (suspicion timeouts, retransmit limit, push-pull period) are
derived here so the state machine and the simulator use the same formulas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from agora_node.comms.membership.messages import MAX_ENTRIES


@dataclass(frozen=True, kw_only=True)
class MembershipSettings:
    """SWIM/Lifeguard knobs. Defaults are tuned with bench/membership_sim.py (see
    docs/membership.md) for ~1000 members, 100 ms RTT and 5% loss."""

    probe_interval_s: float = 0.5
    """One member is probed per interval (before the local-health multiplier)."""
    probe_timeout_s: float = 0.2
    """Wait this long for a direct ack before asking `indirect_checks` members to probe."""
    indirect_timeout_s: float = 0.4
    """Then wait this long for an indirect ack (two round trips) before suspecting."""
    indirect_checks: int = 3
    """How many members relay a ping (ping-req) when the direct ping gets no ack."""
    suspicion_mult: float = 2.0
    """Minimum suspicion timeout = suspicion_mult * max(1, log10(n)) * probe_interval_s."""
    suspicion_max_mult: float = 6.0
    """Maximum suspicion timeout = suspicion_max_mult * minimum (no confirmations yet)."""
    suspicion_confirmations: int = 3
    """Independent accusers after which the timeout has shrunk to the minimum (Lifeguard K)."""
    retransmit_mult: int = 3
    """Each member sends each gossip item retransmit_mult * max(2, ceil(log10(n + 1))) times."""
    max_piggyback: int = 8
    """Gossip items piggy-backed on one message at most."""
    gossip_interval_s: float = 0.5
    """While there is news to spread, send it to `gossip_fanout` members this often."""
    gossip_fanout: int = 2
    """Members that get a gossip-only message per gossip interval (0 disables)."""
    gossip_to_dead_s: float = 30.0
    """Keep gossiping to members declared dead this long, so a live one can refute."""
    push_pull_interval_s: float = 30.0
    """Full state sync with one random member, scaled up with log2(n) above 32 members."""
    reconnect_interval_s: float = 10.0
    """Push-pull with a dead member or a seed this often, so healed partitions merge."""
    dead_retention_s: float = 300.0
    """Dead and left members are remembered this long, so stale news cannot resurrect them."""
    max_awareness: int = 8
    """Lifeguard local-health multiplier cap: timeouts stretch by up to this factor."""
    max_members: int = 8192
    """Other members remembered at most (identities are free): when full, a new one takes
    the place of the member dead or gone longest, or is dropped if every one is live."""
    max_relays: int = 1024
    """Ping-reqs carried out for others at once; more are dropped (each lives ~2 nack delays)."""

    def __post_init__(self) -> None:
        if not 0 < self.probe_timeout_s < self.probe_interval_s:
            raise ValueError("need 0 < probe_timeout_s < probe_interval_s")
        if self.indirect_timeout_s <= 0:
            raise ValueError("indirect_timeout_s must be > 0")
        if self.indirect_checks < 0 or self.gossip_fanout < 0:
            raise ValueError("indirect_checks and gossip_fanout must be >= 0")
        if self.suspicion_mult <= 0 or self.suspicion_max_mult < 1:
            raise ValueError("need suspicion_mult > 0 and suspicion_max_mult >= 1")
        if not 1 <= self.max_members < MAX_ENTRIES or self.max_relays < 0:
            raise ValueError(f"need 1 <= max_members < {MAX_ENTRIES} and max_relays >= 0")
        if self.retransmit_mult < 1 or self.max_piggyback < 1 or self.max_awareness < 1:
            raise ValueError("retransmit_mult, max_piggyback and max_awareness must be >= 1")
        for name in ("gossip_interval_s", "push_pull_interval_s", "reconnect_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")

    @classmethod
    def memberlist_lan(cls) -> MembershipSettings:
        """hashicorp/memberlist DefaultLANConfig, the side-by-side anchor."""
        return cls(
            probe_interval_s=1.0,
            probe_timeout_s=0.5,
            indirect_timeout_s=0.5,  # memberlist decides at the end of the probe interval
            indirect_checks=3,
            suspicion_mult=4.0,
            suspicion_max_mult=6.0,
            suspicion_confirmations=2,  # memberlist uses suspicion_mult - 2
            retransmit_mult=4,
            gossip_interval_s=0.2,
            gossip_fanout=3,
            push_pull_interval_s=30.0,
        )

    def with_overrides(self, **changes: object) -> MembershipSettings:
        return replace(self, **changes)

    def suspicion_bounds(self, n: int) -> tuple[float, float]:
        """(minimum, maximum) suspicion timeout for a cluster of n members."""
        low = self.suspicion_mult * max(1.0, math.log10(max(n, 1))) * self.probe_interval_s
        return low, low * self.suspicion_max_mult

    def retransmit_limit(self, n: int) -> int:
        # the floor of 2 keeps small clusters from missing news (memberlist has 1)
        return self.retransmit_mult * max(2, math.ceil(math.log10(n + 1)))

    def push_pull_period(self, n: int) -> float:
        # memberlist's pushPullScale: full syncs cost O(n) each, so slow them as n grows
        if n <= 32:
            return self.push_pull_interval_s
        return self.push_pull_interval_s * (math.ceil(math.log2(n) - math.log2(32)) + 1)

    def detection_bound_s(self, n: int) -> float:
        """Worst case crash-to-dead at one healthy observer with no losses beyond the
        indirect probes: every member probes the crashed one within n - 1 periods,
        then the longest suspicion. Used by tests as 'the configured bound'."""
        _, high = self.suspicion_bounds(n)
        probe = self.probe_timeout_s + self.indirect_timeout_s
        return (n - 1) * self.probe_interval_s + probe + high
