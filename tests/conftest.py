"""Shared pytest fixtures."""

import os

# Keep torch from oversubscribing the 2-core CI machine when several processes run.
os.environ.setdefault("OMP_NUM_THREADS", "1")
