"""Daemon options: what `agora-node join` resolves and a node runs with."""

from __future__ import annotations

from dataclasses import dataclass, field

from agora_node.node.pipeline import PipelineConfig
from agora_node.protocol.manifest import Manifest


@dataclass(kw_only=True)
class NodeConfig:
    initial_peers: list[str]
    identity_path: str
    data_dir: str
    stage: str = "auto"
    manifest: Manifest | None = None
    """A local manifest that must match the swarm's (None: take the swarm's)."""
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    status_host: str = "127.0.0.1"
    status_port: int = 8421
    control_socket: str | None = None
    threads: int = 0
    record_ttl_s: float = 15.0
    refresh_s: float = 3.0
    settle_s: float = 1.5
    """Interval between a joiner's directory reads before it commits to a stage."""
    settle_rounds: int = 8
    rebalance_every_s: float = 60.0
    """Mean interval at which a `--stage auto` node re-evaluates its stage (0: never)."""
    checkpoint_every_s: float = 300.0
    eval_every_s: float = 60.0
    eval_samples: int = 16
    drain_timeout_s: float = 30.0
    max_tokens: int = 0
    """Stage 0 stops injecting after this many tokens, evaluates once and idles (0: never)."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
