import pytest

from tests.integration.harness import TestSwarm


@pytest.fixture
def swarm(tmp_path):
    s = TestSwarm(tmp_path)
    try:
        yield s
    finally:
        s.stop(grace_s=10)  # SIGTERM, then SIGKILL of every process group, by pid


@pytest.fixture
def lab():
    """A network lab (tests/netlab.py), or a skip saying why this machine has none; every
    namespace it made is deleted afterwards, and the test fails if one is left."""
    from tests.netlab import NetLab, why_not

    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    built = NetLab.create()
    try:
        yield built
    finally:
        built.destroy()
        assert built.leftovers() == [], "network namespaces left behind"
