"""Error kinds and exit codes shared by the CLI, its commands and the daemon."""

from __future__ import annotations

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad input from the operator: reported as one line, exit code 2."""


class JoinError(RuntimeError):
    """The node cannot join (one line for the operator)."""
