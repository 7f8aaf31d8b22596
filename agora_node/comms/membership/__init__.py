"""Coordinator-free membership: SWIM with Lifeguard, every message signed.

The state machine (`Membership`) is pure and runs unchanged in the simulator;
`MembershipService` drives it over hivemind's libp2p daemon. The service is
imported lazily, so simulations do not import hivemind (and torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agora_node.comms.membership.messages import MemberMeta, Status
from agora_node.comms.membership.settings import MembershipSettings
from agora_node.comms.membership.swim import Membership, MemberView

if TYPE_CHECKING:
    from agora_node.comms.membership.p2p import MembershipService

__all__ = [
    "MemberMeta",
    "MemberView",
    "Membership",
    "MembershipService",
    "MembershipSettings",
    "Status",
]


def __getattr__(name: str) -> object:
    if name == "MembershipService":
        from agora_node.comms.membership.p2p import MembershipService

        return MembershipService
    raise AttributeError(name)
