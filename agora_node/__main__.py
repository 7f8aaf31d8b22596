"""`python -m agora_node` is the `agora-node` command (the console script calls `run`).

A stop signal during the command's imports ends it at once, saying so, with exit 0, and
one after it has finished is ignored while the process exits (agora_node/signals.py);
the daemon commands keep the first rule until their event loop handles signals.
"""

import sys

from agora_node import signals


def run() -> None:
    inherited = signals.stop_while_starting()
    try:
        from agora_node.node.cli import entry
    except KeyboardInterrupt:  # Ctrl-C during the imports: no traceback
        print("agora-node: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    signals.restore(inherited)
    try:
        entry()
    finally:
        signals.ignore_while_exiting()


if __name__ == "__main__":
    run()
