import pytest

from tests.integration.harness import TestSwarm


@pytest.fixture
def swarm(tmp_path):
    s = TestSwarm(tmp_path)
    try:
        yield s
    finally:
        s.stop(grace_s=10)  # SIGTERM, then SIGKILL of every process group, by pid
