"""`python -m agora_node` is the `agora-node` command."""

from agora_node.node.cli import entry

entry()
