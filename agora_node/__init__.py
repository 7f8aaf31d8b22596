"""agora-node: train one pipeline stage of a language model with strangers, coordinator-free."""

__version__ = "0.1.0"
