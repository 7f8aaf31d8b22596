"""Fault-tolerant collectives among replicas of a stage: group formation through the
DHT, reduce-scatter/all-gather over hivemind P2P with per-part deadlines, backup
owners for spans whose reducer died, robust aggregation, codec-framed payloads.
"""

from agora_node.comms.collective.aggregate import Aggregation, AggregationSpec, aggregate
from agora_node.comms.collective.allreduce import AllReduce, Outcome
from agora_node.comms.collective.deadlines import Deadlines
from agora_node.comms.collective.groups import (
    DHTBoard,
    Matchmaker,
    MatchmakingConfig,
    MemoryBoard,
    RoundEntry,
    RoundView,
)
from agora_node.comms.collective.handlers import Responder
from agora_node.comms.collective.local import LocalNetwork, LocalTransport
from agora_node.comms.collective.payload import PartEncoder, WireFormat, plain_format
from agora_node.comms.collective.plan import GroupPlan, partition
from agora_node.comms.collective.state import CollectiveStats, RoundBook, RoundState

__all__ = [
    "AllReduce",
    "Aggregation",
    "AggregationSpec",
    "CollectiveStats",
    "DHTBoard",
    "Deadlines",
    "GroupPlan",
    "LocalNetwork",
    "LocalTransport",
    "Matchmaker",
    "MatchmakingConfig",
    "MemoryBoard",
    "Outcome",
    "PartEncoder",
    "Responder",
    "RoundBook",
    "RoundEntry",
    "RoundState",
    "RoundView",
    "WireFormat",
    "aggregate",
    "partition",
    "plain_format",
]
