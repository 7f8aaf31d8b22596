"""`python -m agora_node` is the `agora-node` command (the console script calls `run`).

The command's imports (torch among them) take seconds, and a SIGTERM, SIGHUP or SIGQUIT
meanwhile met Python's default: the process died with no word (exit -15), where a stop
once the daemon runs is a clean leave with exit 0. Nothing has started then that needs
cleaning up, so such a signal ends the command at once, saying so, with exit 0; the
defaults are back before the command runs (the daemon installs its own handlers).
"""

import signal
import sys

_EARLY = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def _stopped(signum: int, _frame: object) -> None:
    print(f"agora-node: stopped while starting ({signal.Signals(signum).name})", file=sys.stderr)
    raise SystemExit(0)


def run() -> None:
    # a signal ignored by the caller (nohup's SIGHUP) stays ignored; each gets back what it
    # had once the imports are done
    inherited = {sig: signal.getsignal(sig) for sig in _EARLY}
    for sig, handler in inherited.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, _stopped)
    try:
        from agora_node.node.cli import entry
    except KeyboardInterrupt:  # Ctrl-C during the imports: no traceback
        print("agora-node: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    for sig, handler in inherited.items():
        signal.signal(sig, handler)
    entry()


if __name__ == "__main__":
    run()
